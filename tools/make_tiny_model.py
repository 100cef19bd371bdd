"""Write tiny SD1 / SD2 (v-prediction) / SDXL models with random weights, for tests, the demo and trying sdtrain
without downloading anything.

    python tools/make_tiny_model.py --out models/tiny [--family sd1 sd2 sdxl] [--seed 0]

writes, per family, ``<out>/<family>/`` (a diffusers folder) and ``<out>/<family>.safetensors`` (a single-file
checkpoint in the original layout). The models have the real block layout, module names and CLIP tokenizer of the
released models with tiny widths (see ``library/families/tiny.py``); every training script accepts either file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.families import get_family  # noqa: E402
from library.families.tiny import FAMILIES, build_tiny  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    return parser


def main(argv: list[str] | None = None) -> list[Path]:
    """Write the requested tiny models; returns the paths written (folder, file per family)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    written = []
    for name in args.family:
        start = time.perf_counter()
        family = get_family(name)
        parts = build_tiny(name, seed=args.seed)
        folder = family.save(parts, out / name)
        single = family.save(parts, out / f"{name}.safetensors")
        params = sum(p.numel() for m in (parts.denoiser, parts.vae, *parts.text_encoders) for p in m.parameters())
        print(f"{name}: {folder}/ and {single} ({params:,} parameters, {parts.prediction_type}) "
              f"in {time.perf_counter() - start:.1f}s")  # fmt: skip
        written += [folder, single]
    return written


if __name__ == "__main__":
    from networks.tool_common import main_guard

    sys.exit(main_guard(main))  # an output path that is a file or cannot be written: one `error:` line, exit 2
