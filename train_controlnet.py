"""sd-scripts' deprecated name of ``train_control_net.py`` (same flags, same run); it says so and runs it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import train_control_net
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

build_parser = train_control_net.build_parser


def run(argv: Sequence[str] | None = None):
    logging.getLogger("train_controlnet").warning(
        "train_controlnet.py is deprecated (as in sd-scripts); use train_control_net.py, which this runs"
    )
    return train_control_net.run(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
