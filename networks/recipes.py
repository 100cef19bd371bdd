"""Resize score recipes (elias-gaeros/resize_lora ``-r``): which singular values a resize keeps.

Score recipes of elias-gaeros/resize_lora (``-r fro_ckpt=1,thr=-3.55``): which singular values to keep, judged
against the base model's weights.

A recipe is comma-separated ``key=value`` pairs; several recipes are separated by ``:`` (one output each). Each
kept singular value σᵢ of a module's ΔW (alpha / r applied) gets the score

    log10(σᵢ · rescale) − Σₖ wₖ · log10(refₖ)        (weights wₖ normalised to sum 1: a weighted geometric mean)

with the references (W = the base model's weight of the module, flattened to 2-D; uᵢ, vᵢ its singular vectors):

    spn_ckpt  σ_max(W)          spn_lora  σ₀ (the module's largest; ≈ sd-scripts' sv_ratio)
    fro_ckpt  ‖W‖_F              fro_lora  ‖ΔW‖_F
    subspace  |uᵢᵀ W vᵢ|        params    out + in·kh·kw (elements per rank)

and is kept when it is above ``thr`` (log10: -1 keeps σᵢ > ref / 10), or, with ``size`` (MiB), the highest scores
are kept until the output would exceed that size (greedy, over all modules). ``rescale`` multiplies ΔW. A key
without value is weight 1 (``fro_ckpt`` = ``fro_ckpt=1``). A module can lose every rank (it is then left out).
Keys, scores and the size rule follow the project's README and resize_lora.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from library.cli.problems import ConfigError

from .lowrank import SVD

SCORE_KEYS = ("spn_ckpt", "spn_lora", "fro_ckpt", "fro_lora", "subspace", "params")
BASE_KEYS = ("spn_ckpt", "fro_ckpt", "subspace")  # need the base model's weights
OTHER_KEYS = ("thr", "size", "rescale")


@dataclass(frozen=True)
class Recipe:
    """One parsed recipe: normalised score ``weights``, ``threshold`` (log10) or ``size_mib``, ``rescale``."""

    text: str
    weights: Mapping[str, float]
    threshold: float | None = None
    size_mib: float | None = None
    rescale: float = 1.0

    @property
    def needs_base(self) -> bool:
        return any(abs(self.weights.get(k, 0.0)) > 1e-6 for k in BASE_KEYS)

    @property
    def file_tag(self) -> str:
        """The output-name part resize_lora.py uses: ``frockpt1``, ``spnlora0.5_spnckpt0.5``, + scale / size."""
        parts = [f"{k.replace('_', '')}{fmt(v)}" for k, v in sorted(self.weights.items()) if v != 0.0]
        if self.rescale != 1.0:
            parts.append(f"scale{fmt(self.rescale)}")
        if self.size_mib is not None:
            parts.append(f"size{fmt(self.size_mib)}")
        return "_".join(parts)


def fmt(value: float, places: int = 2) -> str:
    """``1.0`` -> ``1``, ``-3.55`` -> ``-3.55``, ``0.333`` -> ``0.33``."""
    return f"{value:.{places}f}".rstrip("0").rstrip(".")


def parse_recipe(text: str) -> Recipe:
    """Parse one recipe; ``ValueError`` naming the recipe and every problem in it."""
    weights = {k: 0.0 for k in SCORE_KEYS}
    other: dict[str, float] = {}
    problems = []
    for part in text.split(","):
        key, eq, raw = (s.strip() for s in part.partition("="))
        if key not in SCORE_KEYS and key not in OTHER_KEYS:
            problems.append(f"unknown key {key!r} (known: {', '.join(SCORE_KEYS + OTHER_KEYS)})")
            continue
        if not raw and key in OTHER_KEYS:
            problems.append(f"{key} needs a value ({key}=...)")
            continue
        try:
            value = float(raw) if raw else 1.0
        except ValueError:
            problems.append(f"{key}={raw}: not a number")
            continue
        (weights if key in SCORE_KEYS else other)[key] = value
    total = sum(weights.values())
    if not problems and total == 0.0:
        problems.append(f"give at least one score weight ({', '.join(SCORE_KEYS)})")
    if "thr" in other and "size" in other:
        problems.append("give either thr (a log10 threshold) or size (MiB), not both")
    elif not problems and "thr" not in other and "size" not in other:
        problems.append("give a threshold thr=<log10> or a target size size=<MiB>")
    if "size" in other and other["size"] <= 0:
        problems.append(f"size={fmt(other['size'])}: must be > 0 MiB")
    if other.get("rescale", 1.0) <= 0:
        problems.append("rescale must be > 0")
    if problems:
        raise ValueError(f"recipe {text!r}: " + "; ".join(problems))
    return Recipe(
        text=text,
        weights={k: v / total for k, v in weights.items()},
        threshold=other.get("thr"),
        size_mib=other.get("size"),
        rescale=other.get("rescale", 1.0),
    )


def parse_recipes(text: str) -> list[Recipe]:
    """``recipe:recipe:...`` -> recipes; every recipe's problems in one ``ConfigError``."""
    out, problems = [], []
    for part in text.split(":"):
        try:
            out.append(parse_recipe(part))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems, "--score_recipes")
    return out


def base_norms(weight: Tensor) -> tuple[float, float]:
    """(‖W‖_F, σ_max(W)) of a base weight, flattened to (out, in·kh·kw), in float32."""
    w = weight.detach().float().reshape(weight.shape[0], -1)
    return float(torch.linalg.matrix_norm(w, "fro")), float(torch.linalg.matrix_norm(w, 2))


def scores(recipe: Recipe, svd: SVD, rows: int, base: Tensor | None, norms: tuple[float, float] | None) -> Tensor:
    """log10 scores (k,) of one module's singular values (see the module docstring). ``rows``: ΔW's output size;
    ``base``: the base weight (needed for ``subspace``); ``norms``: :func:`base_norms` of it (for ``fro_ckpt`` /
    ``spn_ckpt``)."""
    w = recipe.weights
    S = svd.S.double().clamp_min(1e-300)
    out = torch.log10(S) + math.log10(recipe.rescale)
    if abs(w["spn_lora"]) > 1e-6:
        out -= w["spn_lora"] * torch.log10(S[0])
    if abs(w["fro_lora"]) > 1e-6:
        out -= w["fro_lora"] * torch.log10(torch.linalg.vector_norm(S))
    if abs(w["params"]) > 1e-6:
        out -= w["params"] * math.log10(rows + svd.Vh.shape[1])
    if abs(w["fro_ckpt"]) > 1e-6:
        out -= w["fro_ckpt"] * math.log10(norms[0])
    if abs(w["spn_ckpt"]) > 1e-6:
        out -= w["spn_ckpt"] * math.log10(norms[1])
    if abs(w["subspace"]) > 1e-6:
        W = base.detach().double().reshape(base.shape[0], -1)
        along = torch.einsum("ok,oi,ki->k", svd.u().double(), W, svd.Vh.double()).abs().clamp_min(1e-300)
        out -= w["subspace"] * torch.log10(along)
    return out


def size_threshold(recipe: Recipe, module_scores: Sequence[Tensor], bytes_per_rank: Sequence[int]) -> float:
    """The threshold that keeps the best-scoring ranks of all modules within ``recipe.size_mib`` (greedy)."""
    flat = torch.cat([s.double() for s in module_scores])
    costs = torch.cat([torch.full((s.numel(),), b, dtype=torch.float64) for s, b in zip(module_scores, bytes_per_rank)])
    ordered, order = flat.sort(descending=True)
    cumulative = costs[order].cumsum(0)
    target = recipe.size_mib * (1 << 20)
    if cumulative.numel() == 0 or target >= float(cumulative[-1]):
        return -math.inf
    return float(ordered[int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64)))])
