"""FLUX.1 dev / schnell and Chroma (``FLUX_DEV``, ``FLUX_SCHNELL``, ``CHROMA``): see ``family.py``.

Modules: ``keys`` (BFL <-> diffusers names, fused modules), ``loading`` (BFL file + ``--clip_l --t5xxl --ae``,
diffusers folders), ``text`` (CLIP-L pooled + T5 with its shipped tokenizer and mask), ``latents`` (AE shift/scale,
2×2 packing), ``saving``, ``tiny`` (test models), ``blocks`` (double/single block numbering), ``configs``.
"""

from .family import CHROMA, FLUX_DEV, FLUX_SCHNELL, FluxFamily

__all__ = ["CHROMA", "FLUX_DEV", "FLUX_SCHNELL", "FluxFamily"]
