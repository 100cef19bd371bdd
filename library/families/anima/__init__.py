"""Anima: Cosmos-Predict2's DiT with an LLM adapter over Qwen3-0.6B, the Qwen-Image VAE (``family.py``)."""

from .family import ANIMA, AnimaFamily

FAMILIES = (ANIMA,)
ORDER = 30  # after the SD3 folder (20)

__all__ = ["ANIMA", "AnimaFamily", "FAMILIES", "ORDER"]
