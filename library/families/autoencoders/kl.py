"""Pixels <-> scaled latents with a diffusers ``AutoencoderKL``, shared by the families (the SD VAEs; FLUX's AE in
``flux_ae.py`` adds a shift)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


def encode_latents(vae: nn.Module, pixels: Tensor, scale: float, generator: torch.Generator | None = None) -> Tensor:
    """(B, 3, H, W) pixels in [-1, 1] -> (B, 4, H/8, W/8) latents: ``latent_dist.sample(generator) * scale``.

    A float16 VAE whose config sets ``force_upcast`` (SDXL's VAE overflows to NaN in fp16) is moved to float32 once,
    in place, as diffusers' pipelines do; the latents come back in the dtype of ``pixels``.
    """
    upcast_if_needed(vae)
    dtype = next(vae.parameters()).dtype
    dist = vae.encode(pixels.to(device=next(vae.parameters()).device, dtype=dtype)).latent_dist
    return (dist.sample(generator=generator) * scale).to(pixels.dtype)


def decode_latents(vae: nn.Module, latents: Tensor, scale: float) -> Tensor:
    """(B, 4, h, w) scaled latents -> (B, 3, 8h, 8w) pixels, clamped to [-1, 1], in the dtype of ``latents``."""
    upcast_if_needed(vae)
    dtype = next(vae.parameters()).dtype
    pixels = vae.decode(latents.to(device=next(vae.parameters()).device, dtype=dtype) / scale).sample
    return pixels.clamp(-1, 1).to(latents.dtype)


def upcast_if_needed(vae: nn.Module) -> None:
    """A float16 VAE whose config sets ``force_upcast`` moves to float32, in place (as diffusers' pipelines do)."""
    if next(vae.parameters()).dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
        log.info("the VAE overflows in float16 (force_upcast); running it in float32")
        vae.to(torch.float32)
