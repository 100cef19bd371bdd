"""``--network_module networks.lora_flux``: sd-scripts' FLUX.1 / Chroma LoRA, the name users type.

Its rules (which modules get an adapter at which rank, ``train_blocks``, ``in_dims``, ``network_reg_dims`` /
``network_reg_lrs``, ``split_qkv``, ``train_t5xxl``) are the FLUX family's (``library/families/flux/lora.py``,
``ModelFamily.adapter_rules``); the adapters are built by ``networks.inject`` as for every module.
"""

from library.families.flux.lora import *  # noqa: F403  (MODULE, ARGS, Args, preset, rank_for, split_rows ...)
