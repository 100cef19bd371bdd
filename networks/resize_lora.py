"""Resize a LoRA (or LoCon, LoHa, LoKr, DoRA: resized into a LoRA through its ΔW) to a lower rank by SVD.

sd-scripts' command line:

    python networks/resize_lora.py --model lora.safetensors --save_to small.safetensors --new_rank 8 \
        [--new_conv_rank 4] [--dynamic_method sv_fro --dynamic_param 0.9] [--save_precision fp16] [--verbose]

elias-gaeros/resize_lora's command line (score recipes judged against the base model, several outputs at once):

    python networks/resize_lora.py -o out/ -r fro_ckpt=1,thr=-3.55 model.safetensors lora.safetensors [more.safetensors]

Fixed ranks keep the best rank-r approximation of each module's ΔW; ``--dynamic_method`` picks each module's rank
(sv_ratio: singular values above S₀/param; sv_cumulative: Σ S reaches param; sv_fro: the Frobenius norm kept
reaches param), capped at --new_rank / --new_conv_rank. A recipe (``-r``, see networks/recipes.py) keeps the singular
values whose score is above ``thr`` (log10) or fits ``size`` (MiB). The effective scale of a LoRA is kept (new alpha
= old alpha / old rank * new rank). Linear and 1x1-conv modules get --new_rank, larger kernels --new_conv_rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError, problems_of
from networks import deltas as dl
from networks.lowrank import DYNAMIC_METHODS
from networks.recipes import Recipe, fmt, parse_recipes
from networks.resize import ResizeOptions, describe, resize_file, resized_metadata
from networks.tool_common import check_adapter_path, dtype_of, save_adapter

DEFAULT_RECIPE = "fro_ckpt=1,thr=-3.5"  # elias-gaeros/resize_lora's default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="elias-gaeros style: CHECKPOINT LORA [LORA ...] (with -o); a LORA "
                   "a.safetensors,b.safetensors:0.5 is the exact sum of its members (weights default 1)")  # fmt: skip
    p.add_argument("--model", help="the adapter file to resize (.safetensors / .ckpt / .pt)")
    p.add_argument("--save_to", help="output file (.safetensors / .ckpt / .pt / .pth)")
    p.add_argument("--new_rank", type=int, default=None, help="rank of Linear / 1x1-conv modules (default 4; "
                   "with --dynamic_method the largest rank; with -r no limit unless given)")  # fmt: skip
    p.add_argument("--new_conv_rank", type=int, default=None, help="rank of 3x3-conv modules (default --new_rank)")
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default float; -o mode: fp16 as elias-gaeros' -t 16)")  # fmt: skip
    p.add_argument("-d", "--device", default=None, help="device for the SVDs, e.g. cuda (default cpu)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="print every module: ranks, retained norm")
    p.add_argument("--dynamic_method", choices=[None, *DYNAMIC_METHODS], default=None)
    p.add_argument("--dynamic_param", type=float, default=None, help="target of --dynamic_method")
    p.add_argument("--svd_lowrank_niter", type=int, default=2,
                   help="accepted for sd-scripts compatibility; the SVDs here are always exact")  # fmt: skip
    p.add_argument("-r", "--score_recipes", default=None, help="elias-gaeros score recipe(s), ':'-separated, e.g. "
                   "fro_ckpt=1,thr=-3.55 (keys spn_ckpt, spn_lora, fro_ckpt, fro_lora, subspace, params, thr, size, "
                   "rescale)")  # fmt: skip
    p.add_argument("--base_model", default=None, help="the base model (diffusers folder or single file) for recipes "
                   "judged against it, DoRA inputs and LoHa/LoKr of non-released architectures")  # fmt: skip
    p.add_argument("--base_precision", choices=["float", "fp16", "bf16"], default="float",
                   help="precision the base model is loaded in (fp16 halves the memory)")  # fmt: skip
    p.add_argument("-o", "--output_folder", default=None, help="-o mode: output folder (default: each LoRA's)")
    p.add_argument("-t", "--output_dtype", choices=["16", "32"], default=None, help="-o mode: 16 (default) or 32")
    return p


def check(args: argparse.Namespace) -> tuple[list[Recipe], Path | None, list[str]]:
    """(recipes, base model, adapter files); every problem of the command line in one ConfigError."""
    problems: list[str] = []
    elias = bool(args.paths)
    if elias and (args.model or args.save_to):
        problems.append("give either --model/--save_to (sd-scripts) or CHECKPOINT LORA... -o (elias-gaeros)")
    if elias and len(args.paths) < 2:
        problems.append("elias-gaeros style needs CHECKPOINT LORA [LORA ...]")
    if not elias:
        if not args.model:
            problems.append("--model is required: the adapter file to resize")
        check_adapter_path("--save_to", args.save_to, problems)
    if args.dynamic_method and args.dynamic_param is None:
        problems.append(f"--dynamic_method {args.dynamic_method} needs --dynamic_param")
    if args.dynamic_param is not None and args.dynamic_param <= 0:
        problems.append(f"--dynamic_param must be > 0, got {args.dynamic_param}")
    for flag in ("new_rank", "new_conv_rank"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    recipes = []
    text = args.score_recipes or (DEFAULT_RECIPE if elias else None)
    if text:
        try:
            recipes = parse_recipes(text)
        except ValueError as e:
            problems += problems_of(e)
    if recipes and args.dynamic_method:
        problems.append("--dynamic_method and -r recipes are two ways to choose ranks; give one")
    if len(recipes) > 1 and not elias:
        problems.append("several recipes (':') write several files: use the -o folder form")
    base = args.paths[0] if elias else args.base_model
    if base and elias and args.base_model:
        problems.append("the base model is given twice (CHECKPOINT and --base_model)")
    if any(r.needs_base for r in recipes) and not base:
        problems.append(f"recipe {recipes[0].text!r} is judged against the base model: pass --base_model")
    loras = args.paths[1:] if elias else [args.model] if args.model else []
    for path in ([base] if base else []) + [p for spec in loras for p, _ in members(spec)]:
        if not Path(path).exists():
            problems.append(f"{path}: no such file or folder")
    if problems:
        raise ConfigError(problems)
    return recipes, Path(base) if base else None, loras


def members(spec: str) -> list[tuple[str, float]]:
    """``a.safetensors,b.safetensors:0.5`` -> [(path, weight), ...]; a part without ``:<number>`` has weight 1."""
    if "," not in spec:
        return [(spec, 1.0)]
    out = []
    for part in spec.split(","):
        path, sep, weight = part.rpartition(":")
        try:
            out.append((path, float(weight)) if sep else (part, 1.0))
        except ValueError:  # a ":" that is part of the path (C:\...)
            out.append((part, 1.0))
    return out


def load_lora(spec: str) -> dl.AdapterFile:
    """One adapter file, or the exact sum of several (``a.safetensors,b.safetensors:0.5``)."""
    parts = members(spec)
    if len(parts) == 1:
        return dl.load_adapter(parts[0][0])
    from networks.merge import concat_file

    return concat_file(dl.load_adapters([p for p, _ in parts]), [w for _, w in parts])


def outputs(args: argparse.Namespace, recipes: list[Recipe]) -> list[tuple[Recipe | None, Path | None]]:
    """(recipe, output path) pairs; in -o mode the name is elias-gaeros' ``<stem>_<recipe>_th<thr>``, set once the
    threshold is known (path None here)."""
    if not args.paths:
        return [(recipes[0] if recipes else None, Path(args.save_to))]
    return [(r, None) for r in recipes]


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Resize; returns the files written."""
    args = build_parser().parse_args(argv)
    recipes, base, loras = check(args)
    elias = bool(args.paths)
    default_precision = "fp16" if elias and args.output_dtype != "32" else "float"
    dtype = dtype_of(args.save_precision or default_precision)
    opts = ResizeOptions(
        new_rank=args.new_rank if args.new_rank is not None or recipes else 4,
        new_conv_rank=args.new_conv_rank,
        dynamic_method=args.dynamic_method,
        dynamic_param=args.dynamic_param,
    )
    base_index: dict = {}  # loaded on first need: a recipe judged against it, DoRA, unknown module shapes
    written = []
    for lora in loras:
        file = load_lora(lora)
        if base and not base_index and (any(r.needs_base for r in recipes) or dl.needs_model(file)):
            base_index.update(dl.base_model_index(base, dtype_of(args.base_precision))[2])
        file_index = dl.resolve_index(file, base_index or None)
        for recipe, path in outputs(args, recipes):
            result = resize_file(file, file_index, opts=opts, recipe=recipe, device=args.device,
                                 elem_size=dtype.itemsize)  # fmt: skip
            if path is None:
                folder = Path(args.output_folder) if args.output_folder else file.path.parent
                path = folder / f"{file.path.stem}_{recipe.file_tag}_th{fmt(result.threshold)}.safetensors"
            meta = resized_metadata(file, result, describe(file, opts, recipe, result))
            save_adapter(result.state_dict, path, meta, dtype)
            report(args.verbose, file, result, path)
            written.append(path)
    return written


def report(verbose: int, file: dl.AdapterFile, result, path: Path) -> None:
    if verbose:
        for line in result.reports:
            print(line.line())
        for name in result.dropped:
            print(f"{name:75} | left out (no singular value kept)")
    ranks = [r.new_rank for r in result.reports]
    print(f"{file.path.name} -> {path}: {len(result.reports)} modules, rank {min(ranks, default=0)}-"
          f"{max(ranks, default=0)}, {len(result.dropped)} left out, average Frobenius norm retained "
          f"{result.mean_fro:.2%}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
