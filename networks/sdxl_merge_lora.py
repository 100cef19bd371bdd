"""Script: merge adapters into an SDXL checkpoint (sd-scripts' name for merge_lora.py on SDXL).

sd-scripts' name for merging into SDXL checkpoints: ``merge_lora.py`` with the family checked to be SDXL (the
family is read from --sd_model in both scripts). See networks/merge_lora.py for the flags."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from networks import merge_lora


def run(argv: Sequence[str] | None = None) -> Path:
    return merge_lora.run(argv, only="sdxl", script=Path(__file__).name)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
