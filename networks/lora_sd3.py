"""``--network_module networks.lora_sd3``: sd-scripts' SD3 / SD3.5 LoRA, the name users type.

Its rules (which modules get an adapter at which rank, ``emb_dims``, ``train_block_indices``, ``split_qkv``,
``train_t5xxl``) are the SD3 family's (``library/families/sd3/lora.py``, ``ModelFamily.adapter_rules``); the adapters
are built by ``networks.inject`` as for every module.
"""

from library.families.sd3.lora import *  # noqa: F403  (MODULE, ARGS, Args, preset, rank_for, split_rows ...)
