"""Qwen-Image: the dual-stream MMDiT over Qwen2.5-VL-7B, the Qwen-Image VAE (``family.py``), as musubi-tuner trains
it."""

from .family import QWEN_IMAGE, QwenImageFamily

FAMILIES = (QWEN_IMAGE,)
ORDER = 55  # after Lumina (40); HunyuanImage 2.1 may take 50

__all__ = ["FAMILIES", "ORDER", "QWEN_IMAGE", "QwenImageFamily"]
