"""Train a LoRA-family adapter for Z-Image (Turbo or Base) with musubi-tuner's command line: train_network.py's recipe
with the Z-Image family.

    accelerate launch zimage_train_network.py --dit z_image_bf16.safetensors --vae ae.safetensors \
        --text_encoder qwen_3_4b.safetensors --dataset_config dataset.toml --sdpa --mixed_precision bf16 \
        --timestep_sampling shift --weighting_scheme none --discrete_flow_shift 2.0 --optimizer_type adamw8bit \
        --learning_rate 1e-4 --gradient_checkpointing --max_data_loader_n_workers 2 --persistent_data_loader_workers \
        --network_module networks.lora_zimage --network_dim 32 --max_train_epochs 16 --save_every_n_epochs 1 \
        --seed 42 --output_dir out --output_name my-lora

musubi-tuner's flags with the same meaning (``--dit`` is ``--pretrained_model_name_or_path``: the original / ComfyUI
file, the first of Tongyi-MAI's split files, or a diffusers folder; ``--text_encoder`` Qwen3-4B; ``--vae`` FLUX.1's
AE; the objective's ``--timestep_sampling --discrete_flow_shift --sigmoid_scale --weighting_scheme --min_timestep
--max_timestep``: library/families/zimage/objective.py; the model flags (``--fp8_llm``, ``--split_attn``,
``--model_version base|turbo``) and what is refused: library/families/zimage/options.py). ``--fp8_base --fp8_scaled``
and ``--blocks_to_swap`` (up to 28) are the shared flags. The dataset TOML may be musubi-tuner's (``[[datasets]]``
with ``image_directory``) or sd-scripts'. The latents and Qwen3's outputs are cached inside the run (Qwen3 is freed
before training). ``--network_module networks.lora_zimage`` is musubi-tuner's LoRA
(library/families/zimage/lora.py); ``lycoris.kohya`` works too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.zimage.options import FAMILY_NAMES, musubi_argv


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus Z-Image's own (objective, model, musubi-tuner's)."""
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
