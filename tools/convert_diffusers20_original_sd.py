"""sd-scripts' name for tools/convert_model.py (diffusers folder <-> single file, SD1 / SD2 / SDXL)."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tools.convert_model import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main())
