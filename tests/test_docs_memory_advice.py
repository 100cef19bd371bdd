"""benchmarks/docs_memory_advice.py's cells and its block's place in a doc, on made-up plans (the real-size plans and
their advice take minutes of CPU: run by hand, not here)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import docs_memory_advice as dma  # noqa: E402
import docs_memory_tables as dmt  # noqa: E402


def change(flags: list[str], card_mib: float) -> dict:
    return {"flags": flags, "card_peak_mib": card_mib}


def test_cells_give_the_rows_verdict_the_advice_its_peak_and_its_cost():
    table = dmt.TABLES["flux-dev"]
    rows = dma.advice_rows(table, "flux-dev")
    label, twelve = next((label, row) for label, row in rows if row.key == "12")
    stated = next(row for _, row in rows if row.key == "12-stated")
    assert stated.flags[-2:] == ["--optimizer_type", "AdamW8bit"] and stated.flags[:-2] == twelve.flags
    assert dma.cells(label, twelve, {"card_peak_mib": 11.5 * 1024})[2:] == ["11.50 (fits)", "none: the row fits", "-",
                                                                            "-"]  # fmt: skip
    advice = {"fits": True, "cost": "no step-time cost known",
              "changes": [change(["--optimizer_type", "AdamW8bit"], 12.2 * 1024), change(["--blocks_to_swap", "17"],
                                                                                        11.9 * 1024)]}  # fmt: skip
    cells = dma.cells(label, twelve, {"card_peak_mib": 12.74 * 1024, "advice": advice})
    assert cells[1:] == ["12", "12.74 (0.74 over)", "`--optimizer_type AdamW8bit` `--blocks_to_swap 17`", "11.90",
                         "no step-time cost known"]  # fmt: skip
    over = dma.cells(label, twelve, {"card_peak_mib": 12.74 * 1024,
                                     "advice": {"fits": False, "changes": [], "over": ["text caching"]}})  # fmt: skip
    assert over[3].startswith("none fits: text caching stays over") and over[4:] == ["-", "-"]


def test_the_block_follows_its_table_and_is_replaced_in_place():
    doc = dmt.replace_block("# Doc\n\ntext\n", "flux-dev", ["| table |"]) + "\nafter\n"
    first = dma.replace_block(doc, "flux-dev", ["| advice |"])
    assert dmt.read_block(first, "flux-dev-advice") == ["| advice |"] and dmt.read_block(first, "flux-dev") == [
        "| table |"
    ]
    lines = first.splitlines()
    assert lines.index(dma.begin_mark("flux-dev")) == lines.index(dmt.end_mark("flux-dev")) + 2
    again = dma.replace_block(first, "flux-dev", ["| new |"])
    assert again == first.replace("| advice |", "| new |") and again.rstrip().endswith("after")
