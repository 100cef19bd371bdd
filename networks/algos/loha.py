"""LoHa: the Hadamard (element-wise) product of two low-rank products.

Hyeon-Woo et al. 2022, "FedPara: Low-Rank Hadamard Product for Communication-Efficient Federated Learning",
ICLR 2022, arXiv:2108.06098; as implemented for diffusion models by LyCORIS (Yeh et al. 2024, arXiv:2309.14859).
File layout: LyCORIS ``LohaModule`` (docs/formats.md "LoHa").

Shapes (``r`` = rank; a conv kernel ``kh x kw`` is flattened into the input side unless tucker is used):

    plain:   hada_w1_a (out, r)  hada_w1_b (r, in·kh·kw)  hada_w2_a (out, r)  hada_w2_b (r, in·kh·kw)
    tucker:  hada_t1 (r, r, kh, kw)  hada_w1_a (r, out)  hada_w1_b (r, in)   (same for t2 / w2_*)

    ΔW = scale · (w1_a @ w1_b) ⊙ (w2_a @ w2_b)             reshaped to the base weight shape
    tucker half: W1[o,i,y,x] = Σ_a,b t1[a,b,y,x] · w1_a[a,o] · w1_b[b,i]
    scale = alpha / r

The effective rank of ΔW is up to r², for 4r(in+out) parameters. Init (LyCORIS): w1_a ~ N(0, 0.1), w1_b ~ N(0, 1),
w2_b ~ N(0, 1), w2_a = 0 (so ΔW = 0), t ~ N(0, 0.1). With ``use_scalar`` w2_a ~ N(0, 0.1) and a learned scalar
starting at 0 keeps ΔW = 0 (folded into ``hada_w1_a`` in files).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm

FILE_KEYS = {k: k for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")}


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
    """Fresh LoHa tensors for a base weight of ``base_shape``; ΔW starts at 0."""
    out_dim, in_dim, *kernel = base_shape

    def normal(shape: tuple[int, ...], std: float) -> Tensor:
        return torch.randn(shape, device=device, dtype=dtype) * std

    if kernel and use_tucker and any(k != 1 for k in kernel):
        params = {
            "hada_t1": normal((rank, rank, *kernel), 0.1),
            "hada_w1_a": normal((rank, out_dim), 0.1),
            "hada_w1_b": normal((rank, in_dim), 1.0),
            "hada_t2": normal((rank, rank, *kernel), 0.1),
            "hada_w2_a": torch.zeros((rank, out_dim), device=device, dtype=dtype),
            "hada_w2_b": normal((rank, in_dim), 1.0),
        }
        if use_scalar:
            params["hada_w2_a"] = normal((rank, out_dim), 0.1)
        return params
    flat_in = in_dim * int(torch.tensor(kernel).prod().item()) if kernel else in_dim
    params = {
        "hada_w1_a": normal((out_dim, rank), 0.1),
        "hada_w1_b": normal((rank, flat_in), 1.0),
        "hada_w2_a": torch.zeros((out_dim, rank), device=device, dtype=dtype),
        "hada_w2_b": normal((rank, flat_in), 1.0),
    }
    if use_scalar:
        params["hada_w2_a"] = normal((out_dim, rank), 0.1)
    return params


def _half(a: Tensor, b: Tensor, t: Tensor | None) -> Tensor:
    if t is None:
        return a @ b
    return torch.einsum("ab...,ao,bi->oi...", t, a, b)


def delta_weight(params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...], **_: Any) -> Tensor:
    """ΔW = scale · (w1_a @ w1_b) ⊙ (w2_a @ w2_b) (each half through its tucker core when present), in ``shape``."""
    w1 = _half(params["hada_w1_a"], params["hada_w1_b"], params.get("hada_t1"))
    w2 = _half(params["hada_w2_a"], params["hada_w2_b"], params.get("hada_t2"))
    return (w1 * w2 * scale).reshape(shape)


def rank(params: Mapping[str, Tensor]) -> int:
    return int(params["hada_w1_b"].shape[0])


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"use_tucker": "hada_t1" in params}


ALGORITHM = Algorithm(
    name="loha",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    plus_params=(),
    scalar_params=("hada_w1_a",),
)
