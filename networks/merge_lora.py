"""Merge adapters (LoRA, LoCon, LoHa, LoKr, DoRA) into a model checkpoint, or LoRAs into one LoRA.

    # into a checkpoint (SD1 / SD2 / SDXL, single file or diffusers folder in and out)
    python networks/merge_lora.py --sd_model model.safetensors --models a.safetensors b.safetensors \
        --ratios 0.8 0.5 --save_to merged.safetensors [--save_precision fp16]

    # LoRAs into one LoRA, exactly: the ranks are concatenated (rank = sum of ranks)
    python networks/merge_lora.py --models a.safetensors b.safetensors --ratios 1 0.5 --save_to ab.safetensors

Into a checkpoint every file is applied with the training code's ΔW at its ratio, W <- W + ratio * ΔW, in order.
The model family comes from the checkpoint (--v2 / --sdxl are accepted and checked against it).

LoRA + LoRA: the merged file's ΔW is exactly the sum of the inputs' ratio * ΔW; --concat is accepted and always on.
sd-scripts without --concat adds the up and down matrices of the files themselves, which is not the sum of their
ΔWs (an approximation whose error grows with the ratios and ranks) and is not offered here; for a merged LoRA of a
chosen rank use svd_merge_lora.py (the best approximation of the exact sum at that rank).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import add_unsupported, unsupported_problems
from library.cli.problems import ConfigError
from library.families import FAMILIES, get_family, trained_together
from networks import deltas as dl
from networks import merge
from networks.tool_common import (
    add_family_flags,
    check_adapter_path,
    check_inputs,
    dtype_of,
    family_as_flagged,
    family_titles,
    ratios_for,
    save_adapter,
)

logger = logging.getLogger(__name__)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The flags; ``only``: the one family a family-named script (sdxl_merge_lora.py) merges into, whose flag it
    accepts and ignores."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sd_model", default=None, help="checkpoint to merge into (single file or diffusers folder); "
                   "without it the LoRAs are merged into one LoRA")  # fmt: skip
    p.add_argument("--models", nargs="*", default=None, help="adapter files (.safetensors / .ckpt / .pt)")
    p.add_argument("--ratios", nargs="*", type=float, default=None, help="one multiplier per file (default 1.0)")
    p.add_argument("--save_to", default=None, help="output: .safetensors / .ckpt (checkpoint: or a folder for "
                   "diffusers)")  # fmt: skip
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default="float",
                   help="precision the checkpoint is held in while merging")  # fmt: skip
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default: --precision)")  # fmt: skip
    p.add_argument("--no_metadata", action="store_true", help="LoRA output: only the minimal metadata")
    p.add_argument("--concat", action="store_true", help="LoRA + LoRA: concatenate ranks (always done: exact)")
    p.add_argument("--shuffle", action="store_true", help="accepted; has no effect on an exact merge")
    if only is None:  # sd-scripts' merge_lora.py has its families' flags (--v2); the others are accepted, unlisted
        add_family_flags(p, "accepted: the family is read from --sd_model and checked", shown=_shown_families())
    else:
        p.add_argument(f"--{get_family(only).spec.flag}", action="store_true", help=argparse.SUPPRESS)
    add_unsupported(p, "--lbws", "per-block weights of sd-webui-lora-block-weight", nargs="*", default=None)
    return p


def check(args: argparse.Namespace, problems: list[str]) -> list[float]:
    """The ratios; every problem of the command line in one ConfigError."""
    ratios = ratios_for(args.models, args.ratios, problems)
    check_inputs("--models", args.models, problems)
    if args.sd_model:
        if not Path(args.sd_model).exists():
            problems.append(f"--sd_model {args.sd_model}: no such file or folder")
        if not args.save_to:
            problems.append("--save_to is required: a .safetensors / .ckpt file or a folder (diffusers)")
        elif Path(args.save_to).suffix.lower() in (".pt", ".pth", ".bin"):
            problems.append(f"--save_to {args.save_to}: save a checkpoint as .safetensors, .ckpt or a folder")
    else:
        check_adapter_path("--save_to", args.save_to, problems)
    if problems:
        raise ConfigError(problems)
    return ratios


def _shown_families() -> tuple[str, ...]:
    """The families sd-scripts' merge_lora.py is for: the first registered family and those trained with it."""
    return trained_together(next(iter(FAMILIES)))


def merge_to_checkpoint(
    args: argparse.Namespace,
    files: list[dl.AdapterFile],
    ratios: list[float],
    only: str | None = None,
    script: str = "",
) -> Path:
    try:
        family = family_as_flagged(args.sd_model, args if only is None else None)
    except ValueError as e:
        raise ConfigError([f"--sd_model {e}"]) from e
    if only is not None and family.name != only:
        raise ConfigError([f"--sd_model {args.sd_model} is an {family.name.upper()} model; {script} merges into "
                           f"{family_titles([only])} models only: use networks/merge_lora.py (same flags) for "
                           f"{family_titles(_shown_families())} models"])  # fmt: skip
    parts = family.load(args.sd_model, dtype=dtype_of(args.precision))
    merge.merge_into_model(family, parts, files, ratios)
    meta = {} if args.no_metadata else {"modelspec.merged_from": merge.merged_from(
        [Path(args.sd_model).stem] + [f.title for f in files])}  # fmt: skip
    return family.save(parts, args.save_to, dtype=dtype_of(args.save_precision, None), metadata=meta)


def run(argv: Sequence[str] | None = None, only: str | None = None, script: str = "") -> Path:
    """Merge; returns the path written. ``only`` / ``script``: a family-named script (sdxl_merge_lora.py) that
    merges into that family's models only."""
    parser = build_parser(only)
    args = parser.parse_args(argv)
    ratios = check(args, unsupported_problems(parser, args))
    files = dl.load_adapters(args.models)
    if args.shuffle:
        logger.warning("--shuffle has no effect: the merge is exact (ranks concatenated), the order does not matter")
    if args.sd_model:
        path = merge_to_checkpoint(args, files, ratios, only, script)
    else:
        problems = merge.check_same_family(files)
        if problems:
            raise ConfigError(problems, "adapter files")
        state = merge.concat_merge(files, ratios)
        meta = merge.lora_metadata(files, ratios, state, "merged by concatenating ranks (exact)", args.save_to)
        path = save_adapter(state, args.save_to, meta, dtype_of(args.save_precision or args.precision),
                            no_metadata=args.no_metadata)  # fmt: skip
    print(f"merged {len(files)} file(s) into {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
