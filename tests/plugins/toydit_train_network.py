"""Train a LoRA-family adapter for ToyDiT (the test plug-in family): train_network.py's recipe with its family.

    PYTHONPATH=tests/plugins python -m toydit_train_network --pretrained_model_name_or_path toydit_dit.safetensors \
        --toy_text_encoder toydit_text_encoder.safetensors --train_data_dir data --output_dir out \
        --network_module networks.lora --network_dim 4 --toy_sigma_law uniform --toy_shift 2

train_network.py's flags, block swapping, and ToyDiT's own (tests/plugins/toydit/options.py and objective.py:
``--toy_text_encoder --toy_max_length --toy_sigma_law --toy_shift``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

from toydit.options import FAMILY_NAMES

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard


def build_parser() -> argparse.ArgumentParser:
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILY_NAMES)


run = functools.partial(train_network.run, family_names=FAMILY_NAMES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
