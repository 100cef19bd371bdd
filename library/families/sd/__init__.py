"""Stable Diffusion 1.x, 2.x and SDXL (``SD1``, ``SD2``, ``SDXL``): UNets conditioned on CLIP / OpenCLIP text
encoders, trained with DDPM epsilon or v-prediction.

Modules: ``family`` (SD1 / SD2: one class, two objects), ``sdxl``, ``loading`` (diffusers folders and single files,
detection), ``saving``, ``convert`` (the single-file layout: UNet, OpenCLIP), ``unet_keys`` (diffusers <-> ldm / sgm
UNet names), ``text`` (sd-scripts' 75-token chunks), ``blocks`` (sd-scripts' block numberings), ``tiny`` (test
models).
"""

from .family import SD1, SD2, UNET_TARGET_CLASSES, SDFamily, guess_sd2_prediction
from .sdxl import SDXL, SDXLFamily

FAMILIES = (SD1, SD2, SDXL)  # registration order: SD1 is the default family
ORDER = 0

__all__ = ["SD1", "SD2", "SDXL", "SDFamily", "SDXLFamily", "UNET_TARGET_CLASSES", "guess_sd2_prediction"]
__all__ += ["FAMILIES", "ORDER"]
