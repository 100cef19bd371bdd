"""FLUX.1 / Chroma transformer names: BFL single-file layout <-> diffusers ``FluxTransformer2DModel`` /
``ChromaTransformer2DModel``, both ways, for any width and block count.

One table of *modules* drives everything: the state-dict conversion in both directions, the module renames of
adapter keys (kohya names use BFL module paths, as sd-scripts' ``networks/lora_flux.py`` and ComfyUI do) and the
fused adapter modules. An :class:`Entry` maps one BFL module to one or more diffusers modules:

* ``"one"``: the same tensor under another name (norm ``scale`` <-> ``weight``);
* ``"rows"``: the BFL weight is the diffusers weights stacked on the output axis (rows), in order:
  ``img_attn.qkv`` = ``to_q | to_k | to_v`` (3 × D rows), ``txt_attn.qkv`` = ``add_q_proj | add_k_proj | add_v_proj``,
  ``single_blocks.N.linear1`` = ``to_q | to_k | to_v | proj_mlp`` (3 × D + M rows, M = 4 D in the released models);
  the split reads D from the tensors (the input width of ``img_in`` / the qkv weight), never assumes 3072;
* ``"swap"``: ``final_layer.adaLN_modulation.1`` = diffusers ``norm_out.linear`` with its two halves swapped (BFL
  stores shift, scale; diffusers' ``AdaLayerNormContinuous`` reads scale, shift).

The pairs are those of diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` /
``convert_chroma_transformer_checkpoint_to_diffusers`` (single_file_utils.py) and sd-scripts' ``BFL_TO_DIFFUSERS_MAP``
(library/flux_utils.py); tests/test_flux_family.py checks them against both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from ..base import Fused, Segment

BFL_PREFIX = "model.diffusion_model."
FLUX, CHROMA = "flux", "chroma"
TOP_MODULES = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "double_blocks", "single_blocks",
               "final_layer", "distilled_guidance_layer")  # fmt: skip
_LINEAR = (("weight", "weight"), ("bias", "bias"))
_NORM = (("scale", "weight"),)


@dataclass(frozen=True)
class Entry:
    """One BFL module and the diffusers module(s) it is. ``params``: (BFL, diffusers) parameter names."""

    bfl: str
    diffusers: tuple[str, ...]
    kind: str = "one"  # "one" | "rows" | "swap"
    params: tuple[tuple[str, str], ...] = _LINEAR


def _double(i: int, variant: str) -> list[Entry]:
    b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
    out = []
    if variant == FLUX:  # Chroma's blocks take their modulation from the approximator
        out += [
            Entry(b + "img_mod.lin", (d + "norm1.linear",)),
            Entry(b + "txt_mod.lin", (d + "norm1_context.linear",)),
        ]
    for side, attn, q, k, v, proj, ff in (
        ("img", "attn.", "to_q", "to_k", "to_v", "to_out.0", "ff"),
        ("txt", "attn.", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context"),
    ):
        norm_q, norm_k = ("norm_q", "norm_k") if side == "img" else ("norm_added_q", "norm_added_k")
        out += [
            Entry(f"{b}{side}_attn.qkv", tuple(d + attn + x for x in (q, k, v)), "rows"),
            Entry(f"{b}{side}_attn.norm.query_norm", (d + attn + norm_q,), params=_NORM),
            Entry(f"{b}{side}_attn.norm.key_norm", (d + attn + norm_k,), params=_NORM),
            Entry(f"{b}{side}_attn.proj", (d + attn + proj,)),
            Entry(f"{b}{side}_mlp.0", (f"{d}{ff}.net.0.proj",)),
            Entry(f"{b}{side}_mlp.2", (f"{d}{ff}.net.2",)),
        ]
    return out


def _single(i: int, variant: str) -> list[Entry]:
    b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
    out = [Entry(b + "modulation.lin", (d + "norm.linear",))] if variant == FLUX else []
    return out + [
        Entry(b + "linear1", (d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"), "rows"),
        Entry(b + "linear2", (d + "proj_out",)),
        Entry(b + "norm.query_norm", (d + "attn.norm_q",), params=_NORM),
        Entry(b + "norm.key_norm", (d + "attn.norm_k",), params=_NORM),
    ]


@cache
def module_table(variant: str, num_double: int, num_single: int, guidance: bool, approximator_layers: int = 0
                 ) -> tuple[Entry, ...]:  # fmt: skip
    """Every weight-holding module of a FLUX.1 (``variant`` "flux"; ``guidance``: dev's ``guidance_in``) or Chroma
    transformer with ``num_double`` double and ``num_single`` single blocks (Chroma: ``approximator_layers``
    layers in ``distilled_guidance_layer``)."""
    if variant not in (FLUX, CHROMA):
        raise ValueError(f"unknown FLUX variant {variant!r}; expected {FLUX!r} or {CHROMA!r}")
    top = [Entry("img_in", ("x_embedder",)), Entry("txt_in", ("context_embedder",))]
    if variant == FLUX:
        emb = "time_text_embed."
        pairs = [("time_in", "timestep_embedder"), ("vector_in", "text_embedder")]
        pairs += [("guidance_in", "guidance_embedder")] if guidance else []
        for bfl, diff in pairs:
            top += [Entry(f"{bfl}.in_layer", (f"{emb}{diff}.linear_1",)),
                    Entry(f"{bfl}.out_layer", (f"{emb}{diff}.linear_2",))]  # fmt: skip
    else:
        g = "distilled_guidance_layer."
        top += [Entry(g + "in_proj", (g + "in_proj",)), Entry(g + "out_proj", (g + "out_proj",))]
        for i in range(approximator_layers):
            top += [
                Entry(f"{g}layers.{i}.in_layer", (f"{g}layers.{i}.linear_1",)),
                Entry(f"{g}layers.{i}.out_layer", (f"{g}layers.{i}.linear_2",)),
                Entry(f"{g}norms.{i}", (f"{g}norms.{i}",), params=_NORM),
            ]
    blocks = [e for i in range(num_double) for e in _double(i, variant)]
    blocks += [e for i in range(num_single) for e in _single(i, variant)]
    final = [Entry("final_layer.linear", ("proj_out",))]
    if variant == FLUX:
        final.append(Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap"))
    return (*top, *blocks, *final)


# ------------------------------------------------------------------------------------------------ what a file holds
@dataclass(frozen=True)
class Layout:
    """What a transformer state dict (BFL or diffusers names) is: variant, block counts, dev guidance, width."""

    variant: str
    num_double: int
    num_single: int
    guidance: bool
    approximator_layers: int = 0

    @property
    def table(self) -> tuple[Entry, ...]:
        return module_table(self.variant, self.num_double, self.num_single, self.guidance, self.approximator_layers)


def _count(keys: Iterable[str], pattern: str) -> int:
    found = [int(m.group(1)) for k in keys if (m := re.match(pattern, k))]
    return max(found) + 1 if found else 0


def strip_bfl_prefix(keys: Iterable[str]) -> list[str]:
    return [k.removeprefix(BFL_PREFIX) for k in keys]


def is_bfl(keys: Iterable[str]) -> bool:
    """Whether the keys (with or without ``model.diffusion_model.``) are a BFL FLUX.1 / Chroma transformer."""
    return any(k.endswith("double_blocks.0.img_attn.qkv.weight") for k in keys)


def is_diffusers(keys: Iterable[str]) -> bool:
    """Whether the keys are a diffusers FLUX.1 / Chroma transformer (``transformer.`` prefix removed)."""
    keys = set(keys)
    return "transformer_blocks.0.attn.add_k_proj.weight" in keys and "x_embedder.weight" in keys


def bfl_layout(keys: Iterable[str]) -> Layout:
    """The layout of BFL keys (``model.diffusion_model.`` prefix or not): Chroma when ``distilled_guidance_layer``
    is present, else FLUX.1 (dev when ``guidance_in`` is present, schnell when not)."""
    keys = strip_bfl_prefix(keys)
    chroma = any(k.startswith("distilled_guidance_layer.") for k in keys)
    return Layout(
        CHROMA if chroma else FLUX,
        _count(keys, r"double_blocks\.(\d+)\."),
        _count(keys, r"single_blocks\.(\d+)\."),
        any(k.startswith("guidance_in.") for k in keys),
        _count(keys, r"distilled_guidance_layer\.layers\.(\d+)\."),
    )


def diffusers_layout(keys: Iterable[str]) -> Layout:
    """The layout of diffusers transformer keys."""
    keys = list(keys)
    chroma = any(k.startswith("distilled_guidance_layer.") for k in keys)
    return Layout(
        CHROMA if chroma else FLUX,
        _count(keys, r"transformer_blocks\.(\d+)\."),
        _count(keys, r"single_transformer_blocks\.(\d+)\."),
        any(k.startswith("time_text_embed.guidance_embedder.") for k in keys),
        _count(keys, r"distilled_guidance_layer\.layers\.(\d+)\."),
    )


def variant_name(layout: Layout) -> str:
    """ "dev" | "schnell" | "chroma"."""
    return "chroma" if layout.variant == CHROMA else ("dev" if layout.guidance else "schnell")


# ------------------------------------------------------------------------------------------------ state dicts
def _split_rows(tensor: Tensor, parts: int, width: int) -> list[Tensor]:
    """Rows of a fused weight/bias: 3 equal parts (qkv), or D, D, D, rest (linear1; D = ``width``)."""
    if parts == 3:
        return list(tensor.chunk(3, dim=0))
    return list(tensor.split([width, width, width, tensor.shape[0] - 3 * width], dim=0))


def _swap_halves(tensor: Tensor) -> Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


class BflToDiffusers(Mapping):
    """A BFL transformer state dict seen under diffusers names, read lazily (a fused BFL tensor is read once for its
    consecutive parts): what the loader checks and assigns, one tensor at a time. ``source`` may be a dict or a
    lazy reader (``weight_files.SafetensorsReader``), keys with or without ``model.diffusion_model.``."""

    def __init__(self, source: Mapping[str, Tensor], layout: Layout | None = None) -> None:
        self.source = source
        self.prefix = BFL_PREFIX if any(k.startswith(BFL_PREFIX) for k in source) else ""
        self.layout = layout or bfl_layout(source.keys())
        self.plan: dict[str, tuple[Entry, str, int]] = {}  # diffusers key -> (entry, BFL param, part index)
        for entry in self.layout.table:
            for bfl_param, diff_param in entry.params:
                for i, module in enumerate(entry.diffusers):
                    self.plan[f"{module}.{diff_param}"] = (entry, bfl_param, i)
        self._cached: tuple[str, Tensor] | None = None

    def bfl_key(self, key: str) -> str:
        entry, param, _ = self.plan[key]
        return f"{self.prefix}{entry.bfl}.{param}"

    @property
    def width(self) -> int:
        """The hidden size D (rows of ``img_in``)."""
        key = self.prefix + "img_in.weight"
        shape = self.source.shape(key) if callable(getattr(self.source, "shape", None)) else self.source[key].shape
        return int(shape[0])

    def _read(self, key: str) -> Tensor:
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.source[key])
        return self._cached[1]

    def __getitem__(self, key: str) -> Tensor:
        entry, param, i = self.plan[key]
        tensor = self._read(self.bfl_key(key))
        if entry.kind == "rows":
            return _split_rows(tensor, len(entry.diffusers), self.width)[i]
        return _swap_halves(tensor) if entry.kind == "swap" else tensor

    def shape(self, key: str) -> torch.Size:
        """The shape of a converted tensor, read from the source's shapes only."""
        entry, param, i = self.plan[key]
        bfl = self.bfl_key(key)
        shape = self.source.shape(bfl) if callable(getattr(self.source, "shape", None)) else self.source[bfl].shape
        if entry.kind != "rows":
            return torch.Size(shape)
        width = self.width
        rows = shape[0] // 3 if len(entry.diffusers) == 3 else (width if i < 3 else shape[0] - 3 * width)
        return torch.Size((rows, *shape[1:]))

    def missing_sources(self) -> list[str]:
        """BFL keys the layout needs that the source lacks."""
        keys = set(self.source.keys())
        return sorted({b for k in self.plan if (b := self.bfl_key(k)) not in keys})

    def unused_sources(self) -> list[str]:
        """Source keys no diffusers key reads (a file of another architecture, or extra tensors)."""
        used = {self.bfl_key(k) for k in self.plan}
        return sorted(k for k in self.source.keys() if k not in used)

    def __iter__(self) -> Iterator[str]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


def bfl_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A BFL transformer state dict -> diffusers names (every tensor read; see :class:`BflToDiffusers`)."""
    view = BflToDiffusers(state)
    missing = view.missing_sources()
    if missing:
        raise KeyError(f"the BFL state dict lacks {len(missing)} keys, e.g. {', '.join(missing[:3])}")
    return {k: view[k] for k in view}


def diffusers_to_bfl(state: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A diffusers FLUX.1 / Chroma transformer state dict -> BFL names (fused tensors concatenated, the final
    modulation's halves swapped back); ``prefix``: e.g. ``model.diffusion_model.``."""
    view = BflView(state, prefix)
    return {k: view[k] for k in view}


class BflView(Mapping):
    """The BFL state dict of a diffusers transformer ``state``, each tensor made when asked for (a fused tensor is
    concatenated then): ``--mem_eff_save`` writes it without a second copy of the model in memory."""

    def __init__(self, state: Mapping[str, Tensor], prefix: str = "") -> None:
        layout = diffusers_layout(state.keys())
        unused = set(state) - {f"{m}.{d}" for e in layout.table for _, d in e.params for m in e.diffusers}
        if unused:
            raise KeyError(f"diffusers transformer keys with no BFL name: {', '.join(sorted(unused)[:5])}")
        self.state = state
        self.sources = {
            f"{prefix}{entry.bfl}.{bfl_param}": (entry.kind, [f"{m}.{diff_param}" for m in entry.diffusers])
            for entry in layout.table
            for bfl_param, diff_param in entry.params
        }

    def __getitem__(self, key: str) -> Tensor:
        kind, names = self.sources[key]
        tensors = [self.state[n] for n in names]
        tensor = torch.cat(tensors, dim=0) if kind == "rows" else tensors[0]
        return _swap_halves(tensor) if kind == "swap" else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


# ------------------------------------------------------------------------------------------------ adapter names
def module_renames(layout: Layout) -> dict[str, str]:
    """diffusers module path -> BFL module path for the modules that are one BFL module each."""
    return {e.diffusers[0]: e.bfl for e in layout.table if e.kind == "one"}


def fused_modules(layout: Layout, width: int) -> tuple[Fused, ...]:
    """The BFL modules that are several diffusers Linear leaves (or rows of one): ``img_attn.qkv``,
    ``txt_attn.qkv``, ``linear1`` and ``final_layer.adaLN_modulation.1`` (rows D: then :D of ``norm_out.linear``)."""
    fused = []
    for e in layout.table:
        if e.kind == "rows":
            fused.append(Fused(e.bfl, tuple(Segment(m) for m in e.diffusers)))
        elif e.kind == "swap":
            fused.append(Fused(e.bfl, (Segment(e.diffusers[0], width, None), Segment(e.diffusers[0], 0, width))))
    return tuple(fused)
