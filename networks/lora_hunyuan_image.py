"""``--network_module networks.lora_hunyuan_image``: sd-scripts' HunyuanImage 2.1 LoRA, the name users type.

Its rules (which modules get an adapter at which rank: ``network_reg_dims network_reg_lrs split_qkv``) are the
HunyuanImage family's (``library/families/hunyuan_image/lora.py``, ``ModelFamily.adapter_rules``); the adapters are
built by ``networks.inject`` as for every module.
"""

from library.families.hunyuan_image.lora import *  # noqa: F403  (MODULE, ARGS, Args, preset, rank_for, split_rows ...)
