"""(IA)³: a learned per-channel rescaling of the base weight, along its output or its input axis.

Liu et al. 2022, "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context Learning",
NeurIPS 2022, arXiv:2205.05638; as implemented for diffusion models by LyCORIS (``IA3Module``). File layout:
docs/formats.md "(IA)³".

Shapes (``c`` = out, or in with ``on_input``):

    Linear (out, in):          weight (c,)               on_input ()  (an integer: 0 or 1)
    Conv2d (out, in, kh, kw):  weight (1, c, 1, 1)       on_input ()

    W' = W ⊙ (1 + m·s)         s = weight broadcast along axis 0 (on_input = 0) or axis 1 (on_input = 1)
    ΔW = W ⊙ s                 (depends on W: ``needs_base``)

No ``alpha`` and no rank: LyCORIS ignores ``--network_dim`` / ``--network_alpha`` here; the scale is 1. Init
(LyCORIS): s = 0, so ΔW = 0. ``on_input`` is a setting, not trained (``Algorithm.constants``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm

FILE_KEYS = {"weight": "weight", "on_input": "on_input"}


def init_params(
    base_shape: tuple[int, ...],
    rank: int | None = None,
    *,
    train_on_input: bool = False,
    device: Any = None,
    dtype: Any = None,
    **_: Any,
) -> dict[str, Tensor]:
    """Zero scales for the output channels of a weight of ``base_shape`` (the input channels with
    ``train_on_input``) and the ``on_input`` flag; ``rank`` is ignored (as in LyCORIS)."""
    out_dim, in_dim, *kernel = base_shape
    channels = in_dim if train_on_input else out_dim
    shape = (1, channels, *[1] * len(kernel)) if kernel else (channels,)
    return {
        "weight": torch.zeros(shape, device=device, dtype=dtype),
        "on_input": torch.tensor(int(train_on_input)),
    }


def on_input(params: Mapping[str, Tensor]) -> bool:
    """Whether the scales act on the input axis (a host read of a CPU flag)."""
    return bool(int(params["on_input"]))


def channel_scale(params: Mapping[str, Tensor], dims: int) -> Tensor:
    """s shaped to broadcast against a weight with ``dims`` axes: (out, 1, ...) or (1, in, ...)."""
    s = params["weight"].reshape(-1)
    return s.reshape(1, -1, *[1] * (dims - 2)) if on_input(params) else s.reshape(-1, *[1] * (dims - 1))


def delta_weight(
    params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...], *, base: Tensor | None = None, **_: Any
) -> Tensor:
    """ΔW = scale · W ⊙ s (s along the output axis, or the input axis with ``on_input``), in ``shape``."""
    if base is None:
        raise ValueError("ia3: ΔW = W ⊙ s depends on the base weight W; pass base=W")
    base = base.reshape(shape)
    delta = base * channel_scale(params, base.dim()).to(base.dtype)
    return delta if isinstance(scale, float) and scale == 1.0 else delta * scale


def rank(params: Mapping[str, Tensor]) -> None:
    return None


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"train_on_input": on_input(params)}


def norm_exponents(params: Mapping[str, Tensor]) -> dict[str, float]:
    """ΔW is linear in s."""
    return {"weight": 1.0}


ALGORITHM = Algorithm(
    name="ia3",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    needs_base=True,
    has_alpha=False,
    constants=("on_input",),
    norm_exponents=norm_exponents,
)
