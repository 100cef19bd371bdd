"""Train a textual-inversion embedding for SDXL: train_textual_inversion.py's recipe with the SDXL family (same
flags). The token is added to both text encoders; the file holds ``clip_l`` (n, 768) and ``clip_g`` (n, 1280).

accelerate launch sdxl_train_textual_inversion.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import train_textual_inversion
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

run = functools.partial(train_textual_inversion.run, family_names=("sdxl",))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
