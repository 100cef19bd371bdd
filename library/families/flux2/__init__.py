"""FLUX.2 (Black Forest Labs): dev and klein 4B / 9B (and their base models), as musubi-tuner trains them
(``family.py``)."""

from .family import FLUX2, Flux2Family

FAMILIES = (FLUX2,)
ORDER = 60  # after Qwen-Image (55)

__all__ = ["FAMILIES", "FLUX2", "ORDER", "Flux2Family"]
