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
