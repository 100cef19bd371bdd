"""FLUX latents: the 16-channel AE's ``(z - shift) · scale`` (``encode`` / ``decode``: the shared AE's,
``autoencoders/flux_ae.py``), and the 2×2 packing the transformer reads.

Packing, as ``FluxPipeline._pack_latents`` / ``_prepare_latent_image_ids`` and sd-scripts' ``flux_utils.pack_latents``
/ ``prepare_img_ids``: (B, C, h, w) -> (B, h/2 · w/2, 4C), token (i, j) = the 2×2 patch at rows 2i..2i+1, columns
2j..2j+1, channel-major (c, dy, dx); its position id is (0, i, j). Text position ids are all zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..autoencoders.flux_ae import decode, encode  # noqa: F401  (FLUX's latents are the shared AE's)


def pack(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C); h and w must be even."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(
            f"FLUX latents need even sides (2×2 patches); got {h}×{w} (image sides must be multiples of 16)"
        )
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w): the inverse of :func:`pack`."""
    b, n, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """(h/2 · w/2, 3) position ids of the packed tokens of (h, w) latents: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
    return ids.reshape(-1, 3)
