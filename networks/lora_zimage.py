"""``--network_module networks.lora_zimage``: musubi-tuner's Z-Image LoRA, the name users type.

Its rules (the blocks' Linears, the built-in exclusion, ``exclude_patterns`` / ``include_patterns``,
``network_reg_dims`` / ``network_reg_lrs``) are the Z-Image family's (``library/families/zimage/lora.py``,
``ModelFamily.adapter_rules``); the adapters are built by ``networks.inject`` as for every module.
"""

from library.families.zimage.lora import *  # noqa: F403  (MODULE, RULES: musubi-tuner's shared LoRA rules)
