"""Extracting a LoRA from two models: the per-module SVD of W_tuned - W_org (the extract script's engine).

Extract a LoRA from two models (sd-scripts' ``networks/extract_lora_from_models.py``): per target module
ΔW = W_tuned − W_org, truncated by SVD to ``dim`` (3x3 convs to ``conv_dim``; without it they are not extracted).

Targets are the modules ``networks.lora`` trains (``networks.targets``: Transformer2DModel + CLIP attention / MLP,
plus ResnetBlock2D / Downsample2D / Upsample2D with ``conv_dim``), named by the model family. As sd-scripts:
``up = U·S``, ``down = Vh``, alpha = rank; both factors clamped at the ``clamp_quantile`` quantile of their
values (1.0: no clamp, the exact best rank-r approximation); the text encoders are left out when no weight of
theirs differs by more than ``min_diff``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from library.families.base import Parts
from library.families.protocol import ModelFamily

from .lowrank import Delta, clamp_factors, svd_all, to_lora
from .targets import Target, builtin_preset, find_targets
from .tool_common import progress

logger = logging.getLogger(__name__)
_CHUNK_ELEMENTS = 1 << 26  # ΔW elements held at once


@dataclass(frozen=True)
class ExtractOptions:
    dim: int = 4
    conv_dim: int | None = None
    clamp_quantile: float | None = 0.99
    min_diff: float = 0.01
    device: str | None = None


def targets(family: ModelFamily, parts: Parts, conv: bool) -> list[Target]:
    """The modules networks.lora would adapt (with conv blocks when ``conv``), in model order: the family's
    ``target_classes``; a fused module's weight is its leaves' rows stacked, so ΔW is their stacked difference."""
    classes = family.target_classes
    base = builtin_preset("kohya", classes)
    preset = replace(base, unet_classes=base.unet_classes + classes.conv_blocks, enable_conv=True) if conv else base
    return find_targets(family.adapter_roots(parts), preset, conv=conv, train_norm=False)


def paired_targets(family: ModelFamily, org: Parts, tuned: Parts, conv: bool) -> list[tuple[Target, Target]]:
    """(original, tuned) module pairs by kohya name; ``ValueError`` when the architectures differ."""
    a, b = targets(family, org, conv), {t.name: t for t in targets(family, tuned, conv)}
    missing = [t.name for t in a if t.name not in b]
    wrong = [f"{t.name} {tuple(t.module.weight.shape)} vs {tuple(b[t.name].module.weight.shape)}"
             for t in a if t.name in b and t.module.weight.shape != b[t.name].module.weight.shape]  # fmt: skip
    if missing or wrong or len(b) != len(a):
        detail = f"missing in the tuned model: {missing[:3]}" if missing else f"shapes differ: {wrong[:3]}"
        raise ValueError(f"the original and tuned models have different architectures ({detail})")
    return [(t, b[t.name]) for t in a]


def text_encoders_differ(pairs: Sequence[tuple[Target, Target]], min_diff: float) -> bool:
    """Whether any text-encoder weight differs by more than ``min_diff`` (sd-scripts' test for extracting the TE)."""
    for org, tuned in pairs:
        if not org.is_unet:
            diff = (tuned.module.weight.float() - org.module.weight.float()).abs().max()
            if float(diff) > min_diff:
                return True
    return False


def _delta(org: Target, tuned: Target, device: str | None) -> Delta:
    w = tuned.module.weight.to(device, torch.float32) - org.module.weight.to(device, torch.float32)
    return Delta(tuple(w.shape), dense=w.reshape(w.shape[0], -1))


def extract(family: ModelFamily, org: Parts, tuned: Parts, opts: ExtractOptions) -> tuple[dict[str, Tensor], bool]:
    """The LoRA state dict and whether the text encoders were extracted (see the module docstring)."""
    pairs = paired_targets(family, org, tuned, conv=bool(opts.conv_dim))
    with_te = text_encoders_differ(pairs, opts.min_diff)
    if not with_te:
        logger.warning("Text encoder is same. Extract U-Net only.")
        pairs = [p for p in pairs if p[0].is_unet]
    names = [o.name for o, _ in pairs]
    pairs.sort(key=lambda p: tuple(p[0].module.weight.shape))  # equal shapes batch together
    out: dict[str, Tensor] = {}
    bar = progress(len(pairs), "extracting")
    start = 0
    while start < len(pairs):
        chunk, size = [], 0
        while start < len(pairs) and (not chunk or size < _CHUNK_ELEMENTS):
            chunk.append(pairs[start])
            size += pairs[start][0].module.weight.numel()
            start += 1
        deltas = [_delta(o, t, opts.device) for o, t in chunk]
        for (o, _), delta, svd in zip(chunk, deltas, svd_all(deltas, device=opts.device)):
            rank = min(opts.conv_dim if o.kind == "conv" else opts.dim, int(svd.S.numel()))
            up, down = clamp_factors(*to_lora(svd, rank, delta.shape), opts.clamp_quantile)
            out[f"{o.name}.lora_up.weight"], out[f"{o.name}.lora_down.weight"] = up, down
            out[f"{o.name}.alpha"] = torch.tensor(float(rank))
        bar.update(len(chunk))
    bar.close()
    keys = [f"{n}.{s}" for n in names for s in ("lora_down.weight", "lora_up.weight", "alpha")]
    return {k: out[k] for k in keys}, with_te


def extract_metadata(
    family: ModelFamily, parts: Parts, opts: ExtractOptions, title: str, prediction: str
) -> dict[str, str]:
    """sd-scripts' metadata of an extracted LoRA (+ ModelSpec)."""
    from library.files import metadata as md

    args = {"conv_dim": str(opts.conv_dim), "conv_alpha": str(float(opts.conv_dim))} if opts.conv_dim else None
    meta = {
        "ss_v2": str(family.ss_v2),
        "ss_base_model_version": family.base_model_version(prediction),
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(opts.dim),
        "ss_network_alpha": str(float(opts.dim)),
        "ss_network_args": json.dumps(args) if args else "null",
    }
    spec = md.modelspec(
        architecture=family.modelspec_architecture("lora", prediction),
        implementation=family.modelspec_implementation("lora"),
        title=title,
        resolution=family.default_resolution(prediction),
        prediction_type=prediction,
    )
    return {**meta, **spec}


# ------------------------------------------------------------------------------------------------ two weight files
def extract_from_state_dicts(
    names: dict[str, str],
    org,
    tuned,
    opts: ExtractOptions,
) -> dict[str, Tensor]:
    """A LoRA from two state dicts of one architecture (``names``: {kohya module name: weight key}; ``org`` /
    ``tuned``: mappings read one tensor at a time, e.g. ``weight_files.SafetensorsReader``): per module ΔW = tuned −
    org in float32 on ``opts.device``, truncated by SVD to ``opts.dim`` (up = U·S, down = Vh, alpha = rank, factors
    clamped at ``opts.clamp_quantile``), in chunks of at most ~2^26 ΔW elements. Modules whose largest |ΔW| is at most
    ``opts.min_diff`` (when > 0) are left out."""
    out: dict[str, Tensor] = {}
    items = list(names.items())
    bar = progress(len(items), "extracting")
    start = 0
    while start < len(items):
        chunk: list[tuple[str, Delta]] = []
        size = 0
        while start < len(items) and (not chunk or size < _CHUNK_ELEMENTS):
            name, key = items[start]
            w = tuned[key].to(opts.device, torch.float32) - org[key].to(opts.device, torch.float32)
            start += 1
            if opts.min_diff > 0 and float(w.abs().max()) <= opts.min_diff:
                bar.update(1)
                continue
            chunk.append((name, Delta(tuple(w.shape), dense=w.reshape(w.shape[0], -1))))
            size += w.numel()
        for (name, delta), svd in zip(chunk, svd_all([d for _, d in chunk], device=opts.device)):
            rank = min(opts.dim, int(svd.S.numel()))
            up, down = clamp_factors(*to_lora(svd, rank, delta.shape), opts.clamp_quantile)
            out[f"{name}.lora_up.weight"], out[f"{name}.lora_down.weight"] = up, down
            out[f"{name}.alpha"] = torch.tensor(float(rank))
        bar.update(len(chunk))
    bar.close()
    keys = [f"{n}.{s}" for n in names for s in ("lora_down.weight", "lora_up.weight", "alpha")]
    return {k: out[k] for k in keys if k in out}
