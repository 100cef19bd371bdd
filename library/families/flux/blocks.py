"""FLUX's block numbering for adapter names: double blocks 0-18, then single blocks 0-37 (57 blocks).

sd-scripts' ``networks/lora_flux.py`` selects blocks by ``train_double_block_indices`` / ``train_single_block_indices``
and has no ``block_dims`` / ``down/mid/up_lr_weight`` (the SD UNet's down / mid / up split does not exist here), so
this layout has no down/mid/up values; it tells FLUX adapter names apart from SD/SDXL ones (``lora_unet_double_blocks_``
/ ``lora_unet_single_blocks_``, which SDXL files with the same ``lora_unet`` / ``lora_te1`` prefixes never have) and
numbers them. The shared ``BlockLayout`` has no notion of two block kinds, hence this subclass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..blocks import BlockLayout

_RE_FLUX = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_")
NUM_DOUBLE, NUM_SINGLE = 19, 38


@dataclass(frozen=True)
class FluxBlocks(BlockLayout):
    """Double blocks first (index = block number), then single blocks (index = 19 + block number); -1 elsewhere."""

    num_double: int = NUM_DOUBLE

    def names_match(self, name: str) -> bool:
        return bool(_RE_FLUX.match(name))

    def index(self, name: str) -> int:
        m = _RE_FLUX.match(name)
        if not m:
            return -1
        return int(m.group(2)) + (0 if m.group(1) == "double" else self.num_double)

    def double_single(self, name: str) -> tuple[str, int] | None:
        """("double" | "single", block number) of a kohya name, or None outside the blocks."""
        m = _RE_FLUX.match(name)
        return (m.group(1), int(m.group(2))) if m else None


FLUX_BLOCKS = FluxBlocks("flux", NUM_DOUBLE + NUM_SINGLE, 0, 0, 0)
