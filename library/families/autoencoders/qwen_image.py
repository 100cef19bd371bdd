"""The Qwen-Image VAE (Wan 2.1's causal 3D VAE, 16 latent channels, 8x down): Anima's autoencoder, and Qwen-Image's
when that family comes (diffusers' ``AutoencoderKLQwenImage``).

Latents are the posterior's mode, normalised per channel: ``(z - mean) / std`` with the config's ``latents_mean`` /
``latents_std`` (sd-scripts' ``encode_pixels_to_latents`` / ``decode_to_pixels``); images are single frames (the
temporal axis of length 1 added and removed here).

Files: diffusers' names (sd-scripts' own ``AutoencoderKLQwenImage`` has the same), or ComfyUI's / the original Wan
names (``encoder.downsamples.N.residual.0``, ``conv1``...), converted by :func:`comfy_to_diffusers`: a rule over the
structure (levels, ResNets per level), the general form of sd-scripts' fixed table in ``convert_comfyui_state_dict``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]  # fmt: skip
LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
               1.6382, 1.1253, 2.8251, 1.916]  # fmt: skip

# sd-scripts' load_vae config (Qwen-Image's released VAE)
RELEASED = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0, latents_mean=LATENTS_MEAN,
                latents_std=LATENTS_STD)  # fmt: skip
# The tiny test VAE: the released structure (4 levels, 2 ResNets, 8x down) at base width 8
TINY = dict(RELEASED, base_dim=8)

_RESIDUAL = {"0": "norm1", "2": "conv1", "3": "norm2", "6": "conv2"}


def factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    from diffusers import AutoencoderKLQwenImage

    return lambda: AutoencoderKLQwenImage(**dict(config))


def is_comfy(keys: Any) -> bool:
    """ComfyUI / Wan names (``conv1.bias`` at the top, ``encoder.downsamples.*``)."""
    keys = set(keys)
    return "conv1.bias" in keys or any(k.startswith("encoder.downsamples.") for k in keys)


def _block(rest: str) -> str:
    """``residual.K.x`` / ``shortcut.x`` / ``resample.1.x`` / ``time_conv.x`` inside one ResNet or resampler."""
    m = re.fullmatch(r"residual\.(\d+)\.(.+)", rest)
    if m:
        return f"{_RESIDUAL[m.group(1)]}.{m.group(2)}"
    if rest.startswith("shortcut."):
        return "conv_shortcut." + rest[len("shortcut.") :]
    return rest


def comfy_name(key: str, num_res_blocks: int) -> str:
    """One ComfyUI / Wan VAE key -> diffusers' ``AutoencoderKLQwenImage`` key."""
    for old, new in (("conv1.", "quant_conv."), ("conv2.", "post_quant_conv.")):
        if key.startswith(old):
            return new + key[len(old) :]
    side, _, rest = key.partition(".")
    if rest.startswith("conv1."):
        return f"{side}.conv_in.{rest[len('conv1.') :]}"
    m = re.fullmatch(r"head\.(0|2)\.(.+)", rest)
    if m:
        return f"{side}.{'norm_out' if m.group(1) == '0' else 'conv_out'}.{m.group(2)}"
    m = re.fullmatch(r"middle\.(\d)\.(.+)", rest)
    if m:
        index, inner = int(m.group(1)), m.group(2)
        if index == 1:
            return f"{side}.mid_block.attentions.0.{inner}"
        return f"{side}.mid_block.resnets.{index // 2}.{_block(inner)}"
    m = re.fullmatch(r"downsamples\.(\d+)\.(.+)", rest)
    if m:
        return f"{side}.down_blocks.{m.group(1)}.{_block(m.group(2))}"
    m = re.fullmatch(r"upsamples\.(\d+)\.(.+)", rest)
    if m:
        per_level = num_res_blocks + 2  # num_res_blocks + 1 ResNets, then the upsampler (none after the last level)
        level, within = divmod(int(m.group(1)), per_level)
        if within <= num_res_blocks:
            return f"{side}.up_blocks.{level}.resnets.{within}.{_block(m.group(2))}"
        return f"{side}.up_blocks.{level}.upsamplers.0.{m.group(2)}"
    return key


def comfy_to_diffusers(keys: list[str], num_res_blocks: int) -> dict[str, str]:
    """diffusers key -> file key for a ComfyUI / Wan VAE file (identity for diffusers-named files)."""
    if not is_comfy(keys):
        return {k: k for k in keys}
    return {comfy_name(k, num_res_blocks): k for k in keys}


def _stats(vae: nn.Module, like: Tensor) -> tuple[Tensor, Tensor]:
    c = vae.config
    mean = torch.tensor(c.latents_mean, dtype=like.dtype, device=like.device).view(1, c.z_dim, 1, 1, 1)
    std = torch.tensor(c.latents_std, dtype=like.dtype, device=like.device).view(1, c.z_dim, 1, 1, 1)
    return mean, std


def encode(vae: nn.Module, pixels: Tensor) -> Tensor:
    """(B, 3, H, W) pixels in [-1, 1] -> (B, 16, H/8, W/8) normalised latents (the posterior's mode), in the
    dtype of ``pixels``."""
    weight = next(vae.parameters())
    x = pixels.to(device=weight.device, dtype=weight.dtype).unsqueeze(2)
    z = vae.encode(x).latent_dist.mode()
    mean, std = _stats(vae, z)
    return ((z - mean) / std).squeeze(2).to(pixels.dtype)


def decode(vae: nn.Module, latents: Tensor) -> Tensor:
    """(B, 16, h, w) normalised latents -> (B, 3, 8h, 8w) pixels clamped to [-1, 1]."""
    weight = next(vae.parameters())
    z = latents.to(device=weight.device, dtype=weight.dtype).unsqueeze(2)
    mean, std = _stats(vae, z)
    image = vae.decode(z * std + mean).sample
    return image.squeeze(2).clamp(-1.0, 1.0).to(latents.dtype)


_RESIDUAL_BACK = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                  "conv_shortcut": "shortcut"}  # fmt: skip


def _block_back(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESIDUAL_BACK[head]}.{tail}" if head in _RESIDUAL_BACK else rest


def diffusers_to_comfy_name(key: str, num_res_blocks: int) -> str:
    """:func:`comfy_name`'s inverse: a diffusers ``AutoencoderKLQwenImage`` key -> ComfyUI's / Wan's name."""
    for old, new in (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")):
        if key.startswith(old):
            return new + key[len(old) :]
    side, _, rest = key.partition(".")
    for old, new in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(old):
            return f"{side}.{new}{rest[len(old) :]}"
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", rest)
    if m:
        return f"{side}.middle.1.{m.group(1)}"
    m = re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", rest)
    if m:
        return f"{side}.middle.{2 * int(m.group(1))}.{_block_back(m.group(2))}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest)
    if m:
        return f"{side}.downsamples.{m.group(1)}.{_block_back(m.group(2))}"
    per_level = num_res_blocks + 2
    m = re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)
    if m:
        return f"{side}.upsamples.{int(m.group(1)) * per_level + int(m.group(2))}.{_block_back(m.group(3))}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest)
    if m:
        return f"{side}.upsamples.{int(m.group(1)) * per_level + num_res_blocks + 1}.{m.group(2)}"
    return key
