"""benchmarks/docs_memory_tables.py's formatting, marks and checks on a made-up plan (the real-size plans it runs
take minutes of CPU: run by hand, not here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import docs_memory_tables as dmt  # noqa: E402

MIB = {"load": 0.0, "latent caching": 1443.8, "text caching": 6901.8, "step": 3650.6, "sampling": 4382.7}


def plan(card_mib: float) -> dict:
    return {"phases": {p: {"device_mib": v, "host_mib": 1.0} for p, v in MIB.items()}, "card_peak_mib": card_mib}


def test_row_cells_are_the_plans_gib_and_the_verdict_its_card():
    table = dmt.TABLES["sd3.5"]
    row = table.rows[0]
    cells = dmt.row_cells(table, row, plan(8.0 * 1024 - 10))
    lead, phases, (highest, card, fits) = cells[:2], cells[2:8], cells[8:]
    assert lead == ["SD3.5-medium", "0"]
    for phase, cell in zip(dmt.PHASES, phases):
        assert cell == ("-" if phase not in MIB else f"{MIB[phase] / 1024:.2f}")
    assert float(highest) == round(max(MIB.values()) / 1024 + 1, 2)
    assert (card, fits) == ("7.99", "yes (8)")
    over = dmt.row_cells(table, row, plan(8.5 * 1024))
    assert over[-2:] == ["8.50", "no (8: 0.50 over)"]


def test_blocks_are_replaced_between_their_marks_only():
    doc = "# Doc\n\ntext before\n"
    first = dmt.replace_block(doc, "sd3.5", ["| a |", "| b |"])
    assert first.startswith(doc) and dmt.read_block(first, "sd3.5") == ["| a |", "| b |"]
    both = dmt.replace_block(first + "\nbetween\n", "flux-dev", ["| f |"])
    again = dmt.replace_block(both, "sd3.5", ["| c |"])
    assert dmt.read_block(again, "sd3.5") == ["| c |"] and dmt.read_block(again, "flux-dev") == ["| f |"]
    assert again.replace("| c |", "| a |\n| b |") == both  # nothing else moved
    assert dmt.read_block(doc, "sd3.5") is None
    assert dmt.begin_mark("sd3.5") in again and "--table sd3.5 --write" in dmt.begin_mark("sd3.5")


def test_measured_rows_are_compared_at_their_rounding(tmp_path, capsys):
    table = dmt.TABLES["sd3.5"]
    plans = [plan(7000.0)] + [plan(7000.0)] * (len(table.rows) - 1)
    gib = {p: round(v / 1024, 2) for p, v in MIB.items()}
    lines = [json.dumps({"row": "medium:0", "peak_gib": gib}), "not json",
             json.dumps({"row": "medium:12", "peak_gib": dict(gib, step=gib["step"] + 0.02)})]  # fmt: skip
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    bad = dmt.compare_measured(table, plans, tmp_path / "m.jsonl", tolerance_mib=0.0)
    assert bad == ["medium:12 step: " + f"{MIB['step'] - (gib['step'] + 0.02) * 1024:+.1f} MiB"]
    assert "large:0: no measured row" in capsys.readouterr().out
    assert dmt.compare_measured(table, plans, tmp_path / "m.jsonl", tolerance_mib=30.0) == []
