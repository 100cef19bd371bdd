"""Train a LoRA-family adapter for PixArt-α / PixArt-Σ: train_network.py's recipe with the PixArt families.

    accelerate launch pixart_train_network.py --pretrained_model_name_or_path PixArt-Sigma-XL-2-1024-MS.pth \
        --t5xxl t5xxl_fp16.safetensors --vae sdxl_vae.safetensors --dataset_config dataset.toml --output_dir out \
        --network_module networks.lora --network_dim 16 --network_train_unet_only --cache_text_encoder_outputs \
        --cache_latents --mixed_precision bf16 --optimizer_type prodigy --optimizer_args d_coef=4

train_network.py's flags with their sd-scripts meanings, block swapping (``--blocks_to_swap``) and the PixArt model
flags (``--t5xxl --t5xxl_max_token_length --text_encoder_batch_size``: library/families/pixart/). The adapter trains
the transformer (T5-XXL stays frozen: training it is refused); its file names modules ``lora_unet_`` + the official
PixArt paths, which ComfyUI's PixArt LoRA loader maps. α or Σ is read from the weights.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("pixart_alpha", "pixart_sigma")


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus the PixArt families' own."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILIES)


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
