"""``--network_module networks.lora_anima``: sd-scripts' Anima LoRA, the name users type.

Its rules (targets and the built-in exclusion, ``train_llm_adapter``, ``exclude_patterns`` / ``include_patterns``,
``network_reg_dims`` / ``network_reg_lrs``) are the Anima family's (``library/families/anima/lora.py``,
``ModelFamily.adapter_rules``); the adapters are built by ``networks.inject`` as for every module.
"""

from library.families.anima.lora import *  # noqa: F403  (MODULE, ARGS, Args, preset, select, rank_for ...)
