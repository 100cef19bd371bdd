"""How ``--blocks_to_swap N`` is shared between a denoiser's block lists (library/run/block_swap.py swaps the
blocks). The family chooses the rule (``ModelFamily.block_swap_split``, default ``"even"``), so a trainer's own
command lines keep their meaning:

* ``"even"``, sd-scripts' (``FluxModel.enable_block_swap``): N shared out evenly over the lists, the last list taking
  the remainder, each share counted in the list's ``per_unit`` blocks. FLUX.1 (double ``per_unit`` 1, single 2):
  ``[N // 2, (N - N // 2) * 2]``, at most 35.
* ``"ratio"``, musubi-tuner's (``flux2_models.Flux2.enable_block_swap``), for a double and a single list: the
  doubles ``round(N / (1 + r / 2))`` and the singles ``round(doubles · r)``, ``r`` the ratio of their lengths
  (Python's rounding, half to even); a list over its limit gives one double for two singles (or back); when both
  come to 0, one block of the longer list. FLUX.2 dev (8 + 48 blocks): N = 29 swaps 6 double and 44 single blocks.

Either way each list keeps at least :data:`KEEP_ON_DEVICE` blocks on the device, and an N past that is refused with
the largest N that can be done.
"""

from __future__ import annotations

from collections.abc import Sequence

from library.families.base import BlockList

KEEP_ON_DEVICE = 2  # blocks of each list that stay on the device (sd-scripts: "num_blocks - 2" at most swapped)
SPLITS = ("even", "ratio")


def _even(n: int, lists: Sequence[BlockList]) -> list[int]:
    k = len(lists)
    shares = [n // k] * (k - 1) + [n - (k - 1) * (n // k)]
    return [share * bl.per_unit for share, bl in zip(shares, lists)]


def _ratio(n: int, lists: Sequence[BlockList]) -> list[int]:
    if len(lists) != 2:
        return _even(n, lists)  # the rule is for a double and a single list
    d_len, s_len = (len(bl.blocks) for bl in lists)
    if n <= 0:
        return [0, 0]
    if d_len == 0 or s_len == 0:
        return [n if s_len == 0 else 0, n if d_len == 0 else 0]
    r = s_len / d_len
    d = int(round(n / (1.0 + r / 2.0)))
    s = int(round(d * r))
    if d_len * 2 < s_len:
        while d >= 1 and d > d_len - KEEP_ON_DEVICE:
            d, s = d - 1, s + 2
    else:
        while s >= 2 and s > s_len - KEEP_ON_DEVICE:
            d, s = d + 1, s - 2
    if d == 0 and s == 0:
        return [0, 1] if s_len >= d_len else [1, 0]
    return [d, s]


def _counts(n: int, lists: Sequence[BlockList], split: str) -> list[int]:
    return _ratio(n, lists) if split == "ratio" else _even(n, lists)


def _fits(counts: Sequence[int], lists: Sequence[BlockList]) -> bool:
    return all(c <= len(bl.blocks) - KEEP_ON_DEVICE for c, bl in zip(counts, lists))


def split_blocks_to_swap(n: int, lists: Sequence[BlockList], split: str = "even") -> list[int]:
    """How many blocks of each list ``--blocks_to_swap n`` swaps by the rule ``split`` (module docstring).

    Raises ValueError when a list would keep fewer than two blocks on the device, or there are no lists."""
    if n < 0:
        raise ValueError(f"--blocks_to_swap must be >= 0, got {n}")
    if not lists:
        raise ValueError("--blocks_to_swap: this denoiser has no block lists to swap")
    if split not in SPLITS:
        raise ValueError(f"block swap split {split!r}: one of {', '.join(SPLITS)}")
    counts = _counts(n, lists, split)
    if not _fits(counts, lists):
        sizes = " and ".join(f"{c} of {len(bl.blocks)}" for c, bl in zip(counts, lists))
        raise ValueError(f"--blocks_to_swap {n} would swap {sizes} blocks; each list keeps at least "
                         f"{KEEP_ON_DEVICE} on the device, so at most {max_blocks_to_swap(lists, split)} can be "
                         "swapped")  # fmt: skip
    return counts


def max_blocks_to_swap(lists: Sequence[BlockList], split: str = "even") -> int:
    """The largest N :func:`split_blocks_to_swap` accepts (35 for FLUX.1's 19 double + 38 single blocks by the even
    rule; 29 for FLUX.2 dev's 8 + 48 by the ratio rule)."""
    n = 0
    while _fits(_counts(n + 1, lists, split), lists):
        n += 1
    return n


def swap_problems(n: int | None, lists: Sequence[BlockList], family_title: str, split: str = "even") -> list[str]:
    """Problems of ``--blocks_to_swap n`` for a denoiser with these block lists (empty: it can be done)."""
    if not n:
        return []
    if not lists:
        from library.families.registry import block_swap_groups

        groups, scripts = block_swap_groups()
        return [f"--blocks_to_swap {n}: the {family_title} denoiser has no transformer block lists to swap; sd-scripts "
                f"swaps blocks for {' and '.join(groups)} only ({', '.join(scripts)}): remove the flag"]  # fmt: skip
    try:
        split_blocks_to_swap(n, lists, split)
    except ValueError as e:
        return [f"{e}: lower --blocks_to_swap"]
    return []
