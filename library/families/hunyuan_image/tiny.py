"""Tiny HunyuanImage 2.1 models for tests and oracle checks: the released architecture at a few channels.

``TRANSFORMER``: diffusers ``HunyuanImageTransformer2DModel`` kwargs (2 heads of 8 = the (4, 4) RoPE axes, 2 double
and 2 single blocks, the released 2 refiner blocks; byT5's projection keeps diffusers' fixed 2048 hidden width, as
sd-scripts' ``ByT5Mapper(hidden_dim=2048, out_dim=2048)``). ``SDSCRIPTS_CONSTANTS``: the same sizes as the literals
of sd-scripts' ``HYImageDiffusionTransformer.__init__`` they replace (benchmarks/hunyuan_image_vs_sdscripts.py).
"""

from __future__ import annotations

import copy

TRANSFORMER = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=(1, 1),
    qk_norm="rms_norm",
    guidance_embeds=False,
    text_embed_dim=24,
    text_embed_2_dim=12,
    rope_theta=256.0,
    rope_axes_dim=(4, 4),
    use_meanflow=False,
)

# sd-scripts literal -> tiny value (each must occur once in HYImageDiffusionTransformer.__init__)
SDSCRIPTS_CONSTANTS = {
    "self.in_channels = 64": "self.in_channels = 4",
    "self.out_channels = 64": "self.out_channels = 4",
    "self.rope_dim_list = [64, 64]": "self.rope_dim_list = [4, 4]",
    "self.hidden_size = 3584": "self.hidden_size = 16",
    "self.heads_num = 28": "self.heads_num = 2",
    "mm_double_blocks_depth = 20": "mm_double_blocks_depth = 2",
    "mm_single_blocks_depth = 40": "mm_single_blocks_depth = 2",
    "text_states_dim = 3584": "text_states_dim = 24",
    "ByT5Mapper(in_dim=1472,": "ByT5Mapper(in_dim=12,",
}


def transformer_config() -> dict:
    return copy.deepcopy(TRANSFORMER)


VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    spatial_compression_ratio=4,
    sample_size=32,
    scaling_factor=0.75289,
    downsample_match_channel=True,
    upsample_match_channel=True,
)
SDSCRIPTS_VAE_CONSTANTS = {
    "block_out_channels = (128, 256, 512, 512, 1024, 1024)": "block_out_channels = (32, 64, 64)",
    "latent_channels = 64": "latent_channels = 4",
    "layers_per_block = 2": "layers_per_block = 1",
    "ffactor_spatial = 32": "ffactor_spatial = 4",
    "sample_size = 384": "sample_size = 32",
}


def vae_config() -> dict:
    return copy.deepcopy(VAE)
