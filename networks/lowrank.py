"""Low-rank maths of the post-training tools (resize, merge, SVD-merge, extract), as pure tensor functions.

* :class:`Delta`: one module's ΔW, flattened to (out, in·kh·kw), either as a product ``up @ down`` (LoRA, and sums
  of LoRAs: ranks concatenate, exactly) or as a dense matrix (LoHa, LoKr, DoRA, tucker, model differences).
* :func:`svd_all`: the thin SVD ``ΔW = U·diag(S)·Vh`` of many deltas, batched over equal shapes. A product of rank
  R is decomposed through its factors: ``up = Qu·Ru``, ``downᵀ = Qd·Rd`` (reduced QR), then the SVD of the small
  core ``Ru·Rdᵀ = Uc·S·Vcᵀ`` gives ``Vh = Vcᵀ·Qdᵀ`` (and ``U = Qu·Uc``): the exact SVD of ΔW in O((out + in)·R²)
  instead of O(out·in·min(out, in)) (Golub & Van Loan, "Matrix Computations", 4th ed., §5.4 / §8.6). ``U·S`` is
  then ``up·(down·Vhᵀ)``, so ``Qu`` is never formed.
* Rank rules: a fixed rank, or sd-scripts' dynamic methods (``networks/resize_lora.py``: ``sv_ratio``,
  ``sv_cumulative``, ``sv_fro``), defined in :func:`dynamic_rank`.
* :func:`to_lora`: the rank-r truncation as LoRA tensors (``up = U·S / scale``, ``down = Vh``; by Eckart-Young the
  best rank-r approximation in Frobenius and spectral norm), and sd-scripts' quantile clamp of the factors.

Only torch is imported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_SV = 1e-6  # sd-scripts: a module whose largest singular value is below this is a zero matrix
DYNAMIC_METHODS = ("sv_ratio", "sv_cumulative", "sv_fro")
_BATCH_ELEMENTS = 1 << 26  # matrices per batched call: at most this many elements in the stack


@dataclass
class Delta:
    """ΔW of one module. ``shape``: the base weight's (out, in[, kh, kw]); ``up`` (out, R) and ``down``
    (R, in·kh·kw) with ΔW = up @ down, or ``dense`` (out, in·kh·kw)."""

    shape: tuple[int, ...]
    up: Tensor | None = None
    down: Tensor | None = None
    dense: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def factored(self) -> bool:
        return self.up is not None

    @property
    def rank_bound(self) -> int:
        """An upper bound of rank(ΔW): R for a product, min(out, in·kh·kw) for a dense matrix."""
        return int(self.up.shape[1]) if self.factored else min(self.rows, self.cols)

    def matrix(self) -> Tensor:
        """ΔW as an (out, in·kh·kw) matrix."""
        return self.up @ self.down if self.factored else self.dense

    def weight(self) -> Tensor:
        """ΔW in the base weight's shape."""
        return self.matrix().reshape(self.shape)

    def scaled(self, factor: float) -> Delta:
        if self.factored:
            return Delta(self.shape, up=self.up * factor, down=self.down)
        return Delta(self.shape, dense=self.dense * factor)


def sum_deltas(deltas: Sequence[Delta], weights: Sequence[float] | None = None) -> Delta:
    """Σ wᵢ·ΔWᵢ: products stay a product (ranks concatenated, wᵢ folded into ``up``), exactly; any dense term makes
    the sum dense. All deltas must have the same (out, in·kh·kw) (``ValueError`` otherwise); the result has the
    first one's ``shape`` (Linear and 1x1-conv layouts of the same weight add up)."""
    weights = [1.0] * len(deltas) if weights is None else list(weights)
    sizes = {(d.rows, d.cols) for d in deltas}
    if len(sizes) != 1:
        raise ValueError(f"cannot add deltas of different shapes {sorted({tuple(d.shape) for d in deltas})}")
    if all(d.factored for d in deltas):
        up = torch.cat([d.up.float() * w for d, w in zip(deltas, weights)], dim=1)
        down = torch.cat([d.down.float() for d in deltas], dim=0)
        return Delta(deltas[0].shape, up=up, down=down)
    dense = sum(d.matrix().float() * w for d, w in zip(deltas, weights))
    return Delta(deltas[0].shape, dense=dense)


@dataclass
class SVD:
    """Thin SVD of one ΔW: ``S`` (k,) descending, ``Vh`` (k, in·kh·kw); ``U`` (out, k) for dense deltas. For a
    product the left side is not formed (it would cost a QR of ``up``): ``us()`` gives U·S = ΔW·Vhᵀ from the kept
    ``factors`` (up, down) exactly, without dividing by S."""

    S: Tensor
    Vh: Tensor
    U: Tensor | None = None
    factors: tuple[Tensor, Tensor] | None = None

    def us(self, index: slice | Tensor = slice(None)) -> Tensor:
        """U·diag(S) for the singular values ``index`` selects: (out, r)."""
        if self.U is not None:
            return self.U[:, index] * self.S[index]
        up, down = self.factors
        return up.float() @ (down.float() @ self.Vh[index].T)

    def u(self) -> Tensor:
        """U (out, k); columns of zero singular values are 0 for a product."""
        if self.U is not None:
            return self.U
        S = self.S
        return self.us() / torch.where(S > 0, S, torch.ones_like(S))


def factored_svd(up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
    """S and Vh of the exact thin SVD of ``up @ down``, batched: up (B, m, R), down (B, R, n) -> S (B, k), Vh (B, k, n)
    with k = min(m, n, R). ``up = Qu·Ru`` (only Ru is formed), ``downᵀ = Qd·Rd``; the SVD of the small core
    ``Ru·Rdᵀ = Uc·S·Vcᵀ`` gives ``Vh = Vcᵀ·Qdᵀ`` (and U = Qu·Uc, which :meth:`SVD.us` never needs)."""
    ru = torch.linalg.qr(up, mode="r").R  # (B, k1, R)
    qd, rd = torch.linalg.qr(down.transpose(-1, -2))  # (B, n, k2), (B, k2, R)
    _, s, vch = torch.linalg.svd(ru @ rd.transpose(-1, -2), full_matrices=False)
    return s, vch @ qd.transpose(-1, -2)


def dense_svd(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD of a batch of matrices (B, m, n) (``torch.linalg.svd``, full_matrices=False)."""
    return torch.linalg.svd(matrix, full_matrices=False)


def _group_key(d: Delta) -> tuple:
    return (d.rows, d.cols, d.rank_bound if d.factored else -1)


def svd_all(
    deltas: Sequence[Delta],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int], None] | None = None,
) -> list[SVD]:
    """The thin SVD of every delta, in order. Deltas of equal shape (and equal rank for products) go through one
    batched call on ``device`` (results come back on the CPU); ``progress(n)`` is called after each batch of n."""
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(deltas):
        groups.setdefault(_group_key(d), []).append(i)
    out: list[SVD | None] = [None] * len(deltas)
    for (rows, cols, rank), members in groups.items():
        per = rows * cols if rank < 0 else (rows + cols) * rank
        step = max(1, _BATCH_ELEMENTS // max(per, 1))
        for start in range(0, len(members), step):
            chunk = members[start : start + step]
            if rank < 0:
                u, s, vh = dense_svd(torch.stack([deltas[i].dense for i in chunk]).to(device, dtype))
                for j, i in enumerate(chunk):
                    out[i] = SVD(s[j].cpu(), vh[j].cpu(), U=u[j].cpu())
            else:
                up = torch.stack([deltas[i].up for i in chunk]).to(device, dtype)
                down = torch.stack([deltas[i].down for i in chunk]).to(device, dtype)
                s, vh = factored_svd(up, down)
                for j, i in enumerate(chunk):
                    out[i] = SVD(s[j].cpu(), vh[j].cpu(), factors=(deltas[i].up, deltas[i].down))
            if progress is not None:
                progress(len(chunk))
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------------ rank rules
def dynamic_rank(S: Tensor, method: str, param: float) -> int:
    """sd-scripts' dynamic rank of one module (``S`` descending, of length k), before the cap:

    * ``sv_ratio``: the number of singular values larger than S₀ / param;
    * ``sv_cumulative``: the smallest r with Σᵢ<r Sᵢ / Σ S ≥ param;
    * ``sv_fro``: the smallest r with Σᵢ<r Sᵢ² / Σ S² ≥ param² (the Frobenius norm kept is at least ``param``);

    each clamped to [1, k].
    """
    k = int(S.numel())
    S = S.double()
    if method == "sv_ratio":
        r = int((S > S[0] / param).sum())
    elif method == "sv_cumulative":
        r = int(torch.searchsorted(torch.cumsum(S, 0) / S.sum(), torch.tensor([param], dtype=S.dtype))) + 1
    elif method == "sv_fro":
        sq = S.square()
        r = int(torch.searchsorted(torch.cumsum(sq, 0) / sq.sum(), torch.tensor([param**2], dtype=S.dtype))) + 1
    else:
        raise ValueError(f"unknown dynamic method {method!r}; expected one of {', '.join(DYNAMIC_METHODS)}")
    return max(1, min(r, k))


def select_rank(S: Tensor, cap: int, method: str | None = None, param: float | None = None) -> int:
    """The rank kept for one module: ``cap`` (fixed), or the dynamic rank capped at ``cap``; never more than the
    number of singular values; 1 for a zero matrix (S₀ ≤ 1e-6), as sd-scripts."""
    if S.numel() == 0 or float(S[0]) <= MIN_SV:
        return 1
    rank = cap if method is None else min(dynamic_rank(S, method, float(param)), cap)
    return max(1, min(rank, int(S.numel())))


@dataclass(frozen=True)
class Retained:
    """What a rank-r truncation keeps: Σ S (fraction), Frobenius norm (fraction), S₀ / S_{r-1}."""

    sum: float
    fro: float
    max_ratio: float


def retained(S: Tensor, rank: int) -> Retained:
    S = S.double().abs()
    total, fro = float(S.sum()), float(S.square().sum().sqrt())
    if rank == 0 or total == 0.0:
        return Retained(1.0 if total == 0.0 else 0.0, 1.0 if fro == 0.0 else 0.0, float("nan"))
    kept = S[:rank]
    return Retained(float(kept.sum()) / total, float(kept.square().sum().sqrt()) / fro, float(S[0] / S[rank - 1]))


# ------------------------------------------------------------------------------------------------------ truncation
def to_lora(
    svd: SVD, rank: int | Tensor, shape: tuple[int, ...], scale: float = 1.0, file_layout: tuple[int, ...] | None = None
) -> tuple[Tensor, Tensor]:
    """LoRA tensors (up, down) of the truncation to ``rank`` (or to the singular values a boolean mask keeps), with
    ΔW ≈ scale · up @ down: ``up = U·S / scale``, ``down = Vh``.

    ``shape``: the base weight shape. Conv weights give down (r, in, kh, kw) and up (out, r, 1, 1); Linear (r, in),
    (out, r). ``file_layout``: the dimensionality of the input file's ``lora_down`` (SD2's 1x1 ``proj_in`` is 4-D
    in some files, 2-D in others) so the output keeps it.
    """
    index = slice(0, rank) if isinstance(rank, int) else rank
    up = svd.us(index) / scale
    down = svd.Vh[index]
    r = int(down.shape[0])
    dims = len(file_layout) if file_layout is not None else len(shape)
    if dims == 4:
        kernel = shape[2:] if len(shape) == 4 else (1, 1)
        return up.reshape(shape[0], r, 1, 1).contiguous(), down.reshape(r, shape[1], *kernel).contiguous()
    return up.contiguous(), down.reshape(r, -1).contiguous()


def quantile(values: Tensor, q: float) -> Tensor:
    """The ``q`` quantile with linear interpolation (as ``torch.quantile``), for tensors of any size."""
    flat = values.flatten().float().sort().values
    pos = q * (flat.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, flat.numel() - 1)
    return flat[lo] + (flat[hi] - flat[lo]) * (pos - lo)


def clamp_factors(up: Tensor, down: Tensor, q: float | None) -> tuple[Tensor, Tensor]:
    """sd-scripts' outlier clamp (extract_lora_from_models / svd_merge_lora): both factors clipped to ±the ``q``
    quantile of all their entries. ``q`` None or ≥ 1: unchanged."""
    if q is None or q >= 1.0:
        return up, down
    hi = quantile(torch.cat([up.flatten(), down.flatten()]), q)
    return up.clamp(-hi, hi), down.clamp(-hi, hi)
