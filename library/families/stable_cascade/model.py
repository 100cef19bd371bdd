"""Stable Cascade stage C: the released prior configs (3.6B and lite 1B), Stability's key names <-> diffusers', the
CLIP-bigG config and the GDF noise schedule's constants.

Stage C (diffusers ``StableCascadeUNet``; Stability's ``StageC``) denoises 16-channel EfficientNet latents (1/32 of the
image) conditioned on CLIP-bigG's last hidden states (B, 77, 1280), its projected pooled output (B, 1, 1280) and a
CLIP image embedding (B, 1, 768; zeros when training on text, as the reference trainers). Stability's files keep
PyTorch's ``nn.MultiheadAttention`` names in every attention block (``attention.attn.in_proj_weight`` q | k | v
stacked, ``attention.attn.out_proj``); diffusers splits them (``attention.to_q | to_k | to_v``, ``attention.to_out.0``)
and keeps every other name (``convert_stable_cascade_unet_single_file_to_diffusers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

BLOCKS = ["SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"]
PRIOR_COMMON = dict(
    in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1, down_blocks_repeat_mappers=[1, 1],
    up_blocks_repeat_mappers=[1, 1], block_types_per_layer=[BLOCKS, BLOCKS], clip_text_in_channels=1280,
    clip_text_pooled_in_channels=1280, clip_image_in_channels=768, clip_seq=4, kernel_size=3, dropout=[0.1, 0.1],
    self_attn=True, timestep_conditioning_type=["sca", "crp"], switch_level=[False], effnet_in_channels=None,
    pixel_mapper_in_channels=None,
)  # fmt: skip
PRIOR = dict(PRIOR_COMMON, conditioning_dim=2048, block_out_channels=[2048, 2048], num_attention_heads=[32, 32],
             down_num_layers_per_block=[8, 24], up_num_layers_per_block=[24, 8])  # fmt: skip
PRIOR_LITE = dict(PRIOR_COMMON, conditioning_dim=1536, block_out_channels=[1536, 1536], num_attention_heads=[24, 24],
                  down_num_layers_per_block=[4, 12], up_num_layers_per_block=[12, 4])  # fmt: skip
RELEASED = {2048: PRIOR, 1536: PRIOR_LITE}  # width of clip_txt_mapper -> config (diffusers' single-file rule)
CLIP_BIG_G = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=1280, pad_token_id=1,
    bos_token_id=49406, eos_token_id=49407,
)  # fmt: skip
CLIP_IMAGE_WIDTH = 768
LATENT_CHANNELS = 16
MARKER = "clip_txt_mapper.weight"  # a stage C prior (diffusers' and ComfyUI's detection key)
SCHEDULER = dict(scaler=1.0, s=0.008)  # DDPMWuerstchenScheduler's config


def prior_factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    from diffusers import StableCascadeUNet

    return lambda: StableCascadeUNet(**dict(config))


def is_prior(keys: Any) -> bool:
    return MARKER in set(keys)


def stability_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Stability's names (``nn.MultiheadAttention``'s stacked ``in_proj``) -> diffusers' (module docstring)."""
    out: dict[str, Tensor] = {}
    for key in state.keys():
        value = state[key]
        if ".attention.attn.in_proj_" in key:
            kind = key.rsplit("in_proj_", 1)[1]  # weight / bias
            stem = key.split(".attn.in_proj_")[0]
            for name, chunk in zip(("to_q", "to_k", "to_v"), torch.chunk(value, 3, dim=0)):
                out[f"{stem}.{name}.{kind}"] = chunk
        elif ".attention.attn.out_proj." in key:
            out[key.replace(".attn.out_proj.", ".to_out.0.")] = value
        else:
            out[key] = value
    return out


def diffusers_to_stability(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`stability_to_diffusers` (the layout Stability and the sd-scripts branch write)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if ".attention.to_q." in key:
            stem, kind = key.split(".to_q.")
            parts = [state[f"{stem}.to_{n}.{kind}"] for n in "qkv"]
            out[f"{stem}.attn.in_proj_{kind}"] = torch.cat(parts, dim=0)
        elif ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        elif ".attention.to_out.0." in key:
            out[key.replace(".to_out.0.", ".attn.out_proj.")] = value
        else:
            out[key] = value
    return out


def module_to_stability(path: str) -> str:
    """A diffusers module path -> the module path in Stability's / ComfyUI's model (``attention.to_q`` ->
    ``attention.attn.to_q``: ComfyUI splits ``in_proj`` into ``attn.to_q | to_k | to_v`` when it loads, and keeps
    ``attn.out_proj``)."""
    for name in ("to_q", "to_k", "to_v"):
        path = path.replace(f".attention.{name}", f".attention.attn.{name}")
    return path.replace(".attention.to_out.0", ".attention.attn.out_proj")


def config_from_weights(state: Mapping[str, Any], shape: Callable[[str], tuple[int, ...]],
                        fallback: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """The released config whose width the weights have (2048: 3.6B, 1536: lite), else ``fallback`` (a tiny or
    stored config), checked against the weights' depth."""
    width = shape(MARKER)[0]
    config = dict(RELEASED[width]) if width in RELEASED else (dict(fallback) if fallback else None)
    if config is None or config["conditioning_dim"] != width:
        raise ValueError(f"a stage C prior of width {width}: not the 3.6B (2048) or lite (1536) release, and no "
                         "config stored in the file (sdtrain.configs) describes it")  # fmt: skip
    for level, count in enumerate(config["down_num_layers_per_block"]):
        found = {k.split(".")[2] for k in state.keys() if k.startswith(f"down_blocks.{level}.")}
        blocks = len(found)
        if blocks != count * len(config["block_types_per_layer"][level]):
            raise ValueError(f"stage C weights: down level {level} holds {blocks} blocks, the {width}-wide config "
                             f"{count * len(config['block_types_per_layer'][level])}")  # fmt: skip
    return config
