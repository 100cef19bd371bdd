"""SD3 / SD3.5 transformer names: SAI single-file layout (MMDiT, ``model.diffusion_model.``) <-> diffusers
``SD3Transformer2DModel``, both ways, for any width and depth.

One table of *modules* drives everything, as in ``families/flux/keys.py``: the state-dict conversion both ways, the
module renames of adapter keys (kohya names use SAI module paths, as sd-scripts' ``networks/lora_sd3.py`` and
ComfyUI do) and the fused adapter modules. An :class:`Entry` maps one SAI module to one or more diffusers modules:

* ``"one"``: the same tensor under another name;
* ``"rows"``: the SAI weight is the diffusers weights stacked on the output axis, in order:
  ``joint_blocks.N.x_block.attn.qkv`` = ``attn.to_q | to_k | to_v`` (3 × D rows),
  ``joint_blocks.N.context_block.attn.qkv`` = ``attn.add_q_proj | add_k_proj | add_v_proj``,
  ``joint_blocks.N.x_block.attn2.qkv`` = ``attn2.to_q | to_k | to_v`` (SD3.5-medium's dual-attention blocks);
  the split is three equal parts, so any width works;
* ``"swap"``: ``final_layer.adaLN_modulation.1`` = diffusers ``norm_out.linear`` and, in the last block (whose
  context side is ``context_pre_only``: no attention output, no MLP), ``context_block.adaLN_modulation.1`` =
  ``norm1_context.linear``, each with its two halves swapped (SAI stores shift, scale; diffusers'
  ``AdaLayerNormContinuous`` reads scale, shift).

The pairs are those of diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers`` (single_file_utils.py);
tests/test_sd3_family.py checks the table against it both ways. The layout (depth, dual-attention blocks, qk norm)
is read from the keys as sd-scripts' ``sd3_utils.analyze_state_dict_state`` does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from ..base import Fused, Segment

SAI_PREFIX = "model.diffusion_model."
SD3, SD35_MEDIUM, SD35_LARGE = "sd3", "sd3.5-medium", "sd3.5-large"
TOP_MODULES = ("pos_embed", "x_embedder", "t_embedder", "y_embedder", "context_embedder", "joint_blocks",
               "final_layer")  # fmt: skip
_LINEAR = (("weight", "weight"), ("bias", "bias"))
_NORM = (("weight", "weight"),)


@dataclass(frozen=True)
class Entry:
    """One SAI module and the diffusers module(s) it is. ``params``: (SAI, diffusers) parameter names. A module path
    "" is the model itself (``pos_embed`` is a parameter of the MMDiT, a buffer of diffusers' ``pos_embed``)."""

    sai: str
    diffusers: tuple[str, ...]
    kind: str = "one"  # "one" | "rows" | "swap"
    params: tuple[tuple[str, str], ...] = _LINEAR


def param_key(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def _block(i: int, last: bool, dual: bool, qk_norm: bool) -> list[Entry]:
    s, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}."
    x, c = s + "x_block.", s + "context_block."
    out = [
        Entry(x + "attn.qkv", (d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"), "rows"),
        Entry(x + "attn.proj", (d + "attn.to_out.0",)),
        Entry(x + "adaLN_modulation.1", (d + "norm1.linear",)),
        Entry(x + "mlp.fc1", (d + "ff.net.0.proj",)),
        Entry(x + "mlp.fc2", (d + "ff.net.2",)),
        Entry(c + "attn.qkv", (d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"), "rows"),
    ]
    if qk_norm:
        out += [
            Entry(x + "attn.ln_q", (d + "attn.norm_q",), params=_NORM),
            Entry(x + "attn.ln_k", (d + "attn.norm_k",), params=_NORM),
            Entry(c + "attn.ln_q", (d + "attn.norm_added_q",), params=_NORM),
            Entry(c + "attn.ln_k", (d + "attn.norm_added_k",), params=_NORM),
        ]
    if last:  # context_pre_only: the context side only modulates and projects q/k/v
        out.append(Entry(c + "adaLN_modulation.1", (d + "norm1_context.linear",), "swap"))
    else:
        out += [
            Entry(c + "attn.proj", (d + "attn.to_add_out",)),
            Entry(c + "adaLN_modulation.1", (d + "norm1_context.linear",)),
            Entry(c + "mlp.fc1", (d + "ff_context.net.0.proj",)),
            Entry(c + "mlp.fc2", (d + "ff_context.net.2",)),
        ]
    if dual:
        out += [
            Entry(x + "attn2.qkv", (d + "attn2.to_q", d + "attn2.to_k", d + "attn2.to_v"), "rows"),
            Entry(x + "attn2.proj", (d + "attn2.to_out.0",)),
        ]
        if qk_norm:
            out += [
                Entry(x + "attn2.ln_q", (d + "attn2.norm_q",), params=_NORM),
                Entry(x + "attn2.ln_k", (d + "attn2.norm_k",), params=_NORM),
            ]
    return out


@cache
def module_table(num_layers: int, dual_attention_layers: tuple[int, ...] = (), qk_norm: bool = False
                 ) -> tuple[Entry, ...]:  # fmt: skip
    """Every weight-holding module of an SD3 / SD3.5 transformer with ``num_layers`` joint blocks, a second
    (self-)attention in the blocks ``dual_attention_layers`` (SD3.5-medium: 0..12) and RMS q/k norms (SD3.5)."""
    top = [
        Entry("", ("pos_embed",), params=(("pos_embed", "pos_embed"),)),
        Entry("x_embedder.proj", ("pos_embed.proj",)),
        Entry("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
        Entry("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
        Entry("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
        Entry("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",)),
        Entry("context_embedder", ("context_embedder",)),
    ]
    blocks = [e for i in range(num_layers) for e in _block(i, i == num_layers - 1, i in dual_attention_layers, qk_norm)]
    final = [
        Entry("final_layer.linear", ("proj_out",)),
        Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap"),
    ]
    return (*top, *blocks, *final)


# ------------------------------------------------------------------------------------------------ what a file holds
@dataclass(frozen=True)
class Layout:
    """What an SD3 transformer state dict (SAI or diffusers names) is: depth, dual-attention blocks, qk norm."""

    num_layers: int
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: bool = False

    @property
    def table(self) -> tuple[Entry, ...]:
        return module_table(self.num_layers, self.dual_attention_layers, self.qk_norm)

    @property
    def variant(self) -> str:
        """ "sd3.5-medium" with dual attention, "sd3.5-large" with q/k norms only, "sd3" (SD3 medium) with neither
        (the released models: SD3-medium has no q/k norm, SD3.5-large no ``attn2``)."""
        if self.dual_attention_layers:
            return SD35_MEDIUM
        return SD35_LARGE if self.qk_norm else SD3


def _count(keys: Iterable[str], pattern: str) -> int:
    found = [int(m.group(1)) for k in keys if (m := re.match(pattern, k))]
    return max(found) + 1 if found else 0


def _indices(keys: Iterable[str], pattern: str) -> tuple[int, ...]:
    return tuple(sorted({int(m.group(1)) for k in keys if (m := re.match(pattern, k))}))


def strip_sai_prefix(keys: Iterable[str]) -> list[str]:
    return [k.removeprefix(SAI_PREFIX) for k in keys]


def is_sai(keys: Iterable[str]) -> bool:
    """Whether the keys (with or without ``model.diffusion_model.``) are an SAI SD3 / SD3.5 transformer."""
    return any(k.endswith("joint_blocks.0.x_block.attn.qkv.weight") for k in keys)


def is_diffusers(keys: Iterable[str]) -> bool:
    """Whether the keys are a diffusers SD3 transformer (``transformer.`` prefix removed)."""
    keys = set(keys)
    return "pos_embed.proj.weight" in keys and "transformer_blocks.0.attn.add_k_proj.weight" in keys


def sai_layout(keys: Iterable[str]) -> Layout:
    """The layout of SAI keys (``model.diffusion_model.`` prefix or not)."""
    keys = strip_sai_prefix(keys)
    return Layout(
        _count(keys, r"joint_blocks\.(\d+)\."),
        _indices(keys, r"joint_blocks\.(\d+)\.x_block\.attn2\."),
        any(k.endswith("x_block.attn.ln_q.weight") for k in keys),
    )


def diffusers_layout(keys: Iterable[str]) -> Layout:
    """The layout of diffusers transformer keys."""
    keys = list(keys)
    return Layout(
        _count(keys, r"transformer_blocks\.(\d+)\."),
        _indices(keys, r"transformer_blocks\.(\d+)\.attn2\."),
        any(k.endswith(".attn.norm_q.weight") for k in keys),
    )


# ------------------------------------------------------------------------------------------------ state dicts
def _swap_halves(tensor: Tensor) -> Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


class SaiToDiffusers(Mapping):
    """An SAI transformer state dict seen under diffusers names, read lazily (a fused SAI tensor is read once for its
    consecutive parts). ``source``: a dict or a lazy reader (``weight_files.SafetensorsReader``), keys with or
    without ``model.diffusion_model.``."""

    def __init__(self, source: Mapping[str, Tensor], layout: Layout | None = None) -> None:
        self.source = source
        self.prefix = SAI_PREFIX if any(k.startswith(SAI_PREFIX) for k in source) else ""
        self.layout = layout or sai_layout(source.keys())
        self.plan: dict[str, tuple[Entry, str, int]] = {}  # diffusers key -> (entry, SAI param, part index)
        for entry in self.layout.table:
            for sai_param, diff_param in entry.params:
                for i, module in enumerate(entry.diffusers):
                    self.plan[param_key(module, diff_param)] = (entry, sai_param, i)
        self._cached: tuple[str, Tensor] | None = None

    def sai_key(self, key: str) -> str:
        entry, param, _ = self.plan[key]
        return self.prefix + param_key(entry.sai, param)

    def _source_shape(self, key: str) -> torch.Size:
        shape = self.source.shape(key) if callable(getattr(self.source, "shape", None)) else self.source[key].shape
        return torch.Size(shape)

    @property
    def width(self) -> int:
        """The hidden size D (output channels of ``x_embedder.proj``)."""
        return int(self._source_shape(self.prefix + "x_embedder.proj.weight")[0])

    def _read(self, key: str) -> Tensor:
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.source[key])
        return self._cached[1]

    def __getitem__(self, key: str) -> Tensor:
        entry, _, i = self.plan[key]
        tensor = self._read(self.sai_key(key))
        if entry.kind == "rows":
            return tensor.chunk(len(entry.diffusers), dim=0)[i]
        return _swap_halves(tensor) if entry.kind == "swap" else tensor

    def shape(self, key: str) -> torch.Size:
        """The shape of a converted tensor, read from the source's shapes only."""
        entry, _, _ = self.plan[key]
        shape = self._source_shape(self.sai_key(key))
        if entry.kind != "rows":
            return shape
        return torch.Size((shape[0] // len(entry.diffusers), *shape[1:]))

    def missing_sources(self) -> list[str]:
        """SAI keys the layout needs that the source lacks."""
        keys = set(self.source.keys())
        return sorted({s for k in self.plan if (s := self.sai_key(k)) not in keys})

    def unused_sources(self) -> list[str]:
        """Source keys no diffusers key reads (a file of another architecture, or extra tensors)."""
        used = {self.sai_key(k) for k in self.plan}
        return sorted(k for k in self.source.keys() if k not in used)

    def __iter__(self) -> Iterator[str]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


def sai_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An SAI transformer state dict -> diffusers names (every tensor read; see :class:`SaiToDiffusers`)."""
    view = SaiToDiffusers(state)
    missing = view.missing_sources()
    if missing:
        raise KeyError(f"the SAI SD3 state dict lacks {len(missing)} keys, e.g. {', '.join(missing[:3])}")
    return {k: view[k] for k in view}


def diffusers_to_sai(state: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A diffusers SD3 transformer state dict -> SAI names (fused tensors concatenated, the swapped modulations'
    halves swapped back); ``prefix``: e.g. ``model.diffusion_model.``."""
    layout = diffusers_layout(state.keys())
    out = {}
    for entry in layout.table:
        for sai_param, diff_param in entry.params:
            tensors = [state[param_key(m, diff_param)] for m in entry.diffusers]
            tensor = torch.cat(tensors, dim=0) if entry.kind == "rows" else tensors[0]
            out[prefix + param_key(entry.sai, sai_param)] = _swap_halves(tensor) if entry.kind == "swap" else tensor
    used = {param_key(m, d) for e in layout.table for _, d in e.params for m in e.diffusers}
    unused = set(state) - used
    if unused:
        raise KeyError(f"diffusers SD3 transformer keys with no SAI name: {', '.join(sorted(unused)[:5])}")
    return out


# ------------------------------------------------------------------------------------------------ adapter names
def module_renames(layout: Layout) -> dict[str, str]:
    """diffusers module path -> SAI module path for the modules that are one SAI module each (``pos_embed``, a
    parameter, is no module and has no rename)."""
    return {e.diffusers[0]: e.sai for e in layout.table if e.kind == "one" and e.sai}


def fused_modules(layout: Layout, width: int) -> tuple[Fused, ...]:
    """The SAI modules that are several diffusers Linear leaves (or rows of one): the ``qkv`` projections, and the
    swapped modulations (``final_layer.adaLN_modulation.1``, the last block's ``context_block.adaLN_modulation.1``:
    rows D: then :D of the diffusers Linear; ``width`` = D)."""
    fused = []
    for e in layout.table:
        if e.kind == "rows":
            fused.append(Fused(e.sai, tuple(Segment(m) for m in e.diffusers)))
        elif e.kind == "swap":
            fused.append(Fused(e.sai, (Segment(e.diffusers[0], width, None), Segment(e.diffusers[0], 0, width))))
    return tuple(fused)
