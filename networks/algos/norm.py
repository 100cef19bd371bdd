"""Norm-layer adapters (LyCORIS ``train_norm``): a learned additive change of a GroupNorm / LayerNorm's affine terms.

    γ' = γ + multiplier · w_norm        β' = β + multiplier · b_norm

``w_norm`` and ``b_norm`` have the norm's channel shape (C,) and start at 0. File keys ``<name>.w_norm`` /
``<name>.b_norm`` without ``alpha`` (LyCORIS ``NormModule``; ComfyUI and A1111 read them as additive "diff"
patches, docs/formats.md "Norm layers and other suffixes").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

FILE_KEYS = {"w_norm": "w_norm", "b_norm": "b_norm"}


def init_params(channels: int, *, has_bias: bool = True, device: Any = None, dtype: Any = None) -> dict[str, Tensor]:
    """Zero ``w_norm`` (and ``b_norm`` when the norm has a bias) of shape (channels,)."""
    params = {"w_norm": torch.zeros(channels, device=device, dtype=dtype)}
    if has_bias:
        params["b_norm"] = torch.zeros(channels, device=device, dtype=dtype)
    return params


def affine(weight: Tensor, bias: Tensor | None, params: dict[str, Tensor], multiplier: float):
    """The adapted (γ', β') of a norm layer."""
    new_weight = weight + multiplier * params["w_norm"].to(weight.dtype)
    b_norm = params.get("b_norm")
    new_bias = bias if (bias is None or b_norm is None) else bias + multiplier * b_norm.to(bias.dtype)
    return new_weight, new_bias
