"""Stable Cascade stage C (``STABLE_CASCADE``): see ``family.py``.

Modules: ``model`` (the released prior configs, Stability <-> diffusers names), ``effnet`` (the EfficientNetV2-S
latent encoder in plain torch), ``objective`` (the continuous cosine DDPM with P2 weighting), ``loading``,
``options`` (the family's flags), ``full_training`` (the text model written beside stage C), ``tiny`` (test models).
"""

from .family import STABLE_CASCADE, StableCascadeFamily

FAMILIES = (STABLE_CASCADE,)
ORDER = 75  # after PixArt (70)

__all__ = ["STABLE_CASCADE", "StableCascadeFamily", "FAMILIES", "ORDER"]
