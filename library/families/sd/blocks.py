"""sd-scripts' UNet block numbering for block-wise adapter settings (``block_dims``, ``down/mid/up_lr_weight``).

SD1/SD2 UNets keep diffusers names in kohya keys and use 25 blocks (IN00-IN11, MID, OUT00-OUT11, sd-scripts'
``networks/lora.py``); SDXL's kohya keys use the original (sgm) names and 23 blocks (embeddings, input_blocks 0-8,
middle 0-2, output 0-8, out; ``networks/lora_sdxl.py`` ... as sd-scripts' ``sdxl_train_network.py`` counts them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..blocks import BlockLayout

_RE_DIFFUSERS = re.compile(r"lora_unet_(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")
_RE_SGM = re.compile(r"lora_unet_(input_blocks|middle_block|output_blocks)_(\d+)_")


@dataclass(frozen=True)
class UNetBlocks(BlockLayout):
    """The diffusers numbering (SD1/SD2) or, with ``edges``, the sgm one (SDXL)."""

    def names_match(self, name: str) -> bool:
        """Whether a kohya UNet module name is written in this numbering's naming (a numbered block of it)."""
        return bool((_RE_SGM if self.edges else _RE_DIFFUSERS).match(name))

    def index(self, name: str) -> int:
        """sd-scripts' ``get_block_index`` for a kohya UNet module name; -1 outside the numbered blocks."""
        if self.edges:
            m = _RE_SGM.match(name)
            if m:
                return {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}[m.group(1)] + int(m.group(2))
            if name.startswith(("lora_unet_time_embed_", "lora_unet_label_emb_")):
                return 0
            return self.num_blocks - 1 if name.startswith("lora_unet_out_") else -1
        m = _RE_DIFFUSERS.match(name)
        if m:
            side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
            return 1 + idx if side == "down" else 13 + idx
        return 12 if name.startswith("lora_unet_mid_block_") else -1


DIFFUSERS_BLOCKS = UNetBlocks("diffusers", 25, 12, 1, 12)
SGM_BLOCKS = UNetBlocks("sgm", 23, 9, 3, 9, edges=True)
