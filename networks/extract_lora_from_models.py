"""Script: extract a LoRA from the difference of two models (sd-scripts' name and flags).

Extract a LoRA from the difference of two models (SD1 / SD2 / SDXL; single files or diffusers folders):
per module ΔW = tuned − original, truncated by SVD to --dim (3x3 convs to --conv_dim; without it they are left out).

    python networks/extract_lora_from_models.py --model_org base.safetensors --model_tuned tuned.safetensors \
        --save_to extracted.safetensors --dim 32 [--conv_dim 16] [--device cuda] [--save_precision fp16]

The family comes from the files (--v2 / --sdxl are accepted and checked). The factors are clamped at their
--clamp_quantile (0.99, as sd-scripts; 1 keeps the exact best rank-r approximation). The text encoders are left out
when none of their weights differs by more than --min_diff. --load_precision fp16 halves the memory (two models are
held at once); --load_original_model_to / --load_tuned_model_to place them on other devices.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from networks.extract import ExtractOptions, extract, extract_metadata
from networks.tool_common import (
    add_family_flags,
    check_adapter_path,
    dtype_of,
    family_as_flagged,
    family_flag_problems,
    save_adapter,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_org", default=None, help="the original model (file or diffusers folder)")
    p.add_argument("--model_tuned", default=None, help="the fine-tuned model")
    p.add_argument("--save_to", default=None, help="output LoRA (.safetensors / .ckpt / .pt / .pth)")
    add_family_flags(p, "accepted: the family is read from the files and checked")  # --v2, --sdxl
    p.add_argument("--v_parameterization", action="store_true", default=None,
                   help="metadata: mark the LoRA as v-prediction (default: what the original model says)")  # fmt: skip
    p.add_argument("--dim", type=int, default=4, help="rank of Linear / 1x1-conv modules")
    p.add_argument("--conv_dim", type=int, default=None, help="rank of 3x3 convs (default: not extracted)")
    p.add_argument("--load_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="precision the models are loaded in (default float)")  # fmt: skip
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default float)")  # fmt: skip
    p.add_argument("--device", default=None, help="device for the differences and SVDs, e.g. cuda")
    p.add_argument("--clamp_quantile", type=float, default=0.99, help="clamp the factors at this quantile (1: off)")
    p.add_argument("--min_diff", type=float, default=0.01, help="text encoders differing less are left out")
    p.add_argument("--no_metadata", action="store_true", help="only the minimal metadata")
    p.add_argument("--load_original_model_to", default=None, help="device for the original model (default cpu)")
    p.add_argument("--load_tuned_model_to", default=None, help="device for the tuned model (default cpu)")
    return p


def check(args: argparse.Namespace) -> None:
    problems: list[str] = []
    for flag in ("model_org", "model_tuned"):
        value = getattr(args, flag)
        if not value:
            problems.append(f"--{flag} is required")
        elif not Path(value).exists():
            problems.append(f"--{flag} {value}: no such file or folder")
    check_adapter_path("--save_to", args.save_to, problems)
    if args.dim < 1 or (args.conv_dim is not None and args.conv_dim < 1):
        problems.append("--dim and --conv_dim must be >= 1")
    if not 0 < args.clamp_quantile <= 1:
        problems.append(f"--clamp_quantile must be in (0, 1], got {args.clamp_quantile}")
    problems += family_flag_problems(args)
    if problems:
        raise ConfigError(problems)


def load_pair(args: argparse.Namespace):
    """(family, original parts, tuned parts); the two files must be the same family (and match its family flag)."""
    from library.families import detect_family

    problems = []
    try:
        fam_org = family_as_flagged(args.model_org, args)
    except ValueError as e:
        problems.append(f"--model_org {e}")
        fam_org = detect_family(args.model_org)
    fam_tuned = detect_family(args.model_tuned)
    if fam_org is not fam_tuned:
        problems.append(f"--model_org is {fam_org.name} but --model_tuned is {fam_tuned.name}: extract needs two "
                        "models of the same family")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    dtype = dtype_of(args.load_precision)
    org = fam_org.load(args.model_org, dtype=dtype, device=args.load_original_model_to or "cpu")
    tuned = fam_org.load(args.model_tuned, dtype=dtype, device=args.load_tuned_model_to or "cpu")
    return fam_org, org, tuned


def run(argv: Sequence[str] | None = None) -> Path:
    """Extract; returns the path written."""
    args = build_parser().parse_args(argv)
    check(args)
    family, org, tuned = load_pair(args)
    opts = ExtractOptions(args.dim, args.conv_dim, args.clamp_quantile, args.min_diff, args.device)
    state, with_te = extract(family, org, tuned, opts)
    prediction = org.prediction_type if args.v_parameterization is None else "v_prediction"
    meta = extract_metadata(family, org, opts, Path(args.save_to).stem, prediction)
    meta["ss_training_comment"] = (f"extracted from {Path(args.model_org).name} -> {Path(args.model_tuned).name}"
                                   f"{'' if with_te else ' (U-Net only)'}")  # fmt: skip
    path = save_adapter(state, args.save_to, meta, dtype_of(args.save_precision), no_metadata=args.no_metadata)
    print(f"extracted {len(state) // 3} modules into {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
