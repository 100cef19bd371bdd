"""Full / "diff": the whole weight change stored as it is (LyCORIS ``FullModule``, native fine-tuning as an adapter).

File layout (LyCORIS, docs/formats.md "Full / diff"): ``<name>.diff`` with the base weight's own shape
(out, in[, kh, kw]) and, when the base layer has a bias, ``<name>.diff_b`` (out,). No ``alpha``: LyCORIS ignores
``--network_dim`` / ``--network_alpha`` for this algorithm, so the scale is 1.

    ΔW = diff          Δb = diff_b          y = op(x, W + m·ΔW, b + m·Δb)     (m = multiplier)

Init (LyCORIS): diff = 0 and diff_b = 0, so ΔW = 0. A full module has as many parameters as its base layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import Algorithm

FILE_KEYS = {"diff": "diff", "diff_b": "diff_b"}


def init_params(
    base_shape: tuple[int, ...],
    rank: int | None = None,
    *,
    has_bias: bool = True,
    device: Any = None,
    dtype: Any = None,
    **_: Any,
) -> dict[str, Tensor]:
    """Zero ``diff`` of ``base_shape`` and, when the base layer has a bias (``has_bias``), zero ``diff_b`` (out,).
    ``rank`` is ignored (as in LyCORIS)."""
    params = {"diff": torch.zeros(base_shape, device=device, dtype=dtype)}
    if has_bias:
        params["diff_b"] = torch.zeros(base_shape[0], device=device, dtype=dtype)
    return params


def delta_weight(params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...], **_: Any) -> Tensor:
    """ΔW = diff (times ``scale``, which is 1 for files: no alpha), in ``shape``."""
    delta = params["diff"].reshape(shape)
    return delta if isinstance(scale, float) and scale == 1.0 else delta * scale


def delta_bias(params: Mapping[str, Tensor], scale: float) -> Tensor | None:
    """Δb = diff_b (out,), or None when the module has none."""
    diff_b = params.get("diff_b")
    if diff_b is None:
        return None
    return diff_b if isinstance(scale, float) and scale == 1.0 else diff_b * scale


def rank(params: Mapping[str, Tensor]) -> None:
    return None


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {}


def norm_exponents(params: Mapping[str, Tensor]) -> dict[str, float]:
    """ΔW and Δb are linear in diff and diff_b: max-norm scales both by the same ratio."""
    return {k: 1.0 for k in params}


ALGORITHM = Algorithm(
    name="full",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    delta_bias=delta_bias,
    has_alpha=False,
    norm_exponents=norm_exponents,
)
