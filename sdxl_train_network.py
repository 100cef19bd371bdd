"""Train a LoRA-family adapter for SDXL: train_network.py's recipe with the SDXL family (same flags).

accelerate launch sdxl_train_network.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

run = functools.partial(train_network.run, family_names=("sdxl",))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
