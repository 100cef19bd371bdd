"""Adapter files as per-module ΔW, for the post-training tools (resize, merge, SVD-merge, check).

An :class:`AdapterFile` is a kohya / LyCORIS file read safely (``library.files.weights.load_state_dict``) and grouped
per module, each module's algorithm detected (``networks.files``). :func:`module_delta` turns one module into a
:class:`~networks.lowrank.Delta` through the same functions training uses (``AdapterWeights.delta_weight``, the
LoRA ``factors``, ``AdapterLayer.delta`` for DoRA), so no formula is written twice.

The base weight shape of a module comes from, in order: the base model when one is given (its modules, as for
training), the file's own tensors when they determine it (LoRA; LoHa/LoKr with tucker or full factors), or the
released architecture of the file's model family built on the meta device (LoHa/LoKr store conv kernels
flattened, so the file alone cannot tell a 3x3 conv from a Linear). DoRA, (IA)³ and GLoRA need the base weights
themselves. ΔW only: a full module's bias change (``diff_b``) is not part of a ``Delta``; the tools that turn ΔW
into a LoRA drop it with a warning (merging into a model keeps it: that path runs the adapter layer's merge).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError, problems_of
from library.families.base import Parts
from library.families.protocol import ModelFamily

from . import files
from .algos import ALGOS
from .fused import adapter_layer
from .layers import AdapterWeights
from .lowrank import Delta
from .targets import Target
from .tool_common import family_titles

logger = logging.getLogger(__name__)


@dataclass
class AdapterFile:
    """One adapter file: ``modules`` {kohya name: {tensor suffix: tensor}}, ``algos`` {name: algorithm}."""

    path: Path
    modules: dict[str, dict[str, Tensor]]
    metadata: dict[str, str]
    algos: dict[str, str] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return str(self.path)

    @property
    def title(self) -> str:
        """``modelspec.title`` or the file stem (what ``modelspec.merged_from`` lists)."""
        return self.metadata.get("modelspec.title") or self.path.stem

    def state_dict(self) -> dict[str, Tensor]:
        """The file's tensors under their keys again (``<name>.<suffix>``)."""
        return {f"{n}.{s}": t for n, tensors in self.modules.items() for s, t in tensors.items()}

    def rank_alpha(self, name: str) -> tuple[int | None, float]:
        """(r, alpha) of a module as the training code reads them (alpha missing: r; no rank: None, 1)."""
        algo = self.algos[name]
        if algo == "norm":
            return None, 1.0
        spec = ALGOS[algo]
        tensors = self.modules[name]
        rank = spec.rank({spec.param_for_suffix(s): t for s, t in tensors.items() if spec.param_for_suffix(s)})
        alpha = float(tensors["alpha"]) if "alpha" in tensors else float(rank or 1)
        return rank, alpha

    def scale_of(self, name: str) -> float:
        """alpha / r of a module (1 when the format fixes it, as ``AdapterWeights.scale``)."""
        rank, alpha = self.rank_alpha(name)
        return alpha / rank if rank else 1.0

    def rank_of(self, name: str) -> int | None:
        return self.rank_alpha(name)[0]


def load_adapter(path: str | os.PathLike) -> AdapterFile:
    """Read an adapter file; ``ValueError`` naming the file for unsafe pickles, non-adapter files and algorithms
    that are not supported (every module's problem at once)."""
    from library.files.weights import load_state_dict

    path = Path(path)
    state_dict, metadata = load_state_dict(path)
    return adapter_from_state_dict(path, state_dict, metadata)


def adapter_from_state_dict(path: Path, state_dict: Mapping[str, Tensor], metadata: dict[str, str]) -> AdapterFile:
    """:func:`load_adapter` on tensors already read (or converted, e.g. a PEFT file in kohya names); ``path``
    names the file in messages."""
    peft = next((k for k in state_dict if k.endswith((".lora_A.weight", ".lora_B.weight"))), None)
    if peft is not None:
        raise ValueError(
            f"{path}: {peft} is a PEFT/diffusers-format LoRA key; convert the file to kohya format "
            f"({files.peft_conversion_hint()})"
        )
    modules = files.group_by_module(state_dict)
    if not modules:
        raise ValueError(f"{path}: no adapter modules in this file (expected kohya keys such as "
                         "lora_unet_..._to_q.lora_down.weight); is it a model checkpoint?")  # fmt: skip
    algos, errors = {}, []
    for name, tensors in modules.items():
        try:
            algos[name] = files.algo_of(name, tensors, str(path))
        except ValueError as e:
            errors += problems_of(e)
            continue
        missing = missing_tensors(algos[name], tensors)
        if missing:
            errors.append(f"{path}: {name} lacks {' and '.join(missing)} (an incomplete {algos[name]} module; is the "
                          "file truncated or hand-edited?)")  # fmt: skip
    if not algos and errors and all(e.endswith("(unknown tensor names)") for e in errors):  # not an adapter file
        example = next(iter(state_dict))
        raise ValueError(f"{path}: none of its {len(state_dict)} tensors belongs to a LoRA/LoHa/LoKr/DoRA module "
                         f"(e.g. {example}); is it a model checkpoint? Pass an adapter file")  # fmt: skip
    if errors:
        raise ConfigError(errors, "adapter file", limit=5)
    return AdapterFile(path, modules, metadata, algos)


_REQUIRED = {
    "lora": (("lora_down.weight",), ("lora_up.weight",)),
    "loha": (("hada_w1_a",), ("hada_w1_b",), ("hada_w2_a",), ("hada_w2_b",)),
    "lokr": (("lokr_w1", "lokr_w1_a"), ("lokr_w2", "lokr_w2_a")),
    "norm": (("w_norm",),),
    "full": (("diff",),),
    "ia3": (("weight",), ("on_input",)),
    "glora": (("a1.weight",), ("a2.weight",), ("b1.weight",), ("b2.weight",)),
    "diag-oft": (("oft_blocks",),),
    "boft": (("oft_blocks",),),
    "oft": (("oft_blocks",),),
}


def missing_tensors(algo: str, tensors: Mapping[str, Tensor]) -> list[str]:
    """The tensor suffixes a module of ``algo`` needs but lacks (alternatives joined by "/")."""
    missing = ["/".join(options) for options in _REQUIRED[algo] if not any(o in tensors for o in options)]
    pairs = (("hada_t1", "hada_t2"), ("lokr_w1_a", "lokr_w1_b"), ("lokr_w2_a", "lokr_w2_b"))
    missing += [b for a, b in pairs if a in tensors and b not in tensors]
    return missing


def load_adapters(paths: Sequence[str | os.PathLike]) -> list[AdapterFile]:
    """:func:`load_adapter` for each path; the problems of every file in one ``ConfigError``."""
    out, errors = [], []
    for p in paths:
        try:
            out.append(load_adapter(p))
        except ValueError as e:
            errors += problems_of(e)
        except FileNotFoundError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError(errors, "adapter files")
    return out


# ------------------------------------------------------------------------------------------------- module shapes
def shape_from_tensors(algo: str, t: Mapping[str, Tensor]) -> tuple[int, ...] | None:
    """The base weight shape when the file's tensors determine it, else None (flattened LoHa/LoKr conv kernels)."""
    if algo == "lora":
        up, down, mid = t["lora_up.weight"], t["lora_down.weight"], t.get("lora_mid.weight")
        if mid is not None:
            return (up.shape[0], down.shape[1], *mid.shape[2:])
        return (up.shape[0], *down.shape[1:])
    if algo == "full":
        return tuple(t["diff"].shape)
    if algo == "glora":
        b1, b2, bm = t["b1.weight"], t["b2.weight"], t.get("bm.weight")
        kernel = (bm if bm is not None else b2).shape[2:]
        return (b1.shape[0], b2.shape[1], *kernel)
    if algo == "loha" and "hada_t1" in t:
        return (t["hada_w1_a"].shape[1], t["hada_w1_b"].shape[1], *t["hada_t1"].shape[2:])
    if algo == "lokr":
        w1 = t.get("lokr_w1")
        a, c = w1.shape if w1 is not None else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
            return (a * w2.shape[0], c * w2.shape[1], *w2.shape[2:])
        if "lokr_t2" in t:
            return (a * t["lokr_w2_a"].shape[1], c * t["lokr_w2_b"].shape[1], *t["lokr_t2"].shape[2:])
    return None


@cache
def reference_index(family_name: str) -> dict[str, Target]:
    """Kohya names -> modules of the family's released architecture (``ModelFamily.reference_parts``, on the meta
    device): shapes for files whose tensors do not determine them."""
    from library.families import get_family

    family = get_family(family_name)
    return files.module_index(family.adapter_roots(family.reference_parts()))


def fits(file: AdapterFile, index: Mapping[str, Target]) -> list[str]:
    """The problems of ``file`` against a model's modules (empty: every module exists and its tensors fit)."""
    unknown = [n for n in file.modules if n not in index]
    if unknown:
        roots = sorted({_prefix_of(t.name) for t in index.values()})  # canonical names, not aliases (oft_unet_)
        return [files.explain_unmatched(unknown, [(p, nn.Module(), str) for p in roots], file.source)]
    errors = []
    for name, tensors in file.modules.items():
        shape = tuple(index[name].module.weight.shape)
        try:
            fitted = files.fit_to_base(tensors, shape) if file.algos[name] != "norm" else tensors
            files.check_shapes(name, file.algos[name], fitted, shape, file.source)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _prefix_of(name: str) -> str:
    return files.prefix_of(name)


def adapter_family(file: AdapterFile) -> str | None:
    """The registered family whose released architecture every module of ``file`` fits, or None. The family of the
    file's ``ss_base_model_version`` is tried first; a file that fits several (rare) gets the first match."""
    from library.families import FAMILIES

    hint = file.metadata.get("ss_base_model_version", "")
    for name in sorted(FAMILIES, key=lambda n: not hint.startswith(FAMILIES[n].base_model_version())):
        if not fits(file, reference_index(name)):
            return name
    return None


def _needs_base(file: AdapterFile, name: str) -> bool:
    """ΔW of the module depends on the base weight W: DoRA, (IA)³, GLoRA."""
    algo = file.algos[name]
    return "dora_scale" in file.modules[name] or (algo in ALGOS and ALGOS[algo].needs_base)


def needs_model(file: AdapterFile) -> bool:
    """Whether ΔW of some module needs the model: DoRA, (IA)³, GLoRA (base weights), LoHa / LoKr with flattened
    kernels (shapes)."""
    return any(_needs_base(file, n) or (file.algos[n] != "norm" and shape_from_tensors(file.algos[n], t) is None)
               for n, t in file.modules.items())  # fmt: skip


def resolve_index(file: AdapterFile, base_index: Mapping[str, Target] | None) -> Mapping[str, Target] | None:
    """The module index shapes come from: the base model's, else (only when some module needs it) the released
    architecture the file fits. ``ValueError`` naming the file when the modules do not fit the base model or no
    family fits the file."""
    if base_index is not None:
        problems = fits(file, base_index)
        if problems:
            raise ConfigError(problems, "adapter file", limit=5)
        return base_index
    based = [n for n, a in file.algos.items() if a in ALGOS and ALGOS[a].needs_base]
    if based:  # e.g. OFT: ΔW = R·W − W
        raise ValueError(f"{file.source}: {len(based)} {file.algos[based[0]]} module(s) (e.g. {based[0]}): their ΔW "
                         "depends on the base weights; pass the base model they were trained on (--base_model)")  # fmt: skip
    dora = [n for n, t in file.modules.items() if "dora_scale" in t]
    if dora:
        raise ValueError(f"{file.source}: {len(dora)} DoRA module(s) (e.g. {dora[0]}): their ΔW depends on the base "
                         "weights; pass the base model they were trained on (--base_model)")  # fmt: skip
    by_w = [n for n in file.modules if _needs_base(file, n)]
    if by_w:
        kinds = ", ".join(sorted({file.algos[n] for n in by_w}))
        raise ValueError(f"{file.source}: {len(by_w)} {kinds} module(s) (e.g. {by_w[0]}): their ΔW depends on the "
                         "base weights; pass the base model they were trained on (--base_model)")  # fmt: skip
    needs = [n for n, t in file.modules.items() if file.algos[n] != "norm" and shape_from_tensors(file.algos[n], t)
             is None]  # fmt: skip
    if not needs:
        return None
    family = adapter_family(file)
    if family is None:
        raise ValueError(
            f"{file.source}: the base weight shapes of {len(needs)} module(s) (e.g. {needs[0]}) cannot be read from "
            f"the file (LoHa / LoKr store conv kernels flattened) and the file does not fit a released "
            f"{family_titles(sep=' / ')} architecture; pass the base model the adapter was trained on (--base_model)"
        )
    logger.info("%s: module shapes from the released %s architecture", file.source, family)
    return reference_index(family)


# ------------------------------------------------------------------------------------------------------- deltas
def module_delta(
    file: AdapterFile, name: str, index: Mapping[str, Target] | None, *, multiplier: float = 1.0
) -> Delta | None:
    """ΔW of one module (alpha / r and ``multiplier`` applied; DoRA's W' − W at multiplier 1 scaled by
    ``multiplier``); None for norm modules. Raises ``ValueError`` naming the module when its shape is unknown or
    DoRA lacks base weights."""
    algo, tensors = file.algos[name], file.modules[name]
    if algo == "norm":
        return None
    base = index[name].module if index is not None and name in index else None
    shape = tuple(base.weight.shape) if base is not None else shape_from_tensors(algo, tensors)
    if shape is None:
        raise ValueError(f"{file.source}: {name}: the base weight shape is not in the file; pass the base model")
    tensors = files.fit_to_base(tensors, shape)
    files.check_shapes(name, algo, tensors, shape, file.source)
    adapter = AdapterWeights.from_file(tensors, algo, name)
    with torch.no_grad():
        if adapter.magnitude is not None or adapter.algo.needs_base:
            if base is None or base.weight.is_meta:
                what = "DoRA" if adapter.magnitude is not None else adapter.algo.name
                raise ValueError(f"{file.source}: {name} is a {what} module: its ΔW depends on the base weights; "
                                 "pass the base model it was trained on (--base_model)")  # fmt: skip
            layer = adapter_layer(base, adapter.to(base.weight.device))
            if adapter.algo.multiplier_inside:  # ΔW is not linear in the multiplier (OFT: R moved toward I)
                delta = layer.delta(multiplier).detach().float().cpu()
                return Delta(shape, dense=delta.reshape(shape[0], -1))
            delta = layer.delta(1.0).detach().float().cpu()
            return Delta(shape, dense=delta.reshape(shape[0], -1) * multiplier)
        pair = adapter.factors()
        if pair is not None:
            return Delta(shape, up=pair[0].detach() * multiplier, down=pair[1].detach())
        return Delta(shape, dense=adapter.delta_weight(shape).detach().reshape(shape[0], -1) * multiplier)


def file_deltas(
    file: AdapterFile, index: Mapping[str, Target] | None, multiplier: float = 1.0
) -> tuple[dict[str, Delta], dict[str, dict[str, Tensor]]]:
    """``(deltas, norms)``: ΔW of every weight module and the tensors of norm modules; every module's problem in
    one ``ValueError``."""
    deltas, norms, errors, biased = {}, {}, [], []
    for name in file.modules:
        try:
            d = module_delta(file, name, index, multiplier=multiplier)
        except ValueError as e:
            errors.append(str(e))
            continue
        bias = file.modules[name].get("diff_b") if file.algos[name] == "full" else None
        if bias is not None and bool(bias.any()):
            biased.append(name)
        if d is None:
            norms[name] = {k: v.float() * multiplier for k, v in file.modules[name].items()}
        else:
            deltas[name] = d
    if errors:
        raise ConfigError(errors, "adapter file", limit=5)
    if biased:
        logger.warning("%s: the bias changes (diff_b) of %d full module(s), e.g. %s, are dropped: a LoRA has no bias. "
                       "To keep them, merge the file into the model (merge_lora.py --sd_model)", file.source,
                       len(biased), biased[0])  # fmt: skip
    return deltas, norms


def base_model_index(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[ModelFamily, Parts, dict[str, Target]]:
    """Load a base model with its family (``library.families``): ``(family, parts, index)``."""
    from library.families import detect_family

    family = detect_family(path)
    parts = family.load(path, dtype=dtype)
    return family, parts, files.module_index(family.adapter_roots(parts))
