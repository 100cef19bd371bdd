"""Z-Image (Turbo and Base): the single-stream DiT over Qwen3-4B with FLUX.1's AE (``family.py``), as musubi-tuner
trains it."""

from .family import ZIMAGE, ZImageFamily

FAMILIES = (ZIMAGE,)
ORDER = 60  # after Qwen-Image (55)

__all__ = ["FAMILIES", "ORDER", "ZIMAGE", "ZImageFamily"]
