"""Fine-tune a whole PixArt-α / PixArt-Σ transformer: fine_tune.py's recipe with the PixArt families.

    accelerate launch pixart_train.py --pretrained_model_name_or_path PixArt-Sigma-XL-2-1024-MS.pth \
        --t5xxl t5xxl_fp16.safetensors --vae sdxl_vae.safetensors --dataset_config dataset.toml --output_dir out \
        --output_name tuned --learning_rate 2e-6 --cache_text_encoder_outputs --save_model_as safetensors

fine_tune.py's flags, block swapping, ``--fused_optimizer_groups``, ``--blockwise_fused_optimizers`` and the PixArt
model flags (library/families/pixart/). T5-XXL stays frozen (``--train_text_encoder`` is refused). The output: with
``--save_model_as safetensors`` the transformer under the official PixArt names (the checkpoint ComfyUI's PixArt
loader reads, T5 and the VAE staying the user's files); with ``diffusers`` / ``diffusers_safetensors`` a diffusers
PixArtAlphaPipeline / PixArtSigmaPipeline folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("pixart_alpha", "pixart_sigma")
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # no pickles
FLAG_SETS = ("fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
