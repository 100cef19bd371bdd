"""Adapter state dicts: grouping per module, the algorithm of each, name matching and mismatch messages.

Reading kohya / LyCORIS adapter state dicts: group tensors per module, match module names to a model, explain
mismatches (another model family, another algorithm, another rank) in words a user can act on.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from library.cli.problems import first
from library.families import FAMILIES, adapter_family_label
from library.families.lora_formats import (
    PEFT_SUFFIXES,
    group_by_module,  # noqa: F401  (networks.files.group_by_module)
    is_peft,
)
from library.families.registry import rules_by_module

from .algos import ALGOS, NOT_SUPPORTED, detect_algo, oft_variant
from .fused import FusedLeaf
from .layers import AdapterLayer, NormAdapterLayer, weight_kind
from .targets import Root, Target, as_root, fused_targets, kohya_name
from .tool_common import family_titles


def peft_conversion_hint() -> str:
    """How to make a PEFT / diffusers LoRA file kohya, for each family with a converter (its rules' ``CONVERSION``):
    "FLUX.1 / Chroma: networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts; SD3 / SD3.5: ..."."""
    conversions = {c.script: c for r in rules_by_module().values() if (c := r.CONVERSION) is not None}
    return "; ".join(f"{c.title}: {c.to_kohya()}" for c in conversions.values())


def raise_if_peft(state_dict: Mapping[str, Tensor], source: str) -> None:
    """``ValueError`` for a PEFT / diffusers / ai-toolkit LoRA (``*.lora_A.weight`` keys) given where a kohya-format
    file is read: what it is and the converter command (its module names would otherwise read as another family's)."""
    if is_peft(state_dict):
        example = next(k for k in state_dict if k.endswith(PEFT_SUFFIXES))
        raise ValueError(f"{source}: a PEFT / diffusers-format LoRA (keys such as {example}), not a kohya-format "
                         f"file; convert it first ({peft_conversion_hint()})")  # fmt: skip


def prefix_of(name: str) -> str:
    """``lora_unet_x_y`` -> ``lora_unet``; ``lora_te1_text_model_...`` -> ``lora_te1``."""
    head, _, rest = name.partition("_")
    second = rest.split("_", 1)[0]
    return f"{head}_{second}" if head == "lora" else head


def module_index(roots: Sequence[Root]) -> dict[str, Target]:
    """Every adaptable module of the roots under its kohya name **and** its alias names.

    Aliases: the un-renamed path (diffusers-named SDXL UNet files, as sd-scripts and diffusers accept; TE names
    without ``text_model_`` written by tools that ran under transformers 5). The Target always holds the canonical
    (renamed) name. A fused module (``Root.fused``) is indexed under its fused name only; its leaves are not indexed.
    """
    index: dict[str, Target] = {}
    roots = [as_root(r) for r in roots]
    by_leaf, by_name = fused_targets(roots)

    def add(target: Target, *aliases: str) -> None:
        for name in (target.name, *aliases):
            index.setdefault(name, target)
        for algo in ALGOS.values():  # sd-scripts' networks.oft files name UNet modules oft_unet_...
            if algo.file_prefix and target.is_unet:
                index.setdefault(algo.file_prefix + target.name.removeprefix("lora_unet"), target)

    for target in by_name.values():
        add(target)
    for i, (prefix, root, rename, _) in enumerate(roots):
        for path, module in root.named_modules():
            if isinstance(module, (AdapterLayer, NormAdapterLayer, FusedLeaf)):  # an injected module: its base
                module = module.base_layer
            elif ".base_layer" in path or ".adapter." in path:
                continue
            kind = weight_kind(module)
            if kind is None or not path or (i, path) in by_leaf:
                continue
            add(Target(kohya_name(prefix, rename, path), module, i, path, kind), kohya_name(prefix, lambda p: p, path))
    return index


def explain_unmatched(names: Sequence[str], roots: Sequence[Root], source: str) -> str:
    """A message for module names of a file that are not in the model: which prefix, which family it suggests."""
    model_prefixes = sorted({r[0] for r in roots})
    by_prefix = Counter(prefix_of(n) for n in names)
    lines = []
    for prefix, count in by_prefix.items():
        examples = ", ".join([n for n in names if prefix_of(n) == prefix][:3])
        if prefix not in model_prefixes:
            label = adapter_family_label([prefix], names)  # block names tell SDXL from FLUX
            hint = f"{label} (prefix {prefix})" if label else f"not a kohya-format adapter for {family_titles()}"
            lines.append(
                f"{count} module(s) with prefix {prefix!r}, which this model does not have (its prefixes: "
                f"{', '.join(model_prefixes)}); the file looks made for {hint}. Examples: {examples}"
            )
        elif label := adapter_family_label([prefix], names):  # the block names tell whose file it is
            lines.append(f"{count} {prefix} module(s) not found in this model; the file looks made for {label}. "
                         f"Examples: {examples}")  # fmt: skip
        else:
            having = [name for name, f in FAMILIES.items() if prefix in f.adapter_prefixes][:3]
            lines.append(
                f"{count} {prefix} module(s) not found in this model (another model family or architecture, e.g. "
                f"{family_titles(having, ' vs ')}?). Examples: {examples}"
            )
    return f"{source}: " + "; ".join(lines)


def algo_of(name: str, tensors: Mapping[str, Tensor], source: str) -> str:
    """The algorithm of one module's tensors; ``ValueError`` naming the key for formats not implemented here."""
    algo = detect_algo(set(tensors))
    if algo == "diag-oft":  # three formats store oft_blocks: tell them apart by module name and tensor axes
        algo = oft_variant(name, tensors["oft_blocks"])
    if algo in ALGOS or algo == "norm":
        return algo
    names = sorted(tensors)
    keys = first([f"{name}.{s}" for s in names], 3, ", ", " (and {n} more)")
    if algo == "peft":
        raise ValueError(
            f"{source}: {keys} are PEFT/diffusers-format LoRA keys; convert the file to kohya format "
            f"({peft_conversion_hint()})"
        )
    if algo == "oft-legacy":
        raise ValueError(f"{source}: {keys}: the pre-3.0 LyCORIS OFT format (oft_diag) is not supported; lycoris-lora "
                         "4.1.3 does not read it either. Retrain with algo=diag-oft")  # fmt: skip
    if algo in NOT_SUPPORTED:
        raise ValueError(f"{source}: {keys}: LyCORIS algorithm {algo!r} is not supported yet "
                         f"({', '.join(ALGOS)}, dora)")  # fmt: skip
    raise ValueError(f"{source}: {keys}: not a LoRA/LoHa/LoKr/DoRA/OFT/full/(IA)³/GLoRA module (unknown tensor names)")


_FULL_RANK_KEYS = ("lora_down.weight", "lora_up.weight", "lora_mid.weight", "lokr_w2", "rescale", "diff", "a1.weight",
                   "a2.weight", "b1.weight", "b2.weight")  # fmt: skip


def fit_to_base(tensors: Mapping[str, Tensor], base_shape: tuple[int, ...]) -> dict[str, Tensor]:
    """Bridge Linear vs 1x1-conv files (SD2 proj_in/out are 1x1 convs in single-file models, Linear in diffusers):
    tensors that mirror the base weight's dimensionality get trailing singleton axes added or removed.
    """
    out = dict(tensors)
    for key in _FULL_RANK_KEYS:
        t = out.get(key)
        if t is None or t.dim() == len(base_shape):
            continue
        if t.dim() > len(base_shape) and all(s == 1 for s in t.shape[len(base_shape) :]):
            out[key] = t.reshape(t.shape[: len(base_shape)])
        elif t.dim() < len(base_shape) and all(s == 1 for s in base_shape[t.dim() :]):
            out[key] = t.reshape(*t.shape, *[1] * (len(base_shape) - t.dim()))
    up, down = out.get("lora_up.weight"), out.get("lora_down.weight")
    if up is not None and down is not None and up.dim() == 2 and down.dim() == 4:  # LyCORIS DyLoRA conv: up (out, r)
        out["lora_up.weight"] = up.reshape(*up.shape, 1, 1)
    scales = out.get("weight")
    if "on_input" in out and scales is not None:  # (IA)³: (c,) on a Linear, (1, c, 1, 1) on a conv
        c = scales.numel()
        out["weight"] = scales.reshape((1, c, *[1] * (len(base_shape) - 2)) if len(base_shape) > 2 else (c,))
    return out


def check_shapes(name: str, algo: str, tensors: Mapping[str, Tensor], base_shape: tuple[int, ...], source: str):
    """Raise ``ValueError`` naming the module when its tensors do not rebuild a ΔW of ``base_shape``."""
    if algo == "norm":
        bad = [k for k, t in tensors.items() if t.numel() != base_shape[0]]
        if bad:
            raise ValueError(f"{source}: {name}.{bad[0]} has {tensors[bad[0]].numel()} values, the norm has "
                             f"{base_shape[0]} channels")  # fmt: skip
        return
    spec = ALGOS[algo]
    params = {}
    for suffix, t in tensors.items():
        param = spec.param_for_suffix(suffix)
        if param is not None:  # constants ((IA)³'s on_input) keep their value: the functions read it
            params[param] = t if param in spec.constants else t.to("meta")
    shapes = ", ".join(f"{s} {tuple(t.shape)}" for s, t in sorted(tensors.items()) if s != "alpha")
    kw = {"base": torch.empty(base_shape, device="meta"), "alpha": 0.0} if spec.needs_base else {}
    try:
        delta = spec.delta_weight(params, 1.0, tuple(base_shape), **kw)
        bias = spec.delta_bias(params, 1.0) if spec.delta_bias is not None else None
        ok = tuple(delta.shape) == tuple(base_shape) and (bias is None or tuple(bias.shape) == (base_shape[0],))
    except (RuntimeError, ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise ValueError(
            f"{source}: {name}: tensors ({shapes}) do not fit the model's weight of shape {tuple(base_shape)} "
            f"(numel {math.prod(base_shape)}); the file was made for another model or architecture"
        )
    scale = tensors.get("dora_scale")
    if scale is not None:
        from .algos.dora import magnitude_axis

        magnitude_axis(scale, tuple(base_shape))
