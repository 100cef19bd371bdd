"""The 16-channel autoencoder of FLUX.1, which SD3 / SD3.5 use too (with their own scale and shift).

An ``AutoencoderKL`` without quant convs (BFL's ``ae.safetensors``). Latents are ``(z - shift) · scale``
(FLUX.1: 0.1159, 0.3611; SD3: 0.0609, 1.5305). Its single files hold BFL / LDM names (``encoder.down.0.block.0...``,
also under ``first_stage_model.`` / ``vae.``) or diffusers names; :func:`load` reads either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..convert import strip_prefix, vae_diffusers_rename_old, vae_from_ldm, vae_ldm_keys
from ..loading import instantiate_fitting, shipped_configs
from .kl import upcast_if_needed

# The tiny test AE (the families' tiny models): the tiny SD VAE's widths with 16 latent channels, one ResNet per level,
# FLUX.1's scale and shift and no quant convs.
TINY_AE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 16, 16, 16],
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=8,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def released_config() -> dict:
    """The released AE's config (as FLUX.1's shipped configs hold it), a fresh copy."""
    return shipped_configs("flux-dev")["vae"]


def factory(config: Mapping) -> Callable[[], nn.Module]:
    from diffusers import AutoencoderKL

    return lambda: AutoencoderKL.from_config(dict(config))


def encode(
    vae: nn.Module, pixels: Tensor, scale: float, shift: float, generator: torch.Generator | None = None
) -> Tensor:
    """(B, 3, H, W) pixels in [-1, 1] -> (B, 16, H/8, W/8): ``(latent_dist.sample(generator) - shift) · scale``, in
    the dtype of ``pixels``."""
    upcast_if_needed(vae)
    weight = next(vae.parameters())
    dist = vae.encode(pixels.to(device=weight.device, dtype=weight.dtype)).latent_dist
    return ((dist.sample(generator=generator) - shift) * scale).to(pixels.dtype)


def decode(vae: nn.Module, latents: Tensor, scale: float, shift: float) -> Tensor:
    """(B, 16, h, w) latents -> (B, 3, 8h, 8w) pixels clamped to [-1, 1]: ``decode(z / scale + shift)``."""
    upcast_if_needed(vae)
    weight = next(vae.parameters())
    pixels = vae.decode(latents.to(device=weight.device, dtype=weight.dtype) / scale + shift).sample
    return pixels.clamp(-1, 1).to(latents.dtype)


def load(
    path: Path,
    state: Mapping[str, Any],
    candidates: list[tuple[dict, str]],
    dtype: Any,
    device: Any,
    *,
    where: str,
    what: str,
    this: str,
    kind: str = "AE",
    ldm: str = "BFL/LDM",
) -> nn.Module:
    """The AE of ``state`` (the weights of ``path``: a whole file, or a lazy view of the part inside a model file),
    built from the first of ``candidates`` (``(config, where it comes from)``) that fits (``loading.instantiate_fitting``).

    Messages name it as ``where`` (the flag, or "model file") ``path``; ``what``: the part ("AE (--ae)"); ``this``: the
    family's AE ("FLUX's AE"); ``kind``: "AE" or "VAE"; ``ldm``: what the original names are called ("BFL/LDM").
    Raises ``ValueError`` for an SD / SDXL VAE (quant convs) or weights of no AE."""
    ldm_state = vae_ldm_keys(dict(state.items()))
    if ldm_state:
        if any(k.startswith(("quant_conv.", "post_quant_conv.")) for k in ldm_state):
            raise ValueError(f"{where} {path}: this VAE has quant convs (an SD/SDXL VAE?); {this} has none")

        def adapt(source, model):
            return vae_from_ldm(source, model.config, model.state_dict().keys())

        return instantiate_fitting(candidates, factory, ldm_state, what, path, dtype, device, adapt)
    named = vae_diffusers_rename_old(strip_prefix(state, "vae.") or dict(state.items()))
    if not any(k.startswith("encoder.down_blocks.") for k in named):
        raise ValueError(f"{where} {path}: no {kind} weights found; expected {ldm} keys (encoder.down.0.block.0...) or "
                         "diffusers keys (encoder.down_blocks.*)")  # fmt: skip
    return instantiate_fitting(candidates, factory, named, what, path, dtype, device)


def candidates(
    stored: Mapping | None, released: dict, tiny: Mapping | None, kind: str = "AE"
) -> list[tuple[dict, str]]:
    """The configs :func:`load` tries: those stored in the file (``sdtrain.configs``), else the released one, then the
    family's tiny one (``tiny``, None: none)."""
    if stored and stored.get("vae"):
        return [(stored["vae"], "the configs stored in the file")]
    found = [(released, f"the released {kind} config")]
    return found + ([(dict(tiny), f"the tiny {kind} config")] if tiny is not None else [])
