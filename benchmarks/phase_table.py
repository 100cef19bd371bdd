"""What the ``*_memory.py`` benchmarks share: the two-image work folder, the run of their rows (one JSON line each)
and the markdown table they print (one row per run: its settings, the simulated device's peak per phase, the highest
with the CUDA context against the goal)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

SETTINGS = (("model", "variant"), ("weights", "weights"), ("--blocks_to_swap", "blocks_to_swap"), ("batch", "batch"))
"""The lead columns of a row of MODE:N settings (model, weights, --blocks_to_swap, batch)."""


def two_image_work(work: Path, resolution: int, prompt: str) -> None:
    """Two images (and their captions) of the demo dataset at ``resolution`` under ``work/data`` and one sample
    prompt line in ``work/prompts.txt``."""
    from library.run.demo import make_example_dataset

    if not (work / "data").exists():
        make_example_dataset(work / "four", size=resolution)
        (work / "data" / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (work / "data" / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    (work / "prompts.txt").write_text(prompt + "\n")


def run_rows(rows: Sequence, measure: Callable[..., dict], *args) -> list[dict]:
    """``measure(row, *args)`` for each row, each result printed as one JSON line as it comes."""
    results = []
    for row in rows:
        result = measure(row, *args)
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def print_phase_table(rows: list[dict], lead: Sequence[tuple[str, str]], context_gib: float, goal_gib: float,
                      after: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
    """The markdown table: ``lead`` (header, key) columns, the phases of ``peak_gib``, ``after`` columns, then
    ``highest_gib`` + ``context_gib`` and whether it ``meets_goal`` (<= ``goal_gib``)."""
    phases = list(rows[0]["peak_gib"])
    heads = [h for h, _ in lead] + phases + [h for h, _ in after]
    heads += [f"highest + {context_gib:g} GiB", f"<= {goal_gib:g} GiB"]
    print("\n| " + " | ".join(heads) + " |")
    print("|---" * len(heads) + "|")
    for r in rows:
        cells = [str(r[k]) for _, k in lead] + [str(r["peak_gib"].get(p, "")) for p in phases]
        cells += [str(r[k]) for _, k in after]
        cells += [f"{r['highest_gib'] + context_gib:.2f}", "yes" if r["meets_goal"] else "NO"]
        print("| " + " | ".join(cells) + " |")
