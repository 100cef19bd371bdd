"""BOFT: butterfly orthogonal fine-tuning, m stages of block rotations mixed by butterfly permutations.

Liu et al. 2024, "Parameter-Efficient Orthogonal Finetuning via Butterfly Factorization", ICLR 2024,
arXiv:2311.06243. File layout: LyCORIS ``ButterflyOFTModule`` (lycoris-lora 4.1.3; docs/formats.md "BOFT").

    oft_blocks (m, n, b, b): m stages of n blocks of size b, n·b = out; rescale (out, 1[, 1, 1]) optional
    (b, n) = power2factorization(out, dim): b even, b ≤ dim, n = out / b a power of two, the largest such b
    m = popcount(n − 1) + 1   (n = 2^p: m = p + 1)
    R_s = Cayley(oft_blocks[s]) per block (Q = B − Bᵀ, LyCORIS' constraint over all stages: networks.algos.oft)
    X ← W (flattened to (out, in·kh·kw)); for stage s = 0 … m−1, with g = 2 and k = 2^s · b/2:
        permute rows: view (out / (g·k), g, k) → swap the last two axes → flatten   (the butterfly interleave)
        X ← blockwise R_s,m · X on consecutive groups of b rows   (R_s,m = I + mult·(R_s − I))
        undo the permutation
    W' = rescale ⊙ X;   ΔW = W' − W

The multiplier moves every stage toward I (LyCORIS), so ΔW is not linear in it. Init: zeros (ΔW = 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm
from .oft import _rescale_init, rotated_delta


def power2factorization(dim: int, factor: int = -1) -> tuple[int, int] | None:
    """(b, n) with b even, b ≤ ``factor`` (≤ 0: no limit), b · n = ``dim``, n a power of two, b the largest such;
    None when there is none (odd ``dim``, or ``factor`` < 2). LyCORIS' rule."""
    limit = dim if factor <= 0 else factor
    best = None
    for b in range(2, min(limit, dim) + 1, 2):
        n, rest = divmod(dim, b)
        if rest == 0 and n & (n - 1) == 0:
            best = (b, n)
    return best


def stages(block_num: int) -> int:
    """m = popcount(n − 1) + 1, the number of butterfly stages LyCORIS uses for n blocks."""
    return bin(block_num - 1).count("1") + 1


def init_params(
    base_shape: tuple[int, ...], rank: int, *, rescaled: bool = False, device: Any = None, dtype: Any = None, **_: Any
) -> dict[str, Tensor]:
    """Fresh BOFT tensors: ``oft_blocks`` zeros (m, n, b, b) from ``power2factorization(out, rank)``; ``ValueError``
    when the width cannot be split (odd, or no even b ≤ rank with a power-of-two count)."""
    out_dim = base_shape[0]
    split = power2factorization(out_dim, rank)
    if split is None:
        raise ValueError(
            f"boft: {out_dim} output channels cannot be split into a power-of-two number of even "
            f"blocks of size ≤ {rank} (--network_dim / conv_dim); use a larger dim or algo=diag-oft"
        )
    b, n = split
    params = {"oft_blocks": torch.zeros(stages(n), n, b, b, device=device, dtype=dtype)}
    if rescaled:
        params["rescale"] = _rescale_init(out_dim, len(base_shape), device).to(dtype or torch.float32)
    return params


def butterfly(r: Tensor, weight: Tensor) -> Tensor:
    """The m stages applied to the rows of ``weight`` (out, f); r: (m, n, b, b) rotations (already at the
    multiplier)."""
    m, _, b, _ = r.shape
    x = weight
    for s in range(m):
        k = 2**s * (b // 2)
        x = x.unflatten(0, (-1, 2, k)).transpose(1, 2).flatten(0, 2).unflatten(0, (-1, b))
        x = torch.einsum("nij,njf->nif", r[s], x)
        x = x.flatten(0, 1).unflatten(0, (-1, k, 2)).transpose(1, 2).flatten(0, 2)
    return x


def delta_weight(
    params: Mapping[str, Tensor],
    scale: float,
    shape: tuple[int, ...],
    *,
    base: Tensor | None = None,
    alpha: Any = None,
    multiplier: float | Tensor = 1.0,
    **_: Any,
) -> Tensor:
    """ΔW = rescale ⊙ butterfly(W) − W in ``shape`` (float32); ``alpha`` is the constraint per output row."""

    def turn(r: Tensor, w: Tensor) -> Tensor:
        return butterfly(r, w.reshape(shape[0], -1)).reshape(w.shape)

    return rotated_delta(params, shape, base, alpha, multiplier, turn)


def rank(params: Mapping[str, Tensor]) -> int | None:
    return None


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"rescaled": "rescale" in params}


ALGORITHM = Algorithm(
    name="boft",
    file_keys={"oft_blocks": "oft_blocks", "rescale": "rescale"},
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    needs_base=True,
    multiplier_inside=True,
    norm_params=("oft_blocks",),
    constraint_alpha=True,
)
