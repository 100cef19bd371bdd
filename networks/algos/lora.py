"""LoRA and LoCon: a low-rank product added to a Linear or Conv2d weight.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685 (the linear case);
LyCORIS "LoCon" (KohakuBlueleaf, and Yeh et al. 2024, arXiv:2309.14859) for convolutions. Files: kohya
``networks.lora`` / LyCORIS ``LoConModule`` layout (docs/formats.md "LoRA and LoCon").

Shapes (``r`` = rank, ``k`` = the base kernel ``kh x kw``):

    Linear (out, in):           lora_down (r, in)           lora_up (out, r)
    Conv2d (out, in, kh, kw):   lora_down (r, in, kh, kw)   lora_up (out, r, 1, 1)
    Conv2d, tucker (k > 1):     lora_down (r, in, 1, 1)     lora_mid (r, r, kh, kw)     lora_up (out, r, 1, 1)

    ΔW = scale · up @ down                                   (conv: up (out, r) @ down (r, in·kh·kw), reshaped)
    ΔW[o,i,y,x] = scale · Σ_a,b up[o,a] · mid[a,b,y,x] · down[b,i]            (tucker / CP form)
    scale = alpha / r

Init (Microsoft's LoRA, sd-scripts, LyCORIS): ``down`` (and ``mid``) Kaiming-uniform with a = √5, ``up`` zeros, so
ΔW = 0. With ``use_scalar`` (LyCORIS) ``up`` is Kaiming-initialised too and a learned scalar starting at 0 keeps
ΔW = 0; the scalar is folded into ``lora_up`` when a file is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Algorithm, kaiming_uniform

FILE_KEYS = {"lora_down": "lora_down.weight", "lora_up": "lora_up.weight", "lora_mid": "lora_mid.weight"}


def init_params(
    base_shape: tuple[int, ...],
    rank: int,
    *,
    use_tucker: bool = False,
    use_scalar: bool = False,
    device: Any = None,
    dtype: Any = None,
    **_: Any,
) -> dict[str, Tensor]:
    """Fresh LoRA tensors for a base weight of ``base_shape`` ((out, in) or (out, in, kh, kw)); ΔW starts at 0.

    ``use_tucker`` applies to convolutions with a kernel larger than 1x1 only (as in LyCORIS).
    """
    out_dim, in_dim, *kernel = base_shape
    ones = [1] * len(kernel)
    if kernel and use_tucker and any(k != 1 for k in kernel):
        params = {
            "lora_down": kaiming_uniform((rank, in_dim, *ones), device, dtype),
            "lora_mid": kaiming_uniform((rank, rank, *kernel), device, dtype),
            "lora_up": torch.zeros((out_dim, rank, *ones), device=device, dtype=dtype),
        }
    else:
        params = {
            "lora_down": kaiming_uniform((rank, in_dim, *kernel), device, dtype),
            "lora_up": torch.zeros((out_dim, rank, *ones), device=device, dtype=dtype),
        }
    if use_scalar:
        params["lora_up"] = kaiming_uniform(params["lora_up"].shape, device, dtype)
    return params


def factors(params: Mapping[str, Tensor], scale: float) -> tuple[Tensor, Tensor] | None:
    """(scale · up (out, r), down (r, in·kh·kw)) with ΔW = up @ down (reshaped); None for the tucker form."""
    down, up = params["lora_down"], params["lora_up"]
    if "lora_mid" in params:
        return None
    return up.reshape(up.shape[0], up.shape[1]) * scale, down.reshape(down.shape[0], -1)


def delta_weight(params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...] | None = None, **_: Any) -> Tensor:
    """ΔW = scale · up @ down (conv: via the flattened kernel; tucker: through ``lora_mid``), in the base shape."""
    down, up, mid = params["lora_down"], params["lora_up"], params.get("lora_mid")
    if mid is None:
        up2, down2 = factors(params, 1.0)
        delta = (up2 @ down2).reshape(up.shape[0], *down.shape[1:])
    else:
        up2 = up.reshape(up.shape[0], up.shape[1])
        down2 = down.reshape(down.shape[0], down.shape[1])
        delta = torch.einsum("ab...,oa,bi->oi...", mid, up2, down2)
    delta = delta * scale
    return delta.reshape(shape) if shape is not None else delta


def project_down(x: Tensor, params: Mapping[str, Tensor], conv: dict | None) -> Tensor:
    """The rank-r activation ``down(x)`` (tucker: ``mid(down(x))``) in the base layer's own op."""
    down, mid = params["lora_down"], params.get("lora_mid")
    if conv is None:
        return F.linear(x, down if down.dtype == x.dtype else down.to(x.dtype))
    if mid is None:
        return F.conv2d(x, down.to(x.dtype), None, **conv)
    return F.conv2d(F.conv2d(x, down.to(x.dtype)), mid.to(x.dtype), None, **conv)


def project_up(h: Tensor, params: Mapping[str, Tensor]) -> Tensor:
    """``up(h)``: Linear or 1x1 conv back to the base layer's output width (unscaled)."""
    up = params["lora_up"]
    up = up if up.dtype == h.dtype else up.to(h.dtype)
    return F.linear(h, up) if up.dim() == 2 else F.conv2d(h, up)


def rank(params: Mapping[str, Tensor]) -> int:
    return int(params["lora_down"].shape[0])


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"use_tucker": "lora_mid" in params}


ALGORITHM = Algorithm(
    name="lora",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    plus_params=("lora_up",),
    scalar_params=("lora_up",),
    project_down=project_down,
    project_up=project_up,
    factors=factors,
)
