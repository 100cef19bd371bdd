"""Resize an adapter file to a new rank (sd-scripts' ``networks/resize_lora.py``), by SVD of each module's ΔW.

Any algorithm goes in (LoRA/LoCon, tucker, LoHa, LoKr, DoRA with the base weights); a LoRA comes out. Per module
the rank is fixed (``new_rank`` for Linear / 1x1 conv, ``new_conv_rank`` for larger kernels), chosen by one of
sd-scripts' dynamic methods capped at that rank, or chosen by an elias-gaeros score recipe (``networks.recipes``).
The kept part is the rank-r truncation of the SVD, the best rank-r approximation of ΔW (Eckart-Young).

A LoRA input keeps its effective scale: new alpha = (old alpha / old rank) · new rank, ``up = U·S / scale``,
``down = Vh`` (sd-scripts). Other inputs get alpha = new rank (scale 1). Norm modules are copied unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .deltas import AdapterFile
from .lowrank import SVD, Delta, Retained, retained, select_rank, to_lora
from .recipes import Recipe, base_norms, scores, size_threshold


@dataclass(frozen=True)
class ResizeOptions:
    """``new_rank`` / ``new_conv_rank`` (None: = new_rank): fixed ranks, or caps for the dynamic methods."""

    new_rank: int | None = 4
    new_conv_rank: int | None = None
    dynamic_method: str | None = None
    dynamic_param: float | None = None

    def cap(self, shape: tuple[int, ...]) -> int:
        conv = len(shape) == 4 and tuple(shape[2:]) != (1, 1)
        rank = self.new_conv_rank if conv and self.new_conv_rank is not None else self.new_rank
        return rank if rank is not None else math.inf


@dataclass
class ModuleReport:
    """One module of a resize: ranks before and after, the new alpha and what the truncation kept."""

    name: str
    old_rank: int | None
    new_rank: int
    alpha: float
    kept: Retained
    conv: bool

    def line(self) -> str:
        k = self.kept
        return (f"{self.name:75} | dim {self.old_rank} -> {self.new_rank}, alpha {self.alpha:g} | sum(S) retained: "
                f"{k.sum:.1%}, fro retained: {k.fro:.1%}, max(S) ratio: {k.max_ratio:0.1f}")  # fmt: skip


@dataclass
class Resized:
    """The new state dict, per-module reports, modules left out (all ranks dropped) and the recipe threshold."""

    state_dict: dict[str, Tensor]
    reports: list[ModuleReport]
    dropped: list[str] = field(default_factory=list)
    threshold: float | None = None

    @property
    def mean_fro(self) -> float:
        values = [r.kept.fro for r in self.reports if not math.isnan(r.kept.fro)]
        return sum(values) / len(values) if values else float("nan")


def _is_conv(shape: tuple[int, ...]) -> bool:
    return len(shape) == 4 and tuple(shape[2:]) != (1, 1)


def _out_scale(file: AdapterFile, name: str) -> float:
    """The scale (alpha / r) of the output module: the input's for LoRA, 1 otherwise."""
    return file.scale_of(name) if file.algos[name] == "lora" else 1.0


def _emit(
    file: AdapterFile, name: str, svd: SVD, delta: Delta, keep: int | Tensor, out: dict[str, Tensor], gain: float = 1.0
) -> tuple[int, float]:
    """Write the module's LoRA tensors (ΔW times ``gain``) into ``out``; returns (rank, alpha)."""
    scale = _out_scale(file, name)
    layout = tuple(file.modules[name]["lora_down.weight"].shape) if file.algos[name] == "lora" else None
    if layout is not None and "lora_mid.weight" in file.modules[name]:
        layout = None
    up, down = to_lora(svd, keep, delta.shape, scale / gain, layout)
    rank = int(down.shape[0])
    alpha = scale * rank
    out[f"{name}.lora_down.weight"] = down
    out[f"{name}.lora_up.weight"] = up
    out[f"{name}.alpha"] = torch.tensor(alpha)
    return rank, alpha


def resize_by_rank(
    file: AdapterFile, deltas: Mapping[str, Delta], svds: Mapping[str, SVD], opts: ResizeOptions
) -> Resized:
    """Fixed or dynamic (sd-scripts) ranks; see the module docstring."""
    out: dict[str, Tensor] = {}
    reports = []
    for name, delta in deltas.items():
        svd = svds[name]
        rank = select_rank(svd.S, opts.cap(delta.shape), opts.dynamic_method, opts.dynamic_param)
        rank, alpha = _emit(file, name, svd, delta, rank, out)
        reports.append(
            ModuleReport(name, file.rank_of(name), rank, alpha, retained(svd.S, rank), _is_conv(delta.shape))
        )
    return Resized(out, reports)


def resize_by_recipe(
    file: AdapterFile,
    deltas: Mapping[str, Delta],
    svds: Mapping[str, SVD],
    recipe: Recipe,
    base_weights: Callable[[str], Tensor | None],
    elem_size: int,
    cap: ResizeOptions | None = None,
) -> Resized:
    """An elias-gaeros recipe: keep σᵢ with score > threshold (``thr``, or the one that meets ``size``).
    ``base_weights(name)``: the base model's weight of a module (None without a base model). Modules whose ΔW is
    zero or that keep no rank are left out. ``cap``: optional per-kind rank limits (``--new_rank``)."""
    names = [n for n in deltas if float(svds[n].S[0]) >= 1e-6] if deltas else []
    all_scores = {}
    for name in names:
        weight = base_weights(name) if recipe.needs_base else None
        norms = base_norms(weight) if weight is not None else None
        all_scores[name] = scores(recipe, svds[name], deltas[name].rows, weight, norms)
    if recipe.size_mib is not None:
        sizes = [elem_size * (deltas[n].rows + deltas[n].cols) for n in names]
        threshold = size_threshold(recipe, [all_scores[n] for n in names], sizes)
    else:
        threshold = recipe.threshold
    out: dict[str, Tensor] = {}
    reports, dropped = [], [n for n in deltas if n not in all_scores]
    for name in names:
        svd, mask = svds[name], all_scores[name] > threshold
        if cap is not None:
            mask &= torch.arange(mask.numel()) < cap.cap(deltas[name].shape)
        if not bool(mask.any()):
            dropped.append(name)
            continue
        rank, alpha = _emit(file, name, svd, deltas[name], mask, out, gain=recipe.rescale)
        kept = retained(svd.S, rank) if bool(mask[:rank].all()) else _masked_retained(svd.S, mask)
        reports.append(ModuleReport(name, file.rank_of(name), rank, alpha, kept, _is_conv(deltas[name].shape)))
    return Resized(out, reports, dropped, threshold)


def _masked_retained(S: Tensor, mask: Tensor) -> Retained:
    S = S.double()
    kept = S[mask]
    return Retained(float(kept.sum() / S.sum()), float(kept.norm() / S.norm()), float(S[0] / kept[-1]))


def add_norm_modules(out: dict[str, Tensor], norms: Mapping[str, Mapping[str, Tensor]]) -> None:
    """Copy norm modules (``w_norm`` / ``b_norm``) unchanged into ``out``."""
    for name, tensors in norms.items():
        for suffix, t in tensors.items():
            out[f"{name}.{suffix}"] = t


# ------------------------------------------------------------------------------------------------------ metadata
def _uniform(values: list[float | int]) -> str:
    distinct = sorted(set(values))
    if len(distinct) == 1:
        return str(distinct[0])
    return "Dynamic" if distinct else "None"


def resized_metadata(file: AdapterFile, result: Resized, how: str) -> dict[str, str]:
    """The input's metadata with ss_network_dim / ss_network_alpha (``Dynamic`` when modules differ),
    conv_dim / conv_alpha in ss_network_args, ss_network_module (a LyCORIS input becomes networks.lora) and
    ``how`` prepended to ss_training_comment. Hashes are added by the caller."""
    meta = {k: v for k, v in file.metadata.items() if not k.startswith("sshs_")}
    linear = [r for r in result.reports if not r.conv]
    conv = [r for r in result.reports if r.conv]
    meta["ss_network_dim"] = _uniform([r.new_rank for r in linear])
    meta["ss_network_alpha"] = _uniform([r.alpha for r in linear])
    lycoris_in = any(a not in ("lora", "norm") for a in file.algos.values()) or any(
        "dora_scale" in t for t in file.modules.values()
    )
    try:
        args = json.loads(meta.get("ss_network_args") or "null") or {}
    except json.JSONDecodeError:
        args = {}
    if lycoris_in or not isinstance(args, dict):
        args = {}
        meta["ss_network_module"] = "networks.lora"
    meta.setdefault("ss_network_module", "networks.lora")
    for key in ("conv_dim", "conv_alpha"):
        args.pop(key, None)
    if conv:
        args["conv_dim"] = _uniform([r.new_rank for r in conv])
        args["conv_alpha"] = _uniform([r.alpha for r in conv])
    meta["ss_network_args"] = json.dumps(args) if args else "null"
    comment = meta.get("ss_training_comment", "")
    meta["ss_training_comment"] = f"{how}; {comment}" if comment and comment != "None" else how
    return meta


def resize_file(
    file: AdapterFile,
    index,
    *,
    opts: ResizeOptions,
    recipe: Recipe | None = None,
    device: str | None = None,
    elem_size: int = 2,
    show_progress: bool = True,
) -> Resized:
    """Resize every module of ``file`` (``index``: the module index shapes and base weights come from, see
    ``networks.deltas.resolve_index``): ΔW per module, batched SVDs, then ranks by ``opts`` or by ``recipe``."""
    from .deltas import file_deltas
    from .lowrank import svd_all
    from .tool_common import progress

    deltas, norms = file_deltas(file, index)
    bar = progress(len(deltas), f"SVD {file.path.name}") if show_progress else None
    svd_list = svd_all(list(deltas.values()), device=device, progress=bar.update if bar else None)
    if bar:
        bar.close()
    svds = dict(zip(deltas, svd_list))
    if recipe is None:
        result = resize_by_rank(file, deltas, svds, opts)
    else:

        def base_weight(name: str) -> Tensor | None:
            target = index.get(name) if index is not None else None
            return None if target is None or target.module.weight.is_meta else target.module.weight

        result = resize_by_recipe(file, deltas, svds, recipe, base_weight, elem_size, opts)
    add_norm_modules(result.state_dict, norms)
    return result


def describe(file: AdapterFile, opts: ResizeOptions, recipe: Recipe | None, result: Resized) -> str:
    """What was done, in sd-scripts' ss_training_comment wording."""
    ranks = [r for r in (file.rank_of(n) for n in file.modules if file.algos[n] != "norm") if r is not None]
    old = max(ranks) if ranks else "full"
    if recipe is not None:
        return f"Dynamic resize with recipe {recipe.text} (threshold {result.threshold:.3f}) from {old}"
    if opts.dynamic_method:
        return f"Dynamic resize with {opts.dynamic_method}: {opts.dynamic_param} from {old}"
    conv = "" if opts.new_conv_rank in (None, opts.new_rank) else f" (conv: {opts.new_conv_rank})"
    return f"dimension is resized from {old} to {opts.new_rank}{conv}"
