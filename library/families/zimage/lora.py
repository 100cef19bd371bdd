"""``--network_module networks.lora_zimage``: musubi-tuner's Z-Image LoRA (``networks/lora_zimage.py`` over its
``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's: ``lora_unet_`` + the module's path in the DiT (``layers.0.attention.to_q``, diffusers'
names, which musubi-tuner's model shares) with dots as underscores. diffusers' ``ZImagePipeline.load_lora_weights``
reads them (``_convert_non_diffusers_z_image_lora_to_diffusers``); ComfyUI reads them by its kohya rule.

* **Targets.** Every Linear inside the ``ZImageTransformerBlock`` modules, minus musubi-tuner's built-in exclusion
  ``.*(_modulation|_refiner).*`` (``re.fullmatch`` on the module path): the 30 main blocks' attention ``to_q/k/v``,
  ``to_out.0`` and feed-forward ``w1/w2/w3``; the refiner blocks and the ``adaLN_modulation`` Linears stay out, as
  does everything outside the blocks; no text-encoder adapters (musubi-tuner trains none).
* ``exclude_patterns`` / ``include_patterns`` (Python list literals, ``re.fullmatch`` on the module path; include
  wins), ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the module path), LoRA+, ``rank_dropout``,
  ``module_dropout``, ``verbose``: the common keys.
"""

from __future__ import annotations

from ..musubi_lora import MusubiLoraRules

BLOCK_CLASSES = ("ZImageTransformerBlock",)
RULES = MusubiLoraRules("networks.lora_zimage", "Z-Image", BLOCK_CLASSES, r".*(_modulation|_refiner).*")
MODULE = RULES.MODULE
