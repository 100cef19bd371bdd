"""Tables of a paired benchmark run (benchmarks/bench_vs_sdscripts.py): per-side medians and paired ratios.

A record is one whole-process run (a dict): ``case``, ``side`` (a label: "sd-scripts", "before", "sdtrain"),
``steps``, ``pair``, ``rc``, ``wall_s``, and where measured ``cpu_s``, ``peak_rss_mb``, ``ttfs_s`` (time to first
step), ``s_per_step`` (median per-step interval from progress-bar stamps), ``loop_s_per_step`` /
``loop_cpu_s_per_step`` (wall / process CPU seconds from step 2 to the last step, per step), ``rss_to_step1_mb`` /
``rss_after_step1_mb`` (sampled), ``output`` (summary of the written file) and ``keys`` (key -> shape).
Ratios are medians of pair-by-pair ratios (each pair ran the sides back to back), never ratios of medians.
Pure functions of the records: no torch, no subprocess (tests/test_bench_vs_sdscripts.py runs them alone).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import struct
from collections.abc import Iterable

# (metric key, column title, decimals); per pair at the largest step count unless the key says otherwise
METRICS = (
    ("wall_lo", "wall N={lo} s", 1),
    ("wall_hi", "wall N={hi} s", 1),
    ("sps", "s/step stamps N={hi}", 3),
    ("lwall", "s/step loop mean N={hi}", 3),
    ("lcpu", "CPU s/step loop N={hi}", 3),
    ("diff", "s/step (wall{hi}-wall{lo})/{d}", 3),
    ("cdiff", "CPU s/step (cpu{hi}-cpu{lo})/{d}", 3),
    ("cpu_hi", "CPU s N={hi}", 1),
    ("ttfs", "time to 1st step s", 2),
    ("rss", "peak RSS MB", 0),
)
TWO_STEP_ONLY = {"wall_lo", "diff", "cdiff"}  # need two step counts


def med(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def safetensors_summary(path: str) -> dict:
    """Key count, adapter module count (``lora_down`` keys) per prefix, parameter count (every tensor but the
    ``.alpha`` scalars), dtypes and key -> shape of a file's header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    prefixes: dict[str, int] = {}
    for k in header:
        if k.endswith(".lora_down.weight"):
            m = re.match(r"lora_(?:te\d?|unet)", k)
            p = m.group(0) if m else k.split(".")[0]
            prefixes[p] = prefixes.get(p, 0) + 1
    return {
        "keys": len(header),
        "modules": sum(k.endswith(".lora_down.weight") for k in header),
        "params": sum(math.prod(v["shape"]) for k, v in header.items() if not k.endswith(".alpha")),
        "modules_by_prefix": prefixes,
        "dtypes": sorted({v["dtype"] for v in header.values()}),
        "shapes": {k: v["shape"] for k, v in header.items()},
    }


def side_metrics(recs: list[dict], case: str, side: str, lo: int, hi: int) -> dict[str, dict]:
    """Metric key -> {pair (or (pair, steps)) -> value} of the successful runs of one case and side."""
    rs = [r for r in recs if r["case"] == case and r["side"] == side and r["rc"] == 0]
    at = {n: {r["pair"]: r for r in rs if r["steps"] == n} for n in (lo, hi)}
    both = [p for p in at[hi] if p in at[lo]] if hi > lo else []

    def per_step(key: str) -> dict:
        out = {}
        for p in both:
            a, b = at[lo][p].get(key), at[hi][p].get(key)
            if a is not None and b is not None:
                out[p] = (b - a) / (hi - lo)
        return out

    return {
        "wall_lo": {p: r["wall_s"] for p, r in at[lo].items()},
        "wall_hi": {p: r["wall_s"] for p, r in at[hi].items()},
        "sps": {p: r.get("s_per_step") for p, r in at[hi].items()},
        "lwall": {p: r.get("loop_s_per_step") for p, r in at[hi].items()},
        "lcpu": {p: r.get("loop_cpu_s_per_step") for p, r in at[hi].items()},
        "diff": per_step("wall_s"),
        "cdiff": per_step("cpu_s"),
        "cpu_hi": {p: r.get("cpu_s") for p, r in at[hi].items()},
        "ttfs": {(r["pair"], r["steps"]): r.get("ttfs_s") for r in rs},
        "rss": {(r["pair"], r["steps"]): r.get("peak_rss_mb") for r in rs},
        "rss1": {(r["pair"], r["steps"]): r.get("rss_to_step1_mb") for r in rs},
        "rss2": {(r["pair"], r["steps"]): r.get("rss_after_step1_mb") for r in rs},
        "runs": {(r["pair"], r["steps"]): 1 for r in rs},
    }


def paired_ratio(num: dict, den: dict) -> float | None:
    """Median over the keys (pairs) both sides have of num / den."""
    return med([num[k] / den[k] for k in den if k in num and den[k] and num[k] is not None and den[k] is not None])


def _metric_keys(lo: int, hi: int) -> list[tuple[str, str, int]]:
    return [(k, t.format(lo=lo, hi=hi, d=hi - lo), nd) for k, t, nd in METRICS if hi > lo or k not in TWO_STEP_ONLY]


def key_check(recs: list[dict], case: str, sides: list[str]) -> str:
    """One line: each side's file facts, and whether its key+shape set equals the first side's."""
    first = {}
    for side in sides:
        done = [r for r in recs if r["case"] == case and r["side"] == side and r.get("keys") is not None]
        if done:
            first[side] = done[0]
    if not first:
        return f"- {case}: no output file on any side"
    ref_side, ref = next(iter(first.items()))
    parts = []
    for side in sides:
        r = first.get(side)
        if r is None:
            parts.append(f"{side}: no output file")
            continue
        o = r.get("output", {})
        facts = (
            f"{side} {o.get('keys')} keys / {o.get('modules')} modules {o.get('modules_by_prefix')} / "
            f"{o.get('params')} parameters {o.get('dtypes')}"
        )
        if side != ref_side:
            a, b = ref["keys"], r["keys"]
            if a == b:
                facts += f" -> IDENTICAL key+shape set to {ref_side}"
            else:
                shape = sum(1 for k in set(a) & set(b) if a[k] != b[k])
                facts += (f" -> DIFFERENT from {ref_side}: {len(set(a) - set(b))} keys only in {ref_side}, "
                          f"{len(set(b) - set(a))} only in {side}, {shape} shape mismatches")  # fmt: skip
        parts.append(facts)
    return f"- {case}: " + "; ".join(parts)


def comparisons(sides: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) pairs: every sdtrain side over sd-scripts (the first side), then last over the
    second (after / before) when there are three sides."""
    out = [(s, sides[0]) for s in sides[1:]]
    if len(sides) == 3:
        out.append((sides[2], sides[1]))
    return out


def summarize(recs: list[dict], sides: list[str], steps: list[int]) -> str:
    """The markdown report: per-side medians, ratio tables, key-set check, failed runs."""
    lo, hi = min(steps), max(steps)
    cols = _metric_keys(lo, hi)
    cases = list(dict.fromkeys(r["case"] for r in recs))
    per = {(c, s): side_metrics(recs, c, s, lo, hi) for c in cases for s in sides}
    lines = ["| case | side | " + " | ".join(t for _, t, _ in cols) + " | sampled RSS MB: to step 1 / after | runs |",
             "|---|---|" + "---|" * (len(cols) + 2)]  # fmt: skip
    for c in cases:
        for s in sides:
            m = per[(c, s)]
            vals = " | ".join(fmt(med(m[k].values()), nd) for k, _, nd in cols)
            rss12 = f"{fmt(med(m['rss1'].values()), 0)} / {fmt(med(m['rss2'].values()), 0)}"
            lines.append(f"| {c} | {s} | {vals} | {rss12} | {len(m['runs'])} |")
    text = "\n".join(lines) + "\n"
    for num, den in comparisons(sides):
        titles = [re.sub(r" (s|MB)$", "", t) for _, t, _ in cols]  # ratios have no unit
        text += (f"\nRatios {num} / {den} (median of pair-by-pair ratios; < 1 = {num} faster/smaller):\n\n"
                 "| case | " + " | ".join(titles) + " |\n|---|" + "---|" * len(cols) + "\n")  # fmt: skip
        for c in cases:
            text += f"| {c} | " + " | ".join(fmt(paired_ratio(per[(c, num)][k], per[(c, den)][k]), 2)
                                            for k, _, _ in cols) + " |\n"  # fmt: skip
    text += "\nSame training on every side (output key+shape sets):\n\n" + "\n".join(key_check(recs, c, sides)
                                                                                      for c in cases) + "\n"  # fmt: skip
    bad = [r for r in recs if r["rc"] != 0 or r.get("dataset_changed")]
    if bad:
        text += "\nProblems:\n" + "".join(
            f"- {r['case']} N={r['steps']} pair {r['pair']} {r['side']}: rc={r['rc']} {r.get('dataset_changed', '')}"
            f" (log: {r.get('log', '?')})\n" for r in bad)  # fmt: skip
    return text
