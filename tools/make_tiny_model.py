"""Write tiny models of the registered model families with random weights (tests, the demo, trying sdtrain offline).

    python tools/make_tiny_model.py --out models/tiny [--family NAME ...] [--seed 0]

writes, per family, ``<out>/<family>/`` (a diffusers folder) and ``<out>/<family>.safetensors`` (a single-file
checkpoint in the layout users have), plus the files sd-scripts takes beside it where the family has them, as
``<out>/<family>_<part>.safetensors`` (e.g. FLUX.1's ``--clip_l``, ``--t5xxl`` and ``--ae`` files; SD3's transformer
file without encoders ``_dit`` and its ``--clip_l --clip_g --t5xxl --vae`` files). The models have the real block
layout, module names and tokenizers of the released models with tiny widths (each family's ``tiny``, in its folder
under ``library/families/``); every training script accepts either layout. ``--family`` takes any registered family
with a tiny model; without it the default ones are written (the SD families). Families add their own flags (block
counts: ``--flux_blocks``, ``--sd3_blocks``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.cli.main_guard import main_guard  # noqa: E402
from library.families import FAMILIES, get_family  # noqa: E402
from library.families.protocol import ModelFamily  # noqa: E402


def tiny_families() -> list[ModelFamily]:
    """The registered families that have a tiny model, in registration order."""
    return [family for family in FAMILIES.values() if family.tiny is not None]


def build_parser() -> argparse.ArgumentParser:
    families = tiny_families()
    titles = " / ".join(dict.fromkeys(family.spec.title for family in families))
    parser = argparse.ArgumentParser(description=f"Write tiny {titles} models with random weights (tests, the demo, "
                                     "trying sdtrain offline).")  # fmt: skip
    defaults = [family.name for family in families if family.tiny.by_default]
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--family", nargs="+", choices=[family.name for family in families], default=defaults,
                        help=f"families to write (default: {' '.join(defaults)})")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    for add_tool_args in dict.fromkeys(family.tiny.add_tool_args for family in families):  # shared flags once
        add_tool_args(parser)
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Write the requested tiny models; returns the paths written (folder, file per family)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    written = []
    for name in args.family:
        start = time.perf_counter()
        family = get_family(name)
        parts = family.tiny.build(args.seed, **family.tiny.tool_options(args))
        try:
            folder: Path | None = family.save(parts, out / name)
        except ValueError as e:  # a family with no folder layout (HunyuanImage 2.1: its files only)
            folder = None
            print(f"{name}: no folder ({e})")
        try:
            single: Path | None = family.save(parts, out / f"{name}.safetensors")
        except ValueError as e:  # a family saved as folders only (Würstchen 2)
            single = None
            print(f"{name}: no single file ({e})")
        family.tiny.write_files(parts, out, name)  # the files sd-scripts takes beside the single file
        params = sum(p.numel() for m in (parts.denoiser, parts.vae, *parts.text_encoders) for p in m.parameters())
        print(f"{name}: {' and '.join(str(p) for p in (folder, single) if p)} ({params:,} parameters, "
              f"{parts.prediction_type}) in {time.perf_counter() - start:.1f}s")  # fmt: skip
        written += [p for p in (folder, single) if p is not None]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
