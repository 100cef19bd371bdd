"""sd-scripts' name for tools/convert_model.py (diffusers folder <-> single file, SD1 / SD2 / SDXL)."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from networks.tool_common import main_guard
from tools.convert_model import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main_guard(main))
