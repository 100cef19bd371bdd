"""Train a LoRA-family adapter for Stable Cascade stage C: train_network.py's recipe with the Stable Cascade family,
under the name and flags of sd-scripts' stable-cascade branch.

    accelerate launch stable_cascade_train_c_network.py --stage_c_checkpoint_path stage_c_bf16.safetensors \
        --text_model_checkpoint_path text_model.safetensors --effnet_checkpoint_path effnet_encoder.safetensors \
        --dataset_config dataset.toml --output_dir out --output_name sc_lora --network_module networks.lora \
        --network_dim 16 --network_train_unet_only --cache_latents --cache_text_encoder_outputs --mixed_precision bf16

train_network.py's flags with their sd-scripts meanings and the Stable Cascade flags (library/families/stable_cascade/:
``--stage_c_checkpoint_path`` is read as ``--pretrained_model_name_or_path``). The adapter names every Linear and 1x1
convolution of stage C ``lora_unet_`` + its path in Stability's / ComfyUI's model (the branch's names); the text
model takes ``lora_te_`` adapters unless ``--network_train_unet_only``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.stable_cascade.options import stage_c_flag

FAMILIES = ("stable_cascade",)


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags plus the Stable Cascade family's own."""
    return stage_c_flag(train_network.build_parser(__doc__, family_names=FAMILIES))


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
