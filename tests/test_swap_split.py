"""How ``--blocks_to_swap N`` is shared between the block lists, by the family's rule (library/run/swap_split.py):
FLUX.2 takes musubi-tuner's split by the lists' ratio, whose limits on the released models are the ones musubi-tuner's
docs/flux_2.md lists (dev 29, klein 4B 13, klein 9B 16); the families on sd-scripts' even split keep theirs."""

from __future__ import annotations

import pytest
from torch import nn

from library.families.base import BlockList
from library.families.flux2 import FLUX2
from library.families.flux2 import model as M
from library.run.block_swap import BlockSwapConfig
from library.run.config import block_swap_problems
from library.run.swap_split import KEEP_ON_DEVICE, max_blocks_to_swap, split_blocks_to_swap


def _lists(double: int, single: int) -> list[BlockList]:
    return [BlockList(nn.ModuleList(nn.Identity() for _ in range(double)), 1),
            BlockList(nn.ModuleList(nn.Identity() for _ in range(single)), 2)]  # fmt: skip


@pytest.mark.parametrize(("version", "most"), [("dev", 29), ("klein-4b", 13), ("klein-9b", 16)])
def test_flux2_limits_are_musubi_tuners(version, most):
    """musubi-tuner's table of the largest --blocks_to_swap per FLUX.2 model, from the family's own lists."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        lists = FLUX2.swap_blocks(M.build(M.RELEASED[version]))
    assert FLUX2.block_swap_split == "ratio"
    assert max_blocks_to_swap(lists, "ratio") == most
    with pytest.raises(ValueError, match=f"at most {most} can be swapped"):
        split_blocks_to_swap(most + 1, lists, "ratio")


def test_ratio_split_keeps_the_lists_ratio_and_two_blocks_each():
    """Every accepted N on dev's 8 + 48 blocks: the singles are six times the doubles until the doubles reach their
    limit (then two singles per unit more), each list keeps two blocks, and more N never swaps fewer blocks."""
    lists = _lists(8, 48)
    swapped = []
    for n in range(1, max_blocks_to_swap(lists, "ratio") + 1):
        d, s = split_blocks_to_swap(n, lists, "ratio")
        assert d <= 8 - KEEP_ON_DEVICE and s <= 48 - KEEP_ON_DEVICE
        assert s == 6 * d or (d == 8 - KEEP_ON_DEVICE and s > 6 * d) or (d, s) == (0, 1)
        swapped.append(d + s)
    assert swapped == sorted(swapped) and split_blocks_to_swap(29, lists, "ratio") == [6, 44]


def test_even_split_unchanged_and_the_planner_check_reads_the_family():
    """The even rule still gives sd-scripts' FLUX.1 split; the check made before loading uses FLUX.2's rule (dev's
    lists: 29 accepted, 30 refused), where the even rule stopped at 13."""
    flux1 = _lists(19, 38)
    assert split_blocks_to_swap(10, flux1) == [5, 10] and max_blocks_to_swap(flux1) == 35
    assert max_blocks_to_swap(_lists(8, 48)) == 13
    assert block_swap_problems(FLUX2, BlockSwapConfig(29)) == []
    assert "at most 29" in block_swap_problems(FLUX2, BlockSwapConfig(30))[0]
