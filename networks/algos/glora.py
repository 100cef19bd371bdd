"""GLoRA: a low-rank change of the input side of W plus a low-rank additive term.

Chavan et al. 2023, "One-for-All: Generalized LoRA for Parameter-Efficient Fine-tuning", arXiv:2306.07967; the
LyCORIS form (``GLoRAModule``, 4.1.3): f(x) = W·x + W·A·x + B·x with A = a1·a2 and B = b1·b2. File layout:
docs/formats.md "GLoRA".

Shapes (``r`` = rank; ``k`` = the base kernel kh x kw):

    Linear (out, in):          a1 (in, r)        a2 (r, in)        b1 (out, r)        b2 (r, in)
    Conv2d (out, in, kh, kw):  a1 (in, r, 1, 1)  a2 (r, in, 1, 1)  b1 (out, r, 1, 1)  b2 (r, in, kh, kw)
    Conv2d, tucker (read only): b2 (r, in, 1, 1)  bm (r, r, kh, kw)

    ΔW[o,j,...] = scale · ( Σ_i W[o,i,...] · (a1 @ a2)[i,j]  +  (b1 @ b2)[o,j,...] )      (depends on W)
    tucker B:     (b1 @ b2)[o,j,y,x] → Σ_m,n b1[o,m] · bm[m,n,y,x] · b2[n,j]
    scale = alpha / r

The A half acts on the input channels of W (a 1x1 mix for convolutions); the B half is an ordinary LoRA / LoCon.
Init (LyCORIS): a1 and b1 Kaiming-uniform (a = √5), a2 = b2 = 0, so ΔW = 0; with ``use_scalar`` a2 and b2 are
Kaiming-initialised too and a learned scalar starting at 0 keeps ΔW = 0 (folded into a2 and b2 in files).
LyCORIS 4.1.3 never builds the tucker core (its condition cannot hold), so ``bm`` is only read from files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm, kaiming_uniform

FILE_KEYS = {"a1": "a1.weight", "a2": "a2.weight", "b1": "b1.weight", "b2": "b2.weight", "bm": "bm.weight"}


def init_params(
    base_shape: tuple[int, ...],
    rank: int,
    *,
    use_scalar: bool = False,
    device: Any = None,
    dtype: Any = None,
    **_: Any,
) -> dict[str, Tensor]:
    """Fresh GLoRA tensors for a base weight of ``base_shape``; ΔW starts at 0."""
    out_dim, in_dim, *kernel = base_shape
    ones = [1] * len(kernel)
    zero = kaiming_uniform if use_scalar else (lambda s, dv, dt: torch.zeros(s, device=dv, dtype=dt))
    return {
        "a1": kaiming_uniform((in_dim, rank, *ones), device, dtype),
        "a2": zero((rank, in_dim, *ones), device, dtype),
        "b1": kaiming_uniform((out_dim, rank, *ones), device, dtype),
        "b2": zero((rank, in_dim, *kernel), device, dtype),
    }


def b_weight(params: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
    """B = b1 @ b2 (through ``bm`` when present) in ``shape``: the input-independent, LoRA-like half."""
    b1, b2, bm = params["b1"], params["b2"], params.get("bm")
    b1 = b1.reshape(b1.shape[0], -1)
    if bm is None:
        return (b1 @ b2.reshape(b2.shape[0], -1)).reshape(shape)
    return torch.einsum("mn...,om,nj->oj...", bm, b1, b2.reshape(b2.shape[0], b2.shape[1])).reshape(shape)


def a_matrix(params: Mapping[str, Tensor]) -> Tensor:
    """A = a1 @ a2 (in, in): the mix of W's input channels."""
    a1, a2 = params["a1"], params["a2"]
    return a1.reshape(a1.shape[0], -1) @ a2.reshape(a2.shape[0], -1)


def delta_weight(
    params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...], *, base: Tensor | None = None, **_: Any
) -> Tensor:
    """ΔW = scale · (W ×_in (a1 @ a2) + b1 @ b2), in ``shape`` (W: the base weight)."""
    if base is None:
        raise ValueError("glora: ΔW = W·A + B depends on the base weight W; pass base=W")
    a1, a2 = params["a1"], params["a2"]
    w = base.reshape(shape).to(a1.dtype)
    wa1 = torch.einsum("oi...,ir->or...", w, a1.reshape(a1.shape[0], -1))
    wa = torch.einsum("or...,rj->oj...", wa1, a2.reshape(a2.shape[0], -1))
    return (wa + b_weight(params, shape)) * scale


def rank(params: Mapping[str, Tensor]) -> int:
    return int(params["a2"].shape[0])


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"use_tucker": "bm" in params}


def norm_exponents(params: Mapping[str, Tensor]) -> dict[str, float]:
    """Each half is a product: A of (a1, a2), B of (b1, b2) or (b1, bm, b2); each factor takes its root."""
    b = ("b1", "b2", "bm") if "bm" in params else ("b1", "b2")
    return {"a1": 0.5, "a2": 0.5, **{k: 1.0 / len(b) for k in b}}


ALGORITHM = Algorithm(
    name="glora",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    scalar_params=("a2", "b2"),
    needs_base=True,
    norm_exponents=norm_exponents,
)
