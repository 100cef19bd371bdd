"""Script: merge adapters into one LoRA of a chosen rank by SVD of the summed ΔW.

Merge adapters (LoRA, LoCon, LoHa, LoKr, DoRA) into one LoRA of a chosen rank: per module the summed
ΔW = Σ ratio * ΔW_i is computed exactly and truncated by SVD, the best rank-r approximation of the sum.

    python networks/svd_merge_lora.py --models a.safetensors b.safetensors --ratios 0.8 0.5 \
        --new_rank 16 [--new_conv_rank 8] --save_to merged.safetensors [--save_precision fp16] [--device cuda]

Output alpha = rank (scale 1). A sum of LoRAs is itself low-rank, so its SVD is taken through the factors (fast
and exact); other algorithms go through their ΔW. DoRA inputs need the base model (--base_model), and so do LoHa /
LoKr files for models that are not the released SD1 / SD2 / SDXL architectures. sd-scripts always clamps the
result's factors at their 0.99 quantile; here that happens only with --clamp_quantile 0.99.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import add_unsupported, unsupported_problems
from library.cli.problems import ConfigError
from networks import deltas as dl
from networks import merge
from networks.tool_common import check_adapter_path, check_inputs, dtype_of, ratios_for, save_adapter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, help="adapter files (.safetensors / .ckpt / .pt)")
    p.add_argument("--ratios", nargs="*", type=float, default=None, help="one multiplier per file (default 1.0)")
    p.add_argument("--new_rank", type=int, default=4, help="rank of Linear / 1x1-conv modules")
    p.add_argument("--new_conv_rank", type=int, default=None, help="rank of 3x3-conv modules (default --new_rank)")
    p.add_argument("--save_to", default=None, help="output file (.safetensors / .ckpt / .pt / .pth)")
    p.add_argument("--device", default=None, help="device for the SVDs, e.g. cuda (default cpu)")
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default="float",
                   help="accepted for sd-scripts compatibility: sums and SVDs are always float32")  # fmt: skip
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default float)")  # fmt: skip
    p.add_argument("--no_metadata", action="store_true", help="only the minimal metadata")
    p.add_argument("--clamp_quantile", type=float, default=None,
                   help="clamp the factors at this quantile of their values, as sd-scripts (0.99); default: no clamp")  # fmt: skip
    p.add_argument("--base_model", default=None, help="the base model, needed for DoRA inputs")
    add_unsupported(p, "--lbws", "per-block weights of sd-webui-lora-block-weight", nargs="*", default=None)
    return p


def run(argv: Sequence[str] | None = None) -> Path:
    """SVD-merge; returns the path written."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = unsupported_problems(parser, args)
    ratios = ratios_for(args.models, args.ratios, problems)
    check_inputs("--models", args.models, problems)
    check_adapter_path("--save_to", args.save_to, problems)
    for flag in ("new_rank", "new_conv_rank"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.clamp_quantile is not None and not 0 < args.clamp_quantile <= 1:
        problems.append(f"--clamp_quantile must be in (0, 1], got {args.clamp_quantile}")
    if args.base_model and not Path(args.base_model).exists():
        problems.append(f"--base_model {args.base_model}: no such file or folder")
    if problems:
        raise ConfigError(problems)
    files = dl.load_adapters(args.models)
    problems = merge.check_same_family(files)
    if problems:
        raise ConfigError(problems, "adapter files")
    index = dl.base_model_index(args.base_model)[2] if args.base_model else None
    state = merge.svd_merge(files, ratios, new_rank=args.new_rank, new_conv_rank=args.new_conv_rank,
                            base_index=index, device=args.device, clamp_quantile=args.clamp_quantile)  # fmt: skip
    how = f"SVD-merged to rank {args.new_rank}" + (f" (conv {args.new_conv_rank})" if args.new_conv_rank else "")
    meta = merge.lora_metadata(files, ratios, state, how, args.save_to)
    path = save_adapter(state, args.save_to, meta, dtype_of(args.save_precision), no_metadata=args.no_metadata)
    print(f"merged {len(files)} file(s) into {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
