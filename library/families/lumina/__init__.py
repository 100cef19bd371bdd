"""Lumina Image 2.0 (``LUMINA2``): see ``family.py``.

Modules: ``keys`` (Alpha-VLLM <-> diffusers names, the fused ``attention.qkv``), ``model`` (configs, Gemma-2 and its
tokenizer, the prompt rule), ``loading`` (Alpha-VLLM file + ``--gemma2 --ae``, diffusers folders), ``objective``
(sd-scripts' Lumina rectified flow and its flags), ``options`` (the family's flags), ``lora`` (sd-scripts'
``networks.lora_lumina`` rules), ``tiny`` (test models).
"""

from .family import LUMINA2, LuminaFamily

FAMILIES = (LUMINA2,)
ORDER = 40  # after Anima (30)

__all__ = ["LUMINA2", "LuminaFamily", "FAMILIES", "ORDER"]
