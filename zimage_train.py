"""Fine-tune the whole Z-Image DiT with musubi-tuner's command line: fine_tune.py's recipe with the Z-Image family.

    accelerate launch zimage_train.py --dit z_image_bf16.safetensors --vae ae.safetensors \
        --text_encoder qwen_3_4b.safetensors --dataset_config dataset.toml --sdpa --mixed_precision bf16 \
        --full_bf16 --timestep_sampling shift --weighting_scheme none --discrete_flow_shift 2.0 \
        --optimizer_type adafactor --learning_rate 1e-6 --gradient_checkpointing --fused_backward_pass \
        --blocks_to_swap 16 --max_train_epochs 1 --output_dir out --output_name ft

musubi-tuner's zimage_train.py flags with the same meaning: the model, objective and musubi-tuner flags of
zimage_train_network.py (library/families/zimage/options.py, objective.py), fine_tune.py's full-training flags
(``--full_bf16``, ``--fused_backward_pass``, block swapping); ``--mem_eff_save`` is accepted (our saves write tensor
by tensor already). Qwen3 is not trained (musubi-tuner's neither); the latents and text outputs are cached in the
run. The output is the DiT alone as one .safetensors in diffusers' names (musubi-tuner's output layout).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.zimage.options import FAMILY_NAMES, musubi_argv

FORMATS = ("safetensors",)
FLAG_SETS = ("fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups (block swapping read), plus Z-Image's own flags."""
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
