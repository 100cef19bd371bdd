"""Cut LoRAs of lower ranks out of a DyLoRA file (sd-scripts' networks/extract_lora_from_dylora.py).

    python networks/extract_lora_from_dylora.py --model dylora.safetensors --save_to out/lora.safetensors --unit 4

A DyLoRA file (``networks.dylora`` or ``lycoris.kohya algo=dylora``) is a plain LoRA whose first k ranks were trained
to work on their own. For every k = unit, 2·unit, ... below the file's largest rank this writes
``<save_to stem>-<k:04d><ext>`` with, per module, ``lora_down[:k]`` and ``lora_up[:, :k]`` (``networks.algos.dylora.cut``;
modules of rank <= k are copied whole) and every other tensor, ``alpha`` included, unchanged, as sd-scripts does: the
rank-k file is read at scale alpha / k. ``--rank`` writes only the ranks given (each a multiple of ``--unit``, up to the
file's rank). Metadata is copied with ``ss_network_dim`` = k and ``split from DyLoRA, rank R to k`` prepended to
``ss_training_comment``; ``sshs_*`` hashes are computed on the tensors written; writes are atomic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from torch import Tensor

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from networks.algos import dylora
from networks.tool_common import check_adapter_path, progress, save_adapter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unit", type=int, default=None, help="size of the rank steps to cut (the training unit / "
                   "block_size, or a multiple of it)")  # fmt: skip
    p.add_argument("--save_to", type=str, default=None, help="base file name of the outputs: <stem>-<rank:04d><ext> "
                   "(.safetensors, .ckpt, .pt, .pth)")  # fmt: skip
    p.add_argument("--model", type=str, default=None, help="the DyLoRA file (.safetensors / .ckpt / .pt)")
    p.add_argument("--rank", type=int, nargs="+", default=None, help="only these ranks (default: every multiple of "
                   "--unit below the file's rank)")  # fmt: skip
    return p


def check(args: argparse.Namespace) -> None:
    problems: list[str] = []
    if not args.model:
        problems.append("--model is required: the DyLoRA file to cut")
    elif not Path(args.model).is_file():
        problems.append(f"--model {args.model}: no such file")
    check_adapter_path("--save_to", args.save_to, problems)
    if args.unit is None:
        problems.append("--unit is required: the rank step, e.g. the unit (networks.dylora) or block_size "
                        "(lycoris.kohya algo=dylora) the file was trained with")  # fmt: skip
    elif args.unit < 1:
        problems.append(f"--unit {args.unit}: must be at least 1")
    for r in args.rank or []:
        if r < 1 or (args.unit and args.unit >= 1 and r % args.unit):
            problems.append(f"--rank {r}: must be a positive multiple of --unit {args.unit}")
    if problems:
        raise ConfigError(problems)


def file_rank(state_dict: Mapping[str, Tensor], source: str) -> int:
    """The largest ``lora_down`` rank of a LoRA state dict; ``ValueError`` for anything that is not a plain LoRA."""
    other = sorted(
        k for k in state_dict
        if "." in k and not k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
    )  # fmt: skip
    if other:
        raise ValueError(f"{source}: {', '.join(other[:3])}: not a DyLoRA file (a DyLoRA file has only lora_down / "
                         "lora_up / alpha tensors)")  # fmt: skip
    ranks = [v.shape[0] for k, v in state_dict.items() if k.endswith(".lora_down.weight")]
    if not ranks:
        raise ValueError(f"{source}: no lora_down tensors: not a DyLoRA file")
    return max(ranks)


def cut_state_dict(state_dict: Mapping[str, Tensor], rank: int) -> dict[str, Tensor]:
    """Every module cut to its first ``rank`` ranks (``dylora.cut``); alpha and other keys unchanged."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith(".lora_down.weight"):
            name = key[: -len(".lora_down.weight")]
            down, up = dylora.cut(value, state_dict[f"{name}.lora_up.weight"], rank)
            out[key], out[f"{name}.lora_up.weight"] = down, up
        elif not key.endswith(".lora_up.weight"):
            out[key] = value
    return out


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Cut and save; returns the files written."""
    from library.files.weights import load_state_dict

    args = build_parser().parse_args(argv)
    check(args)
    state_dict, metadata = load_state_dict(args.model)
    top = file_rank(state_dict, args.model)
    ranks = args.rank or list(range(args.unit, top, args.unit))
    too_big = [r for r in ranks if r > top]
    if too_big:
        raise ValueError(f"--rank {too_big[0]}: above the rank of {args.model} ({top})")
    if not ranks:
        raise ValueError(f"{args.model}: rank {top} has no multiple of --unit {args.unit} below it; nothing to cut")
    save_to = Path(args.save_to)
    comment = (metadata or {}).get("ss_training_comment", "")
    written = []
    bar = progress(len(ranks), "cutting", unit="file")
    for rank in ranks:
        meta = dict(metadata or {})
        meta["ss_training_comment"] = f"split from DyLoRA, rank {top} to {rank}; {comment}"
        meta["ss_network_dim"] = str(rank)
        path = save_to.with_name(f"{save_to.stem}-{rank:04d}{save_to.suffix}")
        save_adapter(cut_state_dict(state_dict, rank), path, meta, None)
        bar.write(f"{args.model} -> {path}: rank {top} cut to {rank}")
        written.append(path)
        bar.update(1)
    bar.close()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
