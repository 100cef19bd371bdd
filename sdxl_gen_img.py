"""sd-scripts' ``sdxl_gen_img.py`` command line: gen_img.py with the model read as SDXL.

    python sdxl_gen_img.py --ckpt sdxl.safetensors --prompt "a cat --n blurry --d 42" --W 1024 --H 1024 \\
        --network_module networks.lora --network_weights my_lora.safetensors --outdir out

Every flag works as in gen_img.py (sd-scripts' SDXL script shares its parser); the file is loaded as SDXL, as the old
script does, so a file of another model is an error that names it. Gradual Latent and ``--highres_fix_steps`` are
refused (not available in gen_img.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import gen_img
from gen_img_diffusers import add_legacy_flags
from library.cli import deferred_imports
from library.cli.main_guard import main_guard


def build_parser() -> argparse.ArgumentParser:
    parser = gen_img.build_parser()
    parser.description = __doc__.split("\n\n")[0]
    add_legacy_flags(parser)
    parser.set_defaults(sdxl=True)  # sd-scripts' sdxl_gen_img.py loads every file as SDXL
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """gen_img.run with the model read as SDXL; returns the written image paths."""
    return gen_img.run(argv, parser=build_parser())


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
