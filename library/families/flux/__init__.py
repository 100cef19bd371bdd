"""FLUX.1 dev / schnell and Chroma (``FLUX_DEV``, ``FLUX_SCHNELL``, ``CHROMA``): see ``family.py``.

Modules: ``keys`` (BFL <-> diffusers names, fused modules), ``loading`` (BFL file + ``--clip_l --t5xxl --ae``,
diffusers folders), ``text`` (CLIP-L pooled + T5 with its shipped tokenizer and mask), ``latents`` (AE shift/scale,
2×2 packing), ``saving``, ``tiny`` (test models), ``blocks`` (double/single block numbering), ``configs``.
"""

import warnings

from .family import CHROMA, FLUX_DEV, FLUX_SCHNELL, FluxFamily

# diffusers' own ChromaTransformer2DModel builds the FluxPosEmbed it has deprecated: every Chroma load would print a
# FutureWarning about diffusers' code, not the user's (this one message only)
warnings.filterwarnings("ignore", message=r"`FluxPosEmbed` is deprecated", category=FutureWarning)

FAMILIES = (FLUX_DEV, FLUX_SCHNELL, CHROMA)  # registration order
ORDER = 10

__all__ = ["CHROMA", "FLUX_DEV", "FLUX_SCHNELL", "FluxFamily", "FAMILIES", "ORDER"]
