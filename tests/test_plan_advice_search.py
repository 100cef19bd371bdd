"""library/measure/advice.py's ``--blocks_to_swap`` search against the brute-force answer, on made-up peak curves
(the real plans it searches take seconds each: the tiny-model advice runs are in tests/test_plan_memory.py)."""

from __future__ import annotations

import pytest

from library.measure.advice import _smallest_swap


def curve(saving: tuple[float, ...], limit: int):
    """A plan function whose step peak falls by ``saving[N % len(saving)]`` MiB per block swapped (sd-scripts'
    split alternates double and single blocks), refusing N above ``limit``; counts its plans."""
    calls = []

    def peak(n: int) -> float:
        return 1000.0 - sum(saving[i % len(saving)] for i in range(n))

    def plan_with(changes):
        n = int(dict((f, v) for f, v in changes)["--blocks_to_swap"][0])
        calls.append(n)
        if n > limit:
            raise ValueError(f"--blocks_to_swap {n}: at most {limit}")
        return {"peak": peak(n)}

    return plan_with, peak, calls


@pytest.mark.parametrize("given", [0, 5, 16])
@pytest.mark.parametrize("target", [990.0, 900.0, 700.0, 500.0])
def test_the_swap_search_finds_the_smallest_n_that_fits_or_the_largest_accepted(given, target):
    plan_with, peak, calls = curve((9.0, 13.0, 11.0), limit=35)
    found = _smallest_swap(plan_with, [], given, {"peak": peak(given)}, lambda plan: plan["peak"] - target)
    fitting = [n for n in range(given + 1, 36) if peak(n) <= target]
    if fitting:
        assert found[0] == fitting[0] and found[1]["peak"] == peak(fitting[0])
        assert len(calls) <= 8  # the guess from the MiB saved per block, then a few bisection steps
    else:  # nothing fits: the most blocks the script takes, so the changes after it start from there
        assert found[0] == 35 and found[1]["peak"] == peak(35) and 36 in calls


def test_a_script_without_block_swap_gets_no_swap():
    def refused(changes):
        raise SystemExit(2)  # argparse: no such flag

    assert _smallest_swap(refused, [], 0, {"peak": 1.0}, lambda plan: 1.0) is None


def test_a_familys_caching_flags_come_before_the_costly_changes_skipping_the_given_and_the_refused():
    """Made-up plans whose text-caching phase is over the card: of the family's three flags (the plan's
    ``caching_memory_flags``, cheapest first) the one the command has is not offered, the one the script refuses is
    skipped with its reason, and the third is taken; it fits, so nothing after it (--fp8_base, which lowers text
    caching too at a cost) is planned. The step phase is under the card throughout."""
    from library.measure.advice import advise, unplanned

    def flag(name: str) -> dict:
        return {"flags": [name], "label": name, "phase": "text caching", "step_slowdown": 0.0, "cost": "none"}

    argv = ["--cache_latents", "--cache_text_encoder_outputs", "--optimizer_type", "AdamW8bit", "--fp8_given"]
    planned, lines = [], []

    def plan_with(changes):
        flags = [f for f, _ in changes]
        planned.append(flags)
        if "--fp8_refused" in flags:
            raise ValueError("--fp8_refused: the script refuses it here")
        text = 100.0 - 40.0 * ("--fp8_taken" in flags) - 30.0 * ("--fp8_base" in flags)
        return {"text caching": text, "step": 50.0, "card_peak_mib": text, "host_peak_mib": 0.0,
                "caching_memory_flags": [flag("--fp8_refused"), flag("--fp8_given"), flag("--fp8_taken"),
                                         {**flag("--on_host"), "planned": False}]}  # fmt: skip

    def peaks(plan: dict) -> dict:
        return {phase: plan[phase] for phase in ("text caching", "step")}

    taken = advise(plan_with, argv, 80.0, lines.append, peaks=peaks)
    assert [t["flags"] for t in taken] == [["--fp8_taken"]] and taken[0]["card_peak_mib"] == 60.0
    assert planned == [[], ["--fp8_refused"], ["--fp8_taken"]]
    assert any("--fp8_refused: the script refuses it here" in line for line in lines)
    # a flag the planner cannot plan is never tried; the line saying nothing fits names it for its phase
    assert unplanned(plan_with([]), ["text caching"], argv).startswith("; text caching: --on_host (--on_host)")
    assert unplanned(plan_with([]), ["step"], argv) == unplanned(plan_with([]), ["text caching"], ["--on_host"]) == ""
