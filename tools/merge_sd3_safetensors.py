"""Merge SD3 / SD3.5 parts into one SAI single file: sd-scripts' tools/merge_sd3_safetensors.py, same flags.

    python tools/merge_sd3_safetensors.py --dit sd3.5_large.safetensors --clip_l clip_l.safetensors \
        --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors --output sd3.5_large_all.safetensors

The parts, their checks and the streamed writer are the SD3 family's (library/families/sd3/merge.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.families.sd3.merge import PARTS, SAI_PREFIXES, SAVE_PRECISIONS, build_parser, merge  # noqa: F401
from networks.tool_common import device_problem


def run(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    problems: list[str] = []
    device_problem(args.device, problems)
    if Path(args.output).suffix.lower() != ".safetensors":
        problems.append(f"--output {args.output}: must end in .safetensors (an SAI single file)")
    if problems:
        raise ValueError("; ".join(problems))
    parts = {flag: getattr(args, flag) for flag in PARTS}
    path = merge(**parts, output=args.output, device=args.device, save_precision=args.save_precision)
    print(f"saved {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
