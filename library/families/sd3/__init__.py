"""SD3 medium, SD3.5 medium and SD3.5 large (``SD3_MEDIUM``, ``SD35_MEDIUM``, ``SD35_LARGE``): see ``family.py``.

Modules: ``keys`` (SAI <-> diffusers names, fused modules), ``configs`` (the released models' configs), ``loading``
(SAI file with or without its encoders + ``--clip_l --clip_g --t5xxl --vae``, diffusers folders), ``text``
(CLIP-L ‖ CLIP-G ‖ T5 conditioning, per-encoder dropout), ``pos_embed`` (sd-scripts' random-crop and scaled
positional embeddings), ``saving``, ``tiny`` (test models), ``blocks`` (joint block numbering).
"""

from .family import SD3_MEDIUM, SD35_LARGE, SD35_MEDIUM, SD3Family

FAMILIES = (SD3_MEDIUM, SD35_MEDIUM, SD35_LARGE)  # registration order
ORDER = 20

__all__ = ["SD3_MEDIUM", "SD35_MEDIUM", "SD35_LARGE", "SD3Family", "FAMILIES", "ORDER"]
