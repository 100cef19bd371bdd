"""Fine-tune the whole Qwen-Image DiT with musubi-tuner's command line: fine_tune.py's recipe with the Qwen-Image
family.

    accelerate launch qwen_image_train.py --dit qwen_image_bf16.safetensors --vae qwen_image_vae.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --dataset_config dataset.toml --sdpa --mixed_precision bf16 \
        --timestep_sampling shift --weighting_scheme none --discrete_flow_shift 2.2 --optimizer_type adafactor \
        --learning_rate 1e-6 --gradient_checkpointing --max_train_epochs 1 --output_dir out --output_name ft

musubi-tuner's qwen_image_train.py flags with the same meaning: the model, objective and musubi-tuner flags of
qwen_image_train_network.py (library/families/qwen_image/options.py, objective.py), fine_tune.py's full-training
flags (``--full_bf16``, ``--fused_backward_pass``, block swapping); ``--mem_eff_save`` is refused with a message (our
saves already write tensor by tensor). Qwen2.5-VL is not trained (musubi-tuner's neither); the latents and text
outputs are cached in the run. The output is the DiT alone as one .safetensors in diffusers' names (the official /
ComfyUI layout that musubi-tuner and ComfyUI load).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.qwen_image.options import FAMILY_NAMES, musubi_argv

FORMATS = ("safetensors",)
FLAG_SETS = ("fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups (block swapping read), plus Qwen-Image's own flags."""
    return fine_tune.build_parser(FAMILY_NAMES, FLAG_SETS, __doc__, block_swap=True)


def run(argv: Sequence[str] | None = None):
    """musubi-tuner's command line (latents and text outputs cached in the run) through fine_tune.run."""
    return fine_tune.run(musubi_argv(argv, network=False), family_names=FAMILY_NAMES, parser=build_parser,
                         formats=FORMATS)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
