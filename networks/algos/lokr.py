"""LoKr: the Kronecker product of a small matrix and a (possibly low-rank) larger one.

Edalati et al. 2022, "KronA: Parameter Efficient Tuning with Kronecker Adapter", arXiv:2212.10650; the LyCORIS
variant (Yeh et al. 2024, "Navigating Text-To-Image Customization: From LyCORIS Fine-Tuning to Model Evaluation",
ICLR 2024, arXiv:2309.14859). File layout: LyCORIS ``LokrModule`` (docs/formats.md "LoKr").

The base weight (out, in[, kh, kw]) is split as out = a·b, in = c·d with :func:`factorization` (a ≤ b, c ≤ d):

    W1 = lokr_w1 (a, c)                   or lokr_w1_a (a, r) @ lokr_w1_b (r, c)          ("decompose_both")
    W2 = lokr_w2 (b, d[, kh, kw])         or lokr_w2_a (b, r) @ lokr_w2_b (r, d·kh·kw)    (r < max(b, d) / 2)
         tucker conv: W2[p,q,y,x] = Σ_i,j lokr_t2[i,j,y,x] · lokr_w2_a[i,p] · lokr_w2_b[j,q]
    ΔW = scale · kron(W1, W2)      (a conv W1 acts as (a, c, 1, 1)), reshaped to the base shape
    scale = alpha / r if any factor is decomposed, else 1 (LyCORIS then stores alpha = the configured rank)

Init (LyCORIS): W1 factors Kaiming-uniform; W2 = 0, or w2_a Kaiming and w2_b = 0 (t2 Kaiming) so ΔW = 0. With
``use_scalar`` the zero factor is Kaiming-initialised and a learned scalar starting at 0 keeps ΔW = 0 (folded into
``lokr_w1`` / ``lokr_w1_a`` in files).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm, kaiming_uniform

FILE_KEYS = {k: k for k in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")}


def factorization(dim: int, factor: int = -1) -> tuple[int, int]:
    """Split ``dim`` = m·n with m ≤ n: m = ``factor`` when it divides ``dim``, else the largest divisor m with
    m ≤ √dim and m ≤ ``factor`` (``factor`` ≤ 0: no limit). Same split as LyCORIS, so our files have its shapes.
    """
    if factor > 0 and dim % factor == 0:
        return min(factor, dim // factor), max(factor, dim // factor)
    limit = dim if factor <= 0 else factor
    best = 1
    m = 1
    while m * m <= dim:
        if dim % m == 0 and m <= limit:
            best = m
        m += 1
    return best, dim // best


def init_params(
    base_shape: tuple[int, ...],
    rank: int,
    *,
    factor: int = -1,
    decompose_both: bool = False,
    use_tucker: bool = False,
    full_matrix: bool = False,
    unbalanced_factorization: bool = False,
    use_scalar: bool = False,
    device: Any = None,
    dtype: Any = None,
    **_: Any,
) -> dict[str, Tensor]:
    """Fresh LoKr tensors for a base weight of ``base_shape``; ΔW starts at 0. Factor shapes follow LyCORIS."""
    out_dim, in_dim, *kernel = base_shape
    c, d = factorization(in_dim, factor)
    a, b = factorization(out_dim, factor)
    if unbalanced_factorization:
        a, b = b, a
    tucker = bool(kernel) and use_tucker and any(k != 1 for k in kernel)
    params: dict[str, Tensor] = {}
    if decompose_both and rank < max(a, c) / 2 and not full_matrix:
        params["lokr_w1_a"] = kaiming_uniform((a, rank), device, dtype)
        params["lokr_w1_b"] = kaiming_uniform((rank, c), device, dtype)
    else:
        params["lokr_w1"] = kaiming_uniform((a, c), device, dtype)
    zero_init = kaiming_uniform if use_scalar else (lambda s, dv, dt: torch.zeros(s, device=dv, dtype=dt))
    if rank >= max(b, d) / 2 or full_matrix:
        params["lokr_w2"] = zero_init((b, d, *kernel), device, dtype)
    elif tucker:
        params["lokr_t2"] = kaiming_uniform((rank, rank, *kernel), device, dtype)
        params["lokr_w2_a"] = kaiming_uniform((rank, b), device, dtype)
        params["lokr_w2_b"] = zero_init((rank, d), device, dtype)
    else:
        flat = d * (math.prod(kernel) if kernel else 1)
        params["lokr_w2_a"] = kaiming_uniform((b, rank), device, dtype)
        params["lokr_w2_b"] = zero_init((rank, flat), device, dtype)
    return params


def _w1(params: Mapping[str, Tensor]) -> Tensor:
    w1 = params.get("lokr_w1")
    return w1 if w1 is not None else params["lokr_w1_a"] @ params["lokr_w1_b"]


def _w2(params: Mapping[str, Tensor], shape: tuple[int, ...], b: int) -> Tensor:
    w2 = params.get("lokr_w2")
    if w2 is not None:
        return w2
    t = params.get("lokr_t2")
    if t is not None:
        return torch.einsum("ij...,ip,jq->pq...", t, params["lokr_w2_a"], params["lokr_w2_b"])
    flat = params["lokr_w2_a"] @ params["lokr_w2_b"]  # (b, d·kh·kw)
    return flat.reshape(b, -1, *shape[2:])


def delta_weight(params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...], **_: Any) -> Tensor:
    """ΔW = scale · kron(W1, W2), each factor rebuilt from its parts first, in the base ``shape``."""
    w1 = _w1(params)
    w2 = _w2(params, tuple(shape), shape[0] // w1.shape[0])
    w1 = w1.reshape(*w1.shape, *[1] * (w2.dim() - 2))
    return (torch.kron(w1, w2.contiguous()) * scale).reshape(shape)


def rank(params: Mapping[str, Tensor]) -> int | None:
    """The rank of the decomposed factor (w2 first, as LyCORIS and ComfyUI read it); None when both are full."""
    if "lokr_w2_b" in params:
        return int(params["lokr_w2_b"].shape[0])
    if "lokr_w1_b" in params:
        return int(params["lokr_w1_b"].shape[0])
    return None


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {
        "use_tucker": "lokr_t2" in params,
        "decompose_both": "lokr_w1_a" in params,
        "full_matrix": "lokr_w1" in params and "lokr_w2" in params,
    }


ALGORITHM = Algorithm(
    name="lokr",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    plus_params=(),
    scalar_params=("lokr_w1", "lokr_w1_a"),
)
