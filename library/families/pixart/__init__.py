"""PixArt-α and PixArt-Σ (``PIXART_ALPHA``, ``PIXART_SIGMA``): see ``family.py``.

Modules: ``keys`` (official <-> diffusers names, the fused ``attn.qkv`` / ``cross_attn.kv_linear``), ``model`` (configs,
micro-conditions, the ε half), ``loading`` (official file + ``--t5xxl --vae``, diffusers folders), ``options`` (the
family's flags), ``tiny`` (test models).
"""

from .family import PIXART_ALPHA, PIXART_SIGMA, PixArtFamily

FAMILIES = (PIXART_ALPHA, PIXART_SIGMA)
ORDER = 70  # after FLUX.2 and Z-Image (60)

__all__ = ["PIXART_ALPHA", "PIXART_SIGMA", "PixArtFamily", "FAMILIES", "ORDER"]
