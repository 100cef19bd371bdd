"""SD3's block numbering for adapter names: the joint blocks 0..N-1 (24 in SD3-medium and SD3.5-medium, 38 in
SD3.5-large).

sd-scripts' ``networks/lora_sd3.py`` selects blocks by ``train_block_indices`` and has no ``block_dims`` /
``down/mid/up_lr_weight``, so this layout has no down/mid/up values; it tells SD3 adapter names apart from SD/SDXL
and FLUX ones (``lora_unet_joint_blocks_``, which no other family's files have) and numbers them. One layout serves
the three variants (38 blocks: the deepest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..blocks import BlockLayout

_RE_SD3 = re.compile(r"lora_unet_joint_blocks_(\d+)_")
MAX_BLOCKS = 38


@dataclass(frozen=True)
class SD3Blocks(BlockLayout):
    """Index = joint block number; -1 outside the blocks (embedders, final layer)."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_SD3.match(name))

    def index(self, name: str) -> int:
        m = _RE_SD3.match(name)
        return int(m.group(1)) if m else -1


SD3_BLOCKS = SD3Blocks("sd3", MAX_BLOCKS, 0, 0, 0)
