"""The planner's advice for the rows of the docs' memory tables (benchmarks/docs_memory_tables.py) on their cards:
each row's exact command planned with ``--vram CARD``; a row over its card gets the changes that make it fit
(library/measure/advice.py: the cheapest first, each planned), their planned card peak and their step-time cost.

    python benchmarks/docs_memory_advice.py --table flux-dev                 # print the generated block
    python benchmarks/docs_memory_advice.py --table flux-dev --rows 12 10    # some rows only (no --write)
    python benchmarks/docs_memory_advice.py --table flux-dev sd3.5 --write   # put the blocks in the doc
    python benchmarks/docs_memory_advice.py --table flux-dev --check --reuse --workdir DIR

Besides the table's own rows, :data:`AS_STATED` adds rows as their source states them where the table's command
differs (sd-scripts' FLUX.1 12 GB row takes 8-bit AdamW; the table's rows all take AdamW). Each row plans in its
own call of the script's ``run`` (plan and advice: a FLUX.1-dev row 1-4 plans of about a minute on a loaded 2-core
machine, 2.6 GB of RSS; SD3.5-large 2 minutes a plan, 6 GB); ``--reuse`` reads back the plans an earlier run left
in ``--workdir``. The block (``<!-- docs_memory_tables: NAME-advice ... -->``) follows the table's own block in its
doc; ``--check`` exits 1 when the doc's block is not the generated one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "benchmarks"))

import docs_memory_tables as tables  # noqa: E402

from library.measure.advice import unplanned  # noqa: E402

GIB = 1024.0  # MiB
# table -> rows as their source states them, or on another card (key, label, flags added to the table's row of that
# key[, the card in GiB])
AS_STATED = {"flux-dev": [("12", "12 GB as sd-scripts states it (8-bit AdamW)", ["--optimizer_type", "AdamW8bit"])],
             "qwen-image": [("fp8:45", "fp8 / 45 on a 10 GiB card (our goal)", [], 10.0)]}  # fmt: skip


def advice_rows(table: tables.Table, name: str) -> list[tuple[str, tables.Row]]:
    """The rows marked ``advise`` (every row when none is), then :data:`AS_STATED`'s."""
    marked = [row for row in table.rows if row.advise]
    rows = [(" / ".join(row.cells), row) for row in marked or table.rows]
    for key, label, flags, *card in AS_STATED.get(name, []):
        row = next(r for r in table.rows if r.key == key)
        rows.append((label, dataclasses.replace(row, flags=[*row.flags, *flags], key=f"{key}-stated",
                                                card_gib=card[0] if card else row.card_gib)))  # fmt: skip
    return rows


def cells(label: str, row: tables.Row, plan: dict) -> list[str]:
    card = plan["card_peak_mib"] / GIB
    own = f"{card:.2f} ({'fits' if card <= row.card_gib else f'{card - row.card_gib:.2f} over'})"
    advice = plan.get("advice")
    if advice is None:
        return [label, f"{row.card_gib:g}", own, "none: the row fits", "-", "-"]
    changes = advice["changes"]
    flags = " ".join(f"`{' '.join(t['flags'])}`" for t in changes) or "-"
    peak = f"{changes[-1]['card_peak_mib'] / GIB:.2f}" if changes else "-"
    if not advice["fits"]:
        after = f"with {flags} the other phases fit, " if changes else ""
        named = unplanned(plan, advice["over"], row.flags)  # a family's flag the planner cannot plan
        return [label, f"{row.card_gib:g}", own, f"none fits: {after}{', '.join(advice['over'])} stays over (no flag "
                f"the planner can plan lowers it: cache in a run of its own{named})", peak, "-"]  # fmt: skip
    return [label, f"{row.card_gib:g}", own, flags, peak, advice["cost"]]


def block(table: tables.Table, name: str, rows: list[tuple[str, tables.Row]], plans: list[dict]) -> list[str]:
    heads = ["row", "card GiB", "planned card peak", "the advice (added to the row's flags)", "its planned card peak",
             "step-time cost vs the row's flags"]  # fmt: skip
    lines = [f"Each row's command above planned with `--plan_memory --vram CARD` (library/measure/advice.py; "
             f"`python benchmarks/docs_memory_advice.py --table {name}`; the costs: \"Will it fit?\" above):", "",
             "| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(cells(label, row, plan)) + " |" for (label, row), plan in zip(rows, plans)]
    return lines


def begin_mark(name: str) -> str:
    return (
        f"<!-- docs_memory_tables: {name}-advice (python benchmarks/docs_memory_advice.py --table {name} --write) -->"
    )


def replace_block(text: str, name: str, block: list[str]) -> str:
    """``text`` with ``name``'s advice block replaced by ``block`` (put after the table's own block when it has none)."""
    lines = text.splitlines()
    new = [begin_mark(name), *block, tables.end_mark(f"{name}-advice")]
    old = tables.read_block(text, f"{name}-advice")
    if old is None:
        at = lines.index(tables.end_mark(name)) + 1
        return "\n".join([*lines[:at], "", *new, *lines[at:]]) + "\n"
    start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- docs_memory_tables: {name}-advice "))
    return "\n".join([*lines[:start], *new, *lines[start + len(old) + 2 :]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", nargs="+", choices=list(tables.TABLES), required=True)
    parser.add_argument("--write", action="store_true", help="put the generated block in the doc")
    parser.add_argument("--check", action="store_true", help="compare with the doc's block")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--reuse", action="store_true", help="the plans an earlier run left in --workdir")
    parser.add_argument("--rows", nargs="+", default=None, help="only these rows (their keys): no --write / --check")
    args = parser.parse_args(argv)
    if args.rows and (args.write or args.check):
        parser.error("--rows plans some rows: the doc's block is written and checked from a whole table")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="docs-advice-"))
    problems = []
    for name in args.table:
        table = tables.TABLES[name]
        rows = [(label, row) for label, row in advice_rows(table, name) if not args.rows or row.key in args.rows]
        plans = []
        for _, row in rows:  # one row at a time: each with its own card
            one = dataclasses.replace(table, rows=[row])
            plans += tables.plan_rows(one, work / name, args.reuse, f"{row.card_gib:g}")
        lines = block(table, name, rows, plans)
        print("\n".join([begin_mark(name), *lines, tables.end_mark(f"{name}-advice")]))
        doc = HERE / table.doc
        if args.check and tables.read_block(doc.read_text(), f"{name}-advice") != lines:
            problems.append(f"{table.doc}: the {name}-advice block is not the generated one (run with --write)")
        if args.write:
            doc.write_text(replace_block(doc.read_text(), name, lines))
    for p in problems:
        print("CHECK:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
