"""HunyuanImage 2.1 (``HUNYUAN_IMAGE``): see ``family.py``.

Modules: ``keys`` (Tencent <-> diffusers names of the DiT and the VAE, the fused modules), ``model`` (configs, the
Qwen2.5-VL and byT5 Glyph prompts), ``loading`` (Tencent's DiT + ``--text_encoder --byt5 --vae``), ``objective``
(sd-scripts' HunyuanImage rectified flow and its flags), ``options`` (the family's flags), ``lora`` (sd-scripts'
``networks.lora_hunyuan_image`` rules), ``tiny`` (test models).
"""

from .family import HUNYUAN_IMAGE, HunyuanImageFamily

FAMILIES = (HUNYUAN_IMAGE,)
ORDER = 50  # after Lumina 2 (40)

__all__ = ["HUNYUAN_IMAGE", "HunyuanImageFamily", "FAMILIES", "ORDER"]
