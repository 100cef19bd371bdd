"""Fine-tune a whole ToyDiT model (the test plug-in family): fine_tune.py's recipe with its family.

    PYTHONPATH=tests/plugins python -m toydit_train --pretrained_model_name_or_path toydit.safetensors --train_data_dir data \
        --output_dir out --output_name tuned --learning_rate 1e-4 --toy_sigma_law uniform

fine_tune.py's flags (``--train_text_encoder`` too), block swapping, and ToyDiT's own. The output is a ToyDiT model
file (or folder with ``--save_model_as diffusers``) with every part.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

from toydit.options import FAMILY_NAMES

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # no pickles
FLAG_SETS = ("train_text_encoder",)


def build_parser() -> argparse.ArgumentParser:
    return fine_tune.build_parser(FAMILY_NAMES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILY_NAMES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
