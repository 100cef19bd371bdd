"""``--network_module networks.lora_lumina``: sd-scripts' Lumina Image 2.0 LoRA, the name users type.

Its rules (which modules get an adapter at which rank: ``attn_dim mlp_dim mod_dim refiner_dim embedder_dims
train_blocks split_qkv``) are the Lumina family's (``library/families/lumina/lora.py``, ``ModelFamily.adapter_rules``);
the adapters are built by ``networks.inject`` as for every module.
"""

from library.families.lumina.lora import *  # noqa: F403  (MODULE, ARGS, Args, preset, rank_for, split_rows ...)
