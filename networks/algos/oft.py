"""OFT: an orthogonal rotation of the base weight's output rows, block by block (diag-OFT), and sd-scripts' variant.

Qiu et al. 2023, "Controlling Text-to-Image Diffusion by Orthogonal Finetuning", arXiv:2306.07280. Two file formats
store the same kind of tensor ``oft_blocks`` (n, b, b) with n·b = out (docs/formats.md "OFT"):

* LyCORIS ``algo=diag-oft`` (``DiagOFTModule`` of lycoris-lora 4.1.3): ``lora_unet_…`` names, optional ``rescale``
  (out, 1[, 1, 1]), ``alpha`` = the constraint (0: none). Block size from ``--network_dim`` (``conv_dim`` for k > 1
  convs) by LyCORIS' factorisation rule: (b, n) = ``factorization(out, dim)``, b ≤ n.
* sd-scripts ``--network_module networks.oft`` (``OFTModule``): ``oft_unet_…`` names, no rescale, ``--network_dim`` =
  the number of blocks n (b = out / n), ``alpha`` = the constraint (always applied, 0 freezes the rotation).

Both build, per block k, the Cayley transform of the skew-symmetric part of the stored block:

    Q_k = B_k − B_kᵀ,  Q ← normalised as the format says (the Frobenius norm is taken over *all* blocks),
    R_k = (I + Q_k)(I − Q_k)⁻¹   (orthogonal),
    W'[k·b + j] = Σ_i R_m[k, i, j] · W[k·b + i]        (rows of block k turned by R_mᵀ; W flattened to (out, in·kh·kw))
    R_m = I + m·(R − I)  (the multiplier m moves R toward I, as LyCORIS and sd-scripts do)
    diag-oft with rescale: W' ← rescale ⊙ W' (per output row; not scaled by m, as LyCORIS)
    ΔW = W' − W

Constraint c = alpha · out. LyCORIS: if c > 0 and ‖Q‖ + 1e-8 > c, Q ← Q · c / (‖Q‖ + 1e-8). sd-scripts:
Q ← Q · (min(‖Q‖, c) + 1e-8) / (‖Q‖ + 1e-8), always. The checks use ``torch.where`` (no host sync; meta tensors work).
Init: B = 0 (R = I, ΔW = 0), rescale = 1. Only torch is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm
from .lokr import factorization

FILE_KEYS = {"oft_blocks": "oft_blocks", "rescale": "rescale"}
EPS = 1e-8


def _as_tensor(value: Any, like: Tensor) -> Tensor:
    return torch.as_tensor(0.0 if value is None else value, dtype=torch.float32, device=like.device)


def lycoris_constrain(q: Tensor, constraint: Tensor) -> Tensor:
    """LyCORIS: Q · c / (‖Q‖ + 1e-8) when c > 0 and ‖Q‖ + 1e-8 > c, else Q (‖·‖ over every block of the module)."""
    norm = torch.linalg.vector_norm(q.float()) + EPS
    c = constraint.to(norm.dtype)
    factor = torch.where((c > 0) & (norm > c), c / norm, torch.ones_like(norm))
    return q * factor.to(q.dtype)


def kohya_constrain(q: Tensor, constraint: Tensor) -> Tensor:
    """sd-scripts networks.oft: Q · (min(‖Q‖, c) + 1e-8) / (‖Q‖ + 1e-8), always applied."""
    norm = torch.linalg.vector_norm(q.flatten().float())
    return q * ((torch.minimum(norm, constraint.to(norm.dtype)) + EPS) / (norm + EPS)).to(q.dtype)


def cayley(blocks: Tensor, constraint: Tensor, *, kohya: bool = False) -> Tensor:
    """R = (I + Q)(I − Q)⁻¹ per block in float32, Q = B − Bᵀ constrained (see the module docstring); blocks:
    (..., b, b) of any float dtype (bf16 / fp16 blocks are cast up: the inverse needs float32, as in LyCORIS)."""
    q = (blocks - blocks.transpose(-1, -2)).float()
    q = kohya_constrain(q, constraint) if kohya else lycoris_constrain(q, constraint)
    eye = torch.eye(blocks.shape[-1], device=blocks.device, dtype=q.dtype)
    return (eye + q) @ (eye - q).float().inverse()


def toward_identity(r: Tensor, multiplier: float | Tensor) -> Tensor:
    """I + m·(R − I): the rotation at multiplier m (m = 1: R itself, m = 0: I)."""
    if isinstance(multiplier, (int, float)) and multiplier == 1:
        return r
    eye = torch.eye(r.shape[-1], device=r.device, dtype=r.dtype)
    return eye + multiplier * (r - eye)


def rotate_rows(r: Tensor, weight: Tensor) -> Tensor:
    """Rows of block k of ``weight`` (out, ...) turned by R_kᵀ: W'[k, j] = Σ_i R[k, i, j] · W[k, i]; r: (n, b, b)."""
    n, b, _ = r.shape
    blocks = weight.reshape(n, b, -1).to(r.dtype)
    return torch.einsum("kij,kif->kjf", r, blocks).reshape(weight.shape)


def block_shape(out_dim: int, dim: int) -> tuple[int, int]:
    """(block_size b, block count n) of LyCORIS diag-oft for ``--network_dim`` ``dim``: ``factorization(out, dim)``."""
    return factorization(out_dim, dim)


def _rescale_init(out_dim: int, ndim: int, device: Any) -> Tensor:
    return torch.ones(out_dim, *[1] * (ndim - 1), device=device, dtype=torch.float32)


def init_params(
    base_shape: tuple[int, ...], rank: int, *, rescaled: bool = False, device: Any = None, dtype: Any = None, **_: Any
) -> dict[str, Tensor]:
    """Fresh diag-oft tensors: ``oft_blocks`` zeros (n, b, b) with (b, n) = ``factorization(out, rank)``, and with
    ``rescaled`` a ``rescale`` of ones (out, 1[, 1, 1]). ΔW = 0."""
    out_dim = base_shape[0]
    b, n = block_shape(out_dim, rank)
    params = {"oft_blocks": torch.zeros(n, b, b, device=device, dtype=dtype)}
    if rescaled:
        params["rescale"] = _rescale_init(out_dim, len(base_shape), device).to(dtype or torch.float32)
    return params


def _check(blocks: Tensor, shape: tuple[int, ...], base: Tensor | None) -> Tensor:
    if base is None:
        raise ValueError("OFT: ΔW = R·W − W needs the base weight W (base=)")
    if blocks.shape[-3] * blocks.shape[-1] != shape[0] or tuple(base.shape) != tuple(shape):
        raise ValueError(f"OFT: oft_blocks {tuple(blocks.shape)} do not cover {shape[0]} output rows of {tuple(shape)}")
    return base


def rotated_delta(
    params: Mapping[str, Tensor],
    shape: tuple[int, ...],
    base: Tensor | None,
    alpha: Any,
    multiplier: float | Tensor,
    turn: Callable[[Tensor, Tensor], Tensor],
    *,
    kohya: bool = False,
) -> Tensor:
    """ΔW = rescale ⊙ turn(R_m, W) − W (float32) for the rotation R of ``oft_blocks``, shared by diag-oft, BOFT and
    networks.oft: ``turn`` applies the rotations to W's rows; the constraint is ``alpha`` per output row."""
    blocks = params["oft_blocks"]
    weight = _check(blocks, shape, base)
    r = toward_identity(cayley(blocks, _as_tensor(alpha, blocks) * shape[0], kohya=kohya), multiplier)
    w = weight.to(r.dtype)
    new = turn(r, w)
    rescale = params.get("rescale")
    if rescale is not None:
        new = rescale.reshape(shape[0], *[1] * (len(shape) - 1)).to(new.dtype) * new
    return new - w


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
    """diag-oft: ΔW = rescale ⊙ rotate(R_m, W) − W in ``shape`` (float32); ``alpha`` is the constraint per row."""
    return rotated_delta(params, shape, base, alpha, multiplier, rotate_rows)


def rank(params: Mapping[str, Tensor]) -> int | None:
    """None: OFT has no alpha / r scale (alpha is the constraint)."""
    return None


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"rescaled": "rescale" in params}


def kohya_init_params(
    base_shape: tuple[int, ...], rank: int, *, device: Any = None, dtype: Any = None, **_: Any
) -> dict[str, Tensor]:
    """sd-scripts networks.oft: ``rank`` = the number of blocks n; b = out / n (must divide: ``ValueError``)."""
    out_dim = base_shape[0]
    if rank < 1 or out_dim % rank:
        raise ValueError(
            f"networks.oft: --network_dim {rank} (the number of blocks) does not divide the {out_dim} "
            "output channels of this layer; pick a divisor of every targeted layer's width (e.g. 4 or 8)"
        )
    b = out_dim // rank
    return {"oft_blocks": torch.zeros(rank, b, b, device=device, dtype=dtype)}


def kohya_delta_weight(
    params: Mapping[str, Tensor],
    scale: float,
    shape: tuple[int, ...],
    *,
    base: Tensor | None = None,
    alpha: Any = None,
    multiplier: float | Tensor = 1.0,
    **_: Any,
) -> Tensor:
    """sd-scripts networks.oft: ΔW = rotate(I + m·(R − I), W) − W, sd-scripts' constraint rule (no rescale)."""
    return rotated_delta(params, shape, base, alpha, multiplier, rotate_rows, kohya=True)


def kohya_options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {}


ALGORITHM = Algorithm(
    name="diag-oft",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    needs_base=True,
    multiplier_inside=True,
    norm_params=("oft_blocks",),
    constraint_alpha=True,
)

KOHYA_ALGORITHM = Algorithm(
    name="oft",
    file_keys={"oft_blocks": "oft_blocks"},
    init_params=kohya_init_params,
    delta_weight=kohya_delta_weight,
    rank=rank,
    options=kohya_options,
    needs_base=True,
    multiplier_inside=True,
    norm_params=("oft_blocks",),
    constraint_alpha=True,
    file_prefix="oft_unet",
)
