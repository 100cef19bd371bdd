"""``--network_module networks.lora_qwen_image``: musubi-tuner's Qwen-Image LoRA (``networks/lora_qwen_image.py`` over
its ``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's (ComfyUI reads them as they are): ``lora_unet_`` + the module's path in the DiT
(``transformer_blocks.0.attn.to_q``, diffusers' names, which musubi-tuner's model shares) with dots as underscores.

* **Targets.** Every Linear inside the ``QwenImageTransformerBlock`` modules (the 60 blocks: attention projections
  ``to_q/k/v``, ``add_q/k/v_proj``, ``to_out.0``, ``to_add_out``, the MLPs and the modulations ``img_mod.1`` /
  ``txt_mod.1``); nothing outside the blocks, no text-encoder adapters (musubi-tuner trains none).
* **Exclusion.** musubi-tuner's built-in ``.*(_mod_).*`` and ``exclude_patterns`` (a Python list literal), unless
  ``include_patterns`` names them, ``re.fullmatch`` on the module path (``transformer_blocks.0.img_mod.1``). As in
  musubi-tuner, the built-in pattern matches no module of the released DiT (its modulations are ``img_mod.1``), so the
  modulations are trained; ``exclude_patterns=[".*_mod.*"]`` leaves them out.
* Ranks: ``--network_dim`` / ``--network_alpha``; ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the module
  path), LoRA+, ``rank_dropout``, ``module_dropout``, ``verbose``: the common keys.
"""

from __future__ import annotations

from ..musubi_lora import MusubiLoraRules

BLOCK_CLASSES = ("QwenImageTransformerBlock",)
RULES = MusubiLoraRules("networks.lora_qwen_image", "Qwen-Image", BLOCK_CLASSES, r".*(_mod_).*")
MODULE = RULES.MODULE
