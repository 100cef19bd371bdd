"""``--network_module networks.lora_flux_2``: musubi-tuner's FLUX.2 LoRA, the name users type.

Its rules (the blocks' Linears under BFL names, the fused qkv, the default exclusions, ``exclude_patterns`` /
``include_patterns``, ``network_reg_dims`` / ``network_reg_lrs``) are the FLUX.2 family's
(``library/families/flux2/lora.py``, ``ModelFamily.adapter_rules``); the adapters are built by ``networks.inject``.
"""

from library.families.flux2.lora import *  # noqa: F403  (MODULE, RULES: musubi-tuner's shared LoRA rules)
