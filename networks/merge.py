"""Merging adapters: into a model, into one exact LoRA, or into one LoRA of a chosen rank (the engines).

Merging adapters: into a model checkpoint (any algorithm), into one LoRA exactly (ranks concatenated), or into
one LoRA of a chosen rank (SVD of the summed ΔW). The scripts are merge_lora.py / sdxl_merge_lora.py and
svd_merge_lora.py.

* Into a checkpoint: each file is injected with the training code (``network_from_state_dict``) at its ratio and
  baked in (``merge_into_base``): W ← W + ratio·ΔW (DoRA: W + ratio·(W' − W)), files applied in order.
* Concatenation: Σᵢ ratioᵢ·scaleᵢ·upᵢ@downᵢ = [ratio₁·scale₁·up₁ | ratio₂·scale₂·up₂ | ...] @ [down₁; down₂; ...]
  with alpha = the total rank (scale 1): the same ΔW, exactly, at the cost of the summed rank. (sd-scripts' default
  merge adds the up and down matrices themselves, which is not the sum of the ΔWs; it is not offered.)
* SVD merge: ΣΔW per module (any algorithm; a sum of LoRAs stays low-rank, so its SVD is cheap), truncated to the
  new rank; alpha = rank. sd-scripts clamps the factors at their 0.99 quantile; here only with --clamp_quantile.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from library.cli.problems import ConfigError, problems_of
from library.families import adapter_families, adapter_family_label
from library.families.base import Parts
from library.families.protocol import ModelFamily

from . import files
from .deltas import AdapterFile, file_deltas, fits, resolve_index, shape_from_tensors
from .layers import AdapterWeights
from .lowrank import Delta, clamp_factors, select_rank, sum_deltas, svd_all, to_lora
from .tool_common import progress


def check_same_family(files_: Sequence[AdapterFile]) -> list[str]:
    """Problems when adapter files cannot belong to one model: kohya prefixes of different families, different
    ``ss_base_model_version``."""
    problems = []
    # the families each file can be for (prefixes, narrowed by block names: SDXL and FLUX share lora_unet/lora_te1);
    # files conflict when no family fits them all
    kinds = {f.source: adapter_families({files.prefix_of(n) for n in f.modules}, f.modules) for f in files_}
    named = {k: v for k, v in kinds.items() if v}
    if named and not set.intersection(*(set(v) for v in named.values())):
        listing = ", ".join(f"{f.source} ({adapter_family_label({files.prefix_of(n) for n in f.modules}, f.modules)})"
                            for f in files_ if f.source in named)  # fmt: skip
        problems.append(f"the adapters are for different model families: {listing}")
    versions = {
        f.source: f.metadata["ss_base_model_version"] for f in files_ if f.metadata.get("ss_base_model_version")
    }
    base = {v.removesuffix("_v") for v in versions.values()}
    if len(base) > 1:
        problems.append("the adapters were trained on different base models (ss_base_model_version): "
                        + ", ".join(f"{k}: {v}" for k, v in versions.items()))  # fmt: skip
    return problems


def _all_modules(files_: Sequence[AdapterFile]) -> list[str]:
    names: dict[str, None] = {}
    for f in files_:
        names.update(dict.fromkeys(f.modules))
    return list(names)


# ------------------------------------------------------------------------------------------------- concatenation
def _lora_pair(f: AdapterFile, name: str, shape: tuple[int, ...] | None) -> tuple[Tensor, Tensor] | tuple[str, str]:
    """(scale·up, down) of a plain LoRA module, or (file, what it is) when it cannot be concatenated."""
    tensors = f.modules[name]
    if shape is None or f.algos[name] != "lora" or "lora_mid.weight" in tensors or "dora_scale" in tensors:
        what = "DoRA" if "dora_scale" in tensors else "tucker LoCon" if "lora_mid.weight" in tensors else f.algos[name]
        return f.source, f"{what} (not a plain LoRA)"
    own = shape_from_tensors("lora", tensors)
    if (own[0], math.prod(own[1:])) != (shape[0], math.prod(shape[1:])):
        return f.source, f"a ΔW of shape {own} where another file has {shape} (files for different models)"
    return AdapterWeights.from_file(files.fit_to_base(tensors, shape), "lora", name).factors()


def concat_merge(files_: Sequence[AdapterFile], ratios: Sequence[float]) -> dict[str, Tensor]:
    """One LoRA whose ΔW is exactly Σ ratioᵢ·ΔWᵢ per module (see the module docstring); norm modules are summed.
    ``ValueError`` listing, per file, the modules that are not plain LoRA or whose shapes differ between files."""
    out: dict[str, Tensor] = {}
    problems: list[str] = []
    bad: dict[tuple[str, str], list[str]] = {}
    for name in _all_modules(files_):
        entries = [(f, r) for f, r in zip(files_, ratios) if name in f.modules]
        first = entries[0][0]
        if first.algos[name] == "norm":
            _sum_norm(name, entries, out, problems)
            continue
        shape = shape_from_tensors("lora", first.modules[name]) if first.algos[name] == "lora" else None
        pairs = [_lora_pair(f, name, shape) for f, _ in entries]
        failed = [p for p in pairs if isinstance(p[0], str)]
        for key in failed:
            bad.setdefault(key, []).append(name)
        if failed:
            continue
        up = torch.cat([p[0].float() * r for p, (_, r) in zip(pairs, entries)], dim=1)
        down = torch.cat([p[1].float() for p in pairs], dim=0)
        layout = first.modules[name]["lora_down.weight"].shape
        rank = int(down.shape[0])
        out[f"{name}.lora_up.weight"] = up.reshape(up.shape[0], rank, *[1] * (len(layout) - 2))
        out[f"{name}.lora_down.weight"] = down.reshape(rank, *layout[1:])
        out[f"{name}.alpha"] = torch.tensor(float(rank))
    problems += [f"{src}: {len(names)} module(s) hold {what}, e.g. {', '.join(names[:3])}"
                 for (src, what), names in bad.items()]  # fmt: skip
    if problems:
        hint = ("concatenating ranks merges plain LoRA / LoCon only; use svd_merge_lora.py (any algorithm, a chosen "
                "rank) or merge into a checkpoint with --sd_model")  # fmt: skip
        raise ConfigError(problems, "adapter files", hint=hint)
    return out


def concat_file(files_: Sequence[AdapterFile], ratios: Sequence[float]) -> AdapterFile:
    """The exact concatenation as an in-memory :class:`AdapterFile` (metadata of the first file), named
    ``a+b(0.50)`` after its members, as elias-gaeros' resize_lora.py names a ``a.safetensors,b.safetensors:0.5``
    argument."""
    state = concat_merge(files_, ratios)
    name = "+".join(f.path.stem + (f"({r:.2f})" if abs(r - 1.0) > 1e-6 else "") for f, r in zip(files_, ratios))
    modules = files.group_by_module(state)
    algos = {n: "norm" if "w_norm" in t else "lora" for n, t in modules.items()}
    return AdapterFile(files_[0].path.with_name(f"{name}.safetensors"), modules, dict(files_[0].metadata), algos)


def _sum_norm(name: str, entries, out: dict[str, Tensor], problems: list[str]) -> None:
    for f, _ in entries:
        if f.algos[name] != "norm":
            problems.append(f"{f.source}: {name} is {f.algos[name]} here and a norm adapter in another file")
            return
    for suffix in entries[0][0].modules[name]:
        out[f"{name}.{suffix}"] = sum(
            f.modules[name][suffix].float() * r for f, r in entries if suffix in f.modules[name]
        )


# ------------------------------------------------------------------------------------------------------ SVD merge
def svd_merge(
    files_: Sequence[AdapterFile],
    ratios: Sequence[float],
    *,
    new_rank: int,
    new_conv_rank: int | None,
    base_index: Mapping | None = None,
    device: str | None = None,
    clamp_quantile: float | None = None,
) -> dict[str, Tensor]:
    """One LoRA of rank ``new_rank`` (``new_conv_rank`` for kernels > 1x1) per module: the truncated SVD of
    Σ ratioᵢ·ΔWᵢ (alpha = rank)."""
    summed, norms = _summed_deltas(files_, ratios, base_index)
    bar = progress(len(summed), "SVD")
    svds = svd_all(list(summed.values()), device=device, progress=bar.update)
    bar.close()
    out = {}
    for (name, delta), svd in zip(summed.items(), svds):
        conv = len(delta.shape) == 4 and tuple(delta.shape[2:]) != (1, 1)
        rank = select_rank(svd.S, new_conv_rank if conv and new_conv_rank else new_rank)
        layout = _layout(files_, name)
        up, down = clamp_factors(*to_lora(svd, rank, delta.shape, 1.0, layout), clamp_quantile)
        out[f"{name}.lora_up.weight"], out[f"{name}.lora_down.weight"] = up, down
        out[f"{name}.alpha"] = torch.tensor(float(rank))
    for name, tensors in norms.items():
        out.update({f"{name}.{s}": t for s, t in tensors.items()})
    return out


def _layout(files_: Sequence[AdapterFile], name: str) -> tuple[int, ...] | None:
    for f in files_:
        t = f.modules.get(name, {}).get("lora_down.weight")
        if t is not None and "lora_mid.weight" not in f.modules[name]:
            return tuple(t.shape)
    return None


def _summed_deltas(files_, ratios, base_index) -> tuple[dict[str, Delta], dict[str, dict[str, Tensor]]]:
    per_file, errors = [], []
    for f, r in zip(files_, ratios):
        try:
            per_file.append(file_deltas(f, resolve_index(f, base_index), multiplier=r))
        except ValueError as e:
            errors += problems_of(e)
    if errors:
        raise ConfigError(errors, "adapter files")
    summed, norms = {}, {}
    for name in _all_modules(files_):
        parts = [d[name] for d, _ in per_file if name in d]
        if parts:
            try:
                summed[name] = sum_deltas(parts)
            except ValueError as e:
                errors.append(f"{name}: {e}; the files are for different models")
        norm_parts = [n[name] for _, n in per_file if name in n]
        if norm_parts:
            norms[name] = {s: sum(p[s] for p in norm_parts if s in p) for s in norm_parts[0]}
    if errors:
        raise ConfigError(errors, "adapter files", limit=8)
    return summed, norms


# ------------------------------------------------------------------------------------------------ into a model
def merge_into_model(family: ModelFamily, parts: Parts, files_: Sequence[AdapterFile], ratios: Sequence[float]) -> None:
    """Bake every file (at its ratio, in order) into ``parts``' weights. Every file is checked against the model
    first (another family, other shapes: one ``ValueError`` naming each file and module)."""
    from .inject import network_from_state_dict

    roots = family.adapter_roots(parts)
    index = files.module_index(roots)
    problems = [p for f in files_ for p in fits(f, index)]
    if problems:
        raise ConfigError(problems, "adapter files", limit=8)
    for f, ratio in zip(files_, ratios):
        network = network_from_state_dict(f.state_dict(), roots, source=f.source)
        network.set_multiplier(ratio)
        network.merge_into_base(progress=f"merging {f.path.name} x{ratio:g}")


# ------------------------------------------------------------------------------------------------------ metadata
def merged_from(titles: Sequence[str]) -> str:
    return ", ".join(titles)


def output_ranks(state_dict: Mapping[str, Tensor]) -> dict[str, tuple[int, bool]]:
    """{module: (rank, is a conv with kernel > 1x1)} of a LoRA state dict."""
    out = {}
    for key, t in state_dict.items():
        if key.endswith(".lora_down.weight"):
            out[key.removesuffix(".lora_down.weight")] = (
                int(t.shape[0]),
                t.dim() == 4 and tuple(t.shape[2:]) != (1, 1),
            )
    return out


def lora_metadata(
    files_: Sequence[AdapterFile], ratios: Sequence[float], state_dict: Mapping[str, Tensor], how: str, save_to
) -> dict[str, str]:
    """Metadata of a merged LoRA: ss_network_* from the result (``Dynamic`` when ranks differ), the base-model keys
    and ModelSpec of the first input that has them, ``modelspec.merged_from`` and a training comment."""
    from library.files import metadata as md

    meta: dict[str, str] = {}
    for key in ("ss_v2", "ss_base_model_version", "ss_sd_model_name"):
        value = next((f.metadata[key] for f in files_ if f.metadata.get(key)), None)
        if value:
            meta[key] = value
    spec = next(({k: v for k, v in f.metadata.items() if k.startswith("modelspec.")} for f in files_
                 if "modelspec.architecture" in f.metadata), {})  # fmt: skip
    if spec:
        has_prediction = "modelspec.prediction_type" in spec
        spec = {**spec, **md.modelspec(architecture=spec["modelspec.architecture"],
                                       implementation=spec.get("modelspec.implementation", "diffusers"),
                                       title=Path(save_to).stem, resolution=_resolution(spec),
                                       prediction_type=spec.get("modelspec.prediction_type", "epsilon"))}  # fmt: skip
        if not has_prediction:  # FLUX / Chroma ModelSpec has no prediction type (sd-scripts writes none)
            spec.pop("modelspec.prediction_type")
        for key in (
            "modelspec.description",
            "modelspec.trigger_phrase",
            "modelspec.thumbnail",
            "modelspec.hash_sha256",
        ):
            spec.pop(key, None)
    meta.update(spec)
    ranks = output_ranks(state_dict)
    linear = sorted({r for r, conv in ranks.values() if not conv})
    conv = sorted({r for r, c in ranks.values() if c})
    meta["modelspec.merged_from"] = merged_from([f.title for f in files_])
    meta["ss_network_module"] = "networks.lora"
    meta["ss_network_dim"] = str(linear[0]) if len(linear) == 1 else "Dynamic"
    meta["ss_network_alpha"] = str(float(linear[0])) if len(linear) == 1 else "Dynamic"
    args = {"conv_dim": str(conv[0]), "conv_alpha": str(float(conv[0]))} if len(conv) == 1 else {}
    if len(conv) > 1:
        args = {"conv_dim": "Dynamic", "conv_alpha": "Dynamic"}
    meta["ss_network_args"] = json.dumps(args) if args else "null"
    inputs = ", ".join(f"{f.path.name} x{r:g}" for f, r in zip(files_, ratios))
    meta["ss_training_comment"] = f"{how} from {inputs}"
    return meta


def _resolution(spec: Mapping[str, str]) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in spec.get("modelspec.resolution", "512x512").split("x"))
        return w, h
    except ValueError:
        return 512, 512
