"""Fine-tune a whole SDXL model (full fine-tune or DreamBooth with class images): fine_tune.py's recipe with the
SDXL family and sdxl_train.py's flags (``--learning_rate_te1`` / ``--learning_rate_te2``, ``--block_lr``).

accelerate launch sdxl_train.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("sdxl",)
FLAG_SETS = ("train_text_encoder", "fused_groups")  # + SDXL's own: --learning_rate_te1 / te2, --block_lr


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups with sdxl_train.py's flag sets and the SDXL family's own full-training flags."""
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
