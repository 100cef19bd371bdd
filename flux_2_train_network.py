"""Train a LoRA-family adapter for FLUX.2 (klein 4B / 9B and their base models) with musubi-tuner's command line:
train_network.py's recipe with the FLUX.2 family.

    accelerate launch flux_2_train_network.py --model_version klein-base-4b --dit flux2-klein-base-4b.safetensors \
        --vae ae.safetensors --text_encoder text_encoder/model-00001-of-00002.safetensors \
        --dataset_config dataset.toml --sdpa --mixed_precision bf16 --timestep_sampling flux2_shift \
        --weighting_scheme none --optimizer_type adamw8bit --learning_rate 1e-4 --gradient_checkpointing \
        --max_data_loader_n_workers 2 --persistent_data_loader_workers --network_module networks.lora_flux_2 \
        --network_dim 32 --max_train_epochs 16 --save_every_n_epochs 1 --seed 42 --output_dir out --output_name my-lora

musubi-tuner's flags with the same meaning (``--dit`` is ``--pretrained_model_name_or_path``; ``--vae`` BFL's
``ae.safetensors``; ``--text_encoder`` Qwen3; the objective's ``--timestep_sampling --discrete_flow_shift
--sigmoid_scale --weighting_scheme --min_timestep --max_timestep``: library/families/flux2/objective.py; the model
flags: library/families/flux2/options.py, which also lists what is refused). ``--model_version`` may be left out:
the architecture is read from the weights. The dataset TOML may be musubi-tuner's (``[[datasets]]`` with
``image_directory``) or sd-scripts'. The latents and the text encoder's outputs are cached inside the run (the text
encoder is freed before training). ``--network_module networks.lora_flux_2`` is musubi-tuner's LoRA
(library/families/flux2/lora.py); ``lycoris.kohya`` works too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.flux2.options import FAMILY_NAMES, musubi_argv


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus FLUX.2's own (objective, model, musubi-tuner's)."""
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
