"""sd-scripts' older ControlNet-LLLite trainer name (``sdxl_train_control_net_lllite_old.py``): the same flags, the
same file layout and the same network, so it is sdxl_train_control_net_lllite.py under its other name."""

from __future__ import annotations

import sys

from sdxl_train_control_net_lllite import build_parser, main, run

__all__ = ["build_parser", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
