"""DoRA: weight decomposition into magnitude and direction, on top of any ΔW (LoRA, LoHa, LoKr).

Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", ICML 2024, arXiv:2402.09353:

    W' = m ⊙ (W + ΔW) / ‖W + ΔW‖

with a learned magnitude ``m`` initialised to ‖W‖, so a fresh adapter (ΔW = 0) gives W' = W. The norm is taken per
**output row** (over every axis but 0), as PEFT and LyCORIS ≥ 3.2 (``wd_on_output=True``) do; the magnitude is
stored as ``dora_scale`` with shape (out, 1[, 1, 1]). Files written by LyCORIS 2.2–3.1 hold a per-**input-column**
magnitude of shape (1, in[, 1, 1]) (norm over every axis but 1); :func:`dora_weight` reads the axis from the
magnitude's shape, so both load. As in LyCORIS, ``torch.finfo(dtype).eps`` is added to the norm.
ΔW here is the algorithm's full ΔW (alpha / r applied); the multiplier is applied afterwards by the caller.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _norm(weight: Tensor, axis: str) -> Tensor:
    """‖W‖ per output row (shape (out, 1, ...)) or per input column (shape (1, in, 1, ...))."""
    trailing = [1] * (weight.dim() - 1)
    if axis == "out":
        return weight.reshape(weight.shape[0], -1).norm(dim=1).reshape(weight.shape[0], *trailing)
    cols = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
    return cols.reshape(1, weight.shape[1], *trailing[1:])


def init_magnitude(weight: Tensor, axis: str = "out") -> Tensor:
    """The DoRA magnitude of a base weight: ‖W‖ per output row (``axis="out"``) or per input column (``"in"``)."""
    if axis not in ("out", "in"):
        raise ValueError(f"DoRA axis must be 'out' or 'in', got {axis!r}")
    return _norm(weight.detach().float(), axis)


def magnitude_axis(magnitude: Tensor, weight_shape: tuple[int, ...]) -> str:
    """``"out"`` or ``"in"``: which axis a stored magnitude (``dora_scale``) normalises, from its shape.

    Raises ``ValueError`` when the shape fits neither (out, 1, ...) nor (1, in, ...) of ``weight_shape``.
    """
    out_dim, in_dim = weight_shape[0], weight_shape[1]
    rest = tuple(magnitude.shape[2:])
    if magnitude.dim() == len(weight_shape) and all(r == 1 for r in rest):
        if magnitude.shape[0] == out_dim and magnitude.shape[1] == 1:
            return "out"
        if magnitude.shape[0] == 1 and magnitude.shape[1] == in_dim:
            return "in"
    raise ValueError(
        f"dora_scale of shape {tuple(magnitude.shape)} fits neither the per-output ({out_dim}, 1, ...) nor the "
        f"per-input (1, {in_dim}, ...) layout of a weight of shape {tuple(weight_shape)}"
    )


def dora_weight(weight: Tensor, delta: Tensor, magnitude: Tensor) -> Tensor:
    """W' = magnitude · (W + ΔW) / (‖W + ΔW‖ + eps), the norm along the axis ``magnitude``'s shape names.

    ``weight``: base weight (out, in[, kh, kw]); ``delta``: ΔW in the same shape; ``magnitude``: (out, 1[, 1, 1])
    or (1, in[, 1, 1]). Returns the decomposed weight W' (same shape, dtype of ``delta``).
    """
    merged = weight.to(delta.dtype) + delta
    axis = magnitude_axis(magnitude, tuple(weight.shape))
    norm = _norm(merged, axis) + torch.finfo(merged.dtype).eps
    return merged * (magnitude.to(merged.dtype) / norm)
