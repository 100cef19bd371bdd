"""Train a LoRA-family adapter for Qwen-Image with musubi-tuner's command line: train_network.py's recipe with the
Qwen-Image family.

    accelerate launch qwen_image_train_network.py --dit qwen_image_bf16.safetensors --vae qwen_image_vae.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --model_version original --dataset_config dataset.toml --sdpa \
        --mixed_precision bf16 --timestep_sampling shift --weighting_scheme none --discrete_flow_shift 2.2 \
        --optimizer_type adamw8bit --learning_rate 5e-5 --gradient_checkpointing --max_data_loader_n_workers 2 \
        --persistent_data_loader_workers --network_module networks.lora_qwen_image --network_dim 16 \
        --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 --output_dir out --output_name my-lora

musubi-tuner's flags with the same meaning (``--dit`` is ``--pretrained_model_name_or_path``; ``--text_encoder``
Qwen2.5-VL; the objective's ``--timestep_sampling --discrete_flow_shift --sigmoid_scale --weighting_scheme
--min_timestep --max_timestep``: library/families/qwen_image/objective.py; the model flags:
library/families/qwen_image/options.py, which also lists what is refused). The dataset TOML may be musubi-tuner's
(``[[datasets]]`` with ``image_directory``) or sd-scripts'. The latents and Qwen2.5-VL's outputs are cached inside the
run (Qwen2.5-VL is freed before training). ``--network_module networks.lora_qwen_image`` is musubi-tuner's LoRA
(library/families/qwen_image/lora.py); ``lycoris.kohya`` works too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.qwen_image.options import FAMILY_NAMES, musubi_argv


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus Qwen-Image's own (objective, model, musubi-tuner's)."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILY_NAMES)


def run(argv: Sequence[str] | None = None):
    """musubi-tuner's command line (its caching defaults: :func:`musubi_argv`) through train_network.run."""
    return train_network.run(musubi_argv(argv), family_names=FAMILY_NAMES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
