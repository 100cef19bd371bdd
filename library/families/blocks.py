"""Block numberings of denoisers for block-wise adapter settings (``block_dims``, ``down/mid/up_lr_weight``, FLUX's
``train_double_block_indices``...): the shared base each family's numbering (``ModelFamily.blocks``) subclasses.

A numbering says which kohya module names are written in it (:meth:`BlockLayout.names_match`), which block a name
is in (:meth:`BlockLayout.index`), and how sd-scripts' down / mid / up weights map onto its blocks. The SD UNets'
numberings are in ``sd/blocks.py``, FLUX's and SD3's in their folders.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockLayout:
    """One numbering. ``down``/``mid``/``up``: how many values ``down_lr_weight`` / ``mid_lr_weight`` /
    ``up_lr_weight`` take; ``edges``: whether an embedding block (0) and an out block (last) frame them (sgm).
    Subclasses say which names are theirs and number them; this base numbers no block."""

    name: str
    num_blocks: int
    down: int
    mid: int
    up: int
    edges: bool = False

    def lr_weights(self, down: list[float], mid: list[float], up: list[float]) -> list[float]:
        """One weight per block from the three lists (1.0 for the embedding and out blocks where there are some)."""
        return [1.0, *down, *mid, *up, 1.0] if self.edges else [*down, *mid, *up]

    def names_match(self, name: str) -> bool:
        """Whether a kohya denoiser module name is written in this numbering's naming (a numbered block of it)."""
        return False

    def index(self, name: str) -> int:
        """The block of a kohya denoiser module name (sd-scripts' ``get_block_index``); -1 outside the numbered
        blocks."""
        return -1
