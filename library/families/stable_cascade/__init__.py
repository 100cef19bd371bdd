"""Stable Cascade stage C (``STABLE_CASCADE``): see ``family.py``.

Modules: ``model`` (the released prior configs, Stability <-> diffusers names), ``effnet`` (the EfficientNetV2-S
latent encoder in plain torch), ``objective`` (the continuous cosine DDPM with P2 weighting), ``loading``,
``options`` (the family's flags), ``full_training`` (the text model written beside stage C), ``tiny`` (test models);
``wuerstchen``: Würstchen 2 (``WUERSTCHEN``), the predecessor, as a second family on the same encoder and schedule;
``wuerstchen_decoder``: its images (samples during training, gen_img) through the user's diffusers decoder folder.
"""

from .family import STABLE_CASCADE, StableCascadeFamily
from .wuerstchen import WUERSTCHEN

FAMILIES = (STABLE_CASCADE, WUERSTCHEN)
ORDER = 75  # after PixArt (70)

__all__ = ["STABLE_CASCADE", "StableCascadeFamily", "WUERSTCHEN", "FAMILIES", "ORDER"]
