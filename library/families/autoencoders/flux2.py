"""FLUX.2's autoencoder: diffusers' ``AutoencoderKLFlux2`` (32 latent channels, quant convs) with its latent
normalisation: the mean of the posterior in 2 x 2 patches (128 channels at 1/16 of the image) normalised by the AE's
own BatchNorm statistics (``bn.running_mean`` / ``running_var``, ε 1e-4): musubi-tuner's ``AutoEncoder.encode`` /
``decode`` and diffusers' ``Flux2Pipeline`` (``_patchify_latents`` + the ``bn`` statistics).

Files: BFL's ``ae.safetensors`` (LDM names ``encoder.down.0.block.0...``, ``encoder.quant_conv``,
``decoder.post_quant_conv``, ``bn.*``) or diffusers' names (``vae/`` of a diffusers folder).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..convert import vae_from_ldm
from ..loading import instantiate_fitting, read_weights

RELEASED = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                latent_channels=32, norm_num_groups=32, use_quant_conv=True, use_post_quant_conv=True,
                batch_norm_eps=1e-4, batch_norm_momentum=0.1, patch_size=[2, 2])  # fmt: skip
TINY = dict(RELEASED, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4)
_BFL_MOVES = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}


def factory(config: Mapping) -> Callable[[], nn.Module]:
    from diffusers import AutoencoderKLFlux2

    return lambda: AutoencoderKLFlux2.from_config(dict(config))


def _stats(vae: nn.Module, like: Tensor) -> tuple[Tensor, Tensor]:
    bn = vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, torch.float32)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(like.device, torch.float32) + float(bn.eps))
    return mean, std


def patchify(z: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2), channels then the 2 x 2 patch (``c (i pi) (j pj) -> (c pi pj) i j``)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(z: Tensor) -> Tensor:
    b, c4, h, w = z.shape
    return z.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


def encode(vae: nn.Module, pixels: Tensor) -> Tensor:
    """(B, 3, H, W) pixels in [-1, 1] -> (B, 128, H/16, W/16) normalised latents (module docstring), in the dtype of
    ``pixels``."""
    weight = next(vae.parameters())
    mean = vae.encode(pixels.to(weight.device, weight.dtype)).latent_dist.mean
    z = patchify(mean.float())
    m, s = _stats(vae, z)
    return ((z - m) / s).to(pixels.dtype)


def decode(vae: nn.Module, latents: Tensor) -> Tensor:
    """:func:`encode`'s latents -> (B, 3, 16h, 16w) pixels clamped to [-1, 1]."""
    weight = next(vae.parameters())
    m, s = _stats(vae, latents)
    z = unpatchify(latents.float() * s + m)
    return vae.decode(z.to(weight.device, weight.dtype)).sample.clamp(-1, 1).to(latents.dtype)


def to_bfl(state: Mapping[str, Tensor], num_up: int) -> dict[str, Tensor]:
    """A diffusers ``AutoencoderKLFlux2`` state dict in BFL's ``ae.safetensors`` names."""
    from ..convert import _is_vae_attn_weight, vae_key_to_ldm

    out = {}
    for key, value in state.items():
        name = vae_key_to_ldm(key, num_up)
        for old, new in _BFL_MOVES.items():
            if name.startswith(new):
                name = old + name[len(new) :]
        out[name] = value[..., None, None] if _is_vae_attn_weight(name) and value.ndim == 2 else value
    return out


def load(path: Path, dtype: Any, device: Any, *, where: str = "--vae") -> nn.Module:
    """The AE of ``path`` (a file in BFL or diffusers names, or a folder with them / its ``vae/``): the released
    config, else the tiny one."""
    if path.is_dir():
        folder = path / "vae" if (path / "vae").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{where} {path}: no .safetensors in {folder}")
        path = files[0]
    source, _ = read_weights(path)
    keys = list(source.keys())
    candidates = [(RELEASED, "FLUX.2's AE config"), (TINY, "the tiny AE config")]
    if any(k.startswith("encoder.down.") for k in keys):
        ldm = {}
        for k in keys:
            name = k
            for old, new in _BFL_MOVES.items():
                if k.startswith(old):
                    name = new + k[len(old) :]
            ldm[name] = k

        def adapt(state, model):
            view = {n: state[k] for n, k in ldm.items()}
            return vae_from_ldm(view, model.config, model.state_dict().keys())

        return instantiate_fitting(candidates, factory, source, "FLUX.2 AE", path, dtype, device, adapt)
    if not any(k.startswith("encoder.down_blocks.") for k in keys) or "bn.running_mean" not in keys:
        raise ValueError(f"{where} {path}: no FLUX.2 AE weights (expected BFL keys encoder.down.0.block.0... or "
                         "diffusers keys encoder.down_blocks.*, and bn.running_mean: FLUX.2's AE, not FLUX.1's)")  # fmt: skip
    return instantiate_fitting(candidates, factory, source, "FLUX.2 AE", path, dtype, device)
