"""Script: check an adapter file (shapes, magnitudes, and what would make a loader misbehave).

Check an adapter file: every tensor's shape, mean |value| and min |value| (sd-scripts' output), plus a summary
per module (algorithm, rank, alpha, DoRA) and the problems that make a file misbehave: NaN / Inf values, modules
whose ΔW is zero (never trained), alpha <= 0, algorithms or keys no loader understands.

    python networks/check_lora_weights.py lora.safetensors [-s]

Exits with status 1 when a problem is found.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from library.cli.main_guard import main_guard
from networks import deltas as dl
from networks import files

_ADAPTER_MARKS = ("lora_up", "lora_down", "lora_mid", "lora_A", "lora_B", "hada_", "lokr_", "oft_", "dora_scale",
                  "w_norm", "b_norm")  # fmt: skip
_WHOLE_MODULE_ALGOS = ("full", "ia3", "glora")  # suffixes without a mark (diff, weight, a1.weight): list them all


@dataclass
class Check:
    """What :func:`check_file` found: tensor lines, per-module summary and problems."""

    tensor_lines: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    modules: int = 0  # adapter modules (a LoRA module has 2-3 tensors)


def tensor_line(key: str, value: torch.Tensor) -> str:
    """sd-scripts' line: ``key,shape-with-dashes,mean |x|,min |x|``."""
    v = value.float().abs()
    shape = str(tuple(value.shape)).replace(", ", "-")
    return f"{key},{shape},{float(v.mean()) if v.numel() else 0.0},{float(v.min()) if v.numel() else 0.0}"


def check_file(path: str | Path) -> Check:
    """Read ``path`` (safely) and check it; ``ValueError`` when it is not an adapter file at all."""
    out = Check()
    file = dl.load_adapter(path)
    for key, value in file.state_dict().items():
        if any(mark in key for mark in _ADAPTER_MARKS) or file.algos[key.split(".", 1)[0]] in _WHOLE_MODULE_ALGOS:
            out.tensor_lines.append(tensor_line(key, value))
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            out.problems.append(f"{key}: contains NaN or Inf values")
    out.modules = len(file.modules)
    algos = Counter(file.algos.values())
    prefixes = Counter(files.prefix_of(n) for n in file.modules)
    ranks = Counter(_rank_alpha(file, n) for n in file.modules if file.algos[n] != "norm")
    dora = sum("dora_scale" in t for t in file.modules.values())
    out.summary.append(f"{len(file.modules)} modules: " + ", ".join(f"{a} {c}" for a, c in algos.items())
                       + (f" (DoRA {dora})" if dora else ""))  # fmt: skip
    out.summary.append("prefixes: " + ", ".join(f"{p} {c}" for p, c in sorted(prefixes.items())))
    out.summary.append("rank / alpha: " + ", ".join(f"{r}/{a:g} x{c}" if r is not None else f"no rank (scale 1) x{c}"
                                                   for (r, a), c in ranks.most_common()))  # fmt: skip
    zero = [n for n in file.modules if file.algos[n] != "norm" and _is_zero(file, n)]
    if zero:
        out.problems.append(f"{len(zero)} module(s) have ΔW = 0 (never trained?), e.g. {', '.join(zero[:3])}")
    bad_alpha = [n for n, t in file.modules.items() if "alpha" in t and float(t["alpha"]) <= 0
                 and file.algos[n] not in ("diag-oft", "boft")]  # LyCORIS OFT: alpha = constraint, 0 = none  # fmt: skip
    if bad_alpha:
        out.problems.append(f"{len(bad_alpha)} module(s) have alpha <= 0, e.g. {', '.join(bad_alpha[:3])}")
    return out


def _rank_alpha(file: dl.AdapterFile, name: str) -> tuple[str | int | None, float]:
    """(rank, alpha) for the histogram; OFT modules: ("<blocks> blocks", the constraint stored as alpha)."""
    tensors = file.modules[name]
    if "oft_blocks" in tensors:
        shape = "x".join(str(d) for d in tensors["oft_blocks"].shape[:-1])
        return f"{shape} blocks", round(float(tensors["alpha"]) if "alpha" in tensors else 0.0, 6)
    return file.rank_of(name), round(file.scale_of(name) * (file.rank_of(name) or 1), 6)


def _is_zero(file: dl.AdapterFile, name: str) -> bool:
    """Whether ΔW is zero (never trained): any all-zero factor for LoRA / LoHa / LoKr (up / w2_a / w2 / ...); for
    full both diff and diff_b, for (IA)³ its scales (``on_input`` = 0 is a setting), for GLoRA a factor of each of
    its two terms W·a1·a2 and b1·b2."""
    tensors, algo = file.modules[name], file.algos[name]

    def zero(key: str) -> bool:  # a tensor the module lacks changes nothing either
        return key not in tensors or not bool(tensors[key].any())

    if algo == "full":
        return zero("diff") and zero("diff_b")
    if algo == "ia3":
        return zero("weight")
    if algo == "glora":
        b_zero = zero("b1.weight") or zero("b2.weight") or ("bm.weight" in tensors and zero("bm.weight"))
        return (zero("a1.weight") or zero("a2.weight")) and b_zero
    return any(k not in ("alpha", "dora_scale") and not bool(t.any()) for k, t in tensors.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="adapter file (.safetensors / .ckpt / .pt)")
    p.add_argument("-s", "--show_all_keys", action="store_true", help="also list every key of the file")
    return p


def run(argv: Sequence[str] | None = None) -> bool:
    """Print the check; returns False when problems were found."""
    args = build_parser().parse_args(argv)
    result = check_file(args.file)
    print(f"number of LoRA modules: {result.modules} ({len(result.tensor_lines)} tensors)")
    if args.show_all_keys:
        for key in dl.load_adapter(args.file).state_dict():
            print(key)
    for line in result.tensor_lines:
        print(line)
    for line in result.summary:
        print(line)
    for line in result.problems:
        print(f"problem: {line}")
    return not result.problems


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
