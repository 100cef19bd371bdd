"""FLUX.2 transformer names: BFL's single-file layout (``flux2-dev.safetensors``, ``flux2-klein-4b.safetensors``,
musubi-tuner's ``Flux2`` module) <-> diffusers' ``Flux2Transformer2DModel``, both ways, for any width and depth.

One table of modules (:func:`module_table`) drives the state-dict conversion both ways, the adapter key names (kohya
names use BFL module paths: musubi-tuner's ``networks/lora_flux_2.py``, ComfyUI, diffusers'
``_convert_kohya_flux2_lora_to_diffusers``) and the fused adapter modules. An :class:`Entry` maps one BFL module to
one or more diffusers modules: ``"one"`` the same tensor (norm ``scale`` <-> ``weight``); ``"rows"`` the BFL weight
is the diffusers weights stacked on the output axis (``img_attn.qkv`` = ``to_q | to_k | to_v``, ``txt_attn.qkv`` =
``add_q_proj | add_k_proj | add_v_proj``); ``"swap"`` ``final_layer.adaLN_modulation.1`` = ``norm_out.linear`` with
its halves swapped (BFL: shift, scale). FLUX.2's single blocks are fused in diffusers too (``attn.to_qkv_mlp_proj``).
No Linear has a bias. The pairs are those of diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers``
(tests/test_flux2.py checks every key of a tiny file against it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

from ..base import Fused, Segment

BFL_PREFIX = "model.diffusion_model."
_W = (("weight", "weight"),)
_NORM = (("scale", "weight"),)


@dataclass(frozen=True)
class Entry:
    """One BFL module and the diffusers module(s) it is; ``params``: (BFL, diffusers) parameter names."""

    bfl: str
    diffusers: tuple[str, ...]
    kind: str = "one"  # "one" | "rows" | "swap"
    params: tuple[tuple[str, str], ...] = _W


def _double(i: int) -> list[Entry]:
    b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}.attn."
    f = f"transformer_blocks.{i}."
    return [
        Entry(b + "img_attn.qkv", (d + "to_q", d + "to_k", d + "to_v"), "rows"),
        Entry(b + "img_attn.norm.query_norm", (d + "norm_q",), params=_NORM),
        Entry(b + "img_attn.norm.key_norm", (d + "norm_k",), params=_NORM),
        Entry(b + "img_attn.proj", (d + "to_out.0",)),
        Entry(b + "img_mlp.0", (f + "ff.linear_in",)),
        Entry(b + "img_mlp.2", (f + "ff.linear_out",)),
        Entry(b + "txt_attn.qkv", (d + "add_q_proj", d + "add_k_proj", d + "add_v_proj"), "rows"),
        Entry(b + "txt_attn.norm.query_norm", (d + "norm_added_q",), params=_NORM),
        Entry(b + "txt_attn.norm.key_norm", (d + "norm_added_k",), params=_NORM),
        Entry(b + "txt_attn.proj", (d + "to_add_out",)),
        Entry(b + "txt_mlp.0", (f + "ff_context.linear_in",)),
        Entry(b + "txt_mlp.2", (f + "ff_context.linear_out",)),
    ]


def _single(i: int) -> list[Entry]:
    b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}.attn."
    return [
        Entry(b + "linear1", (d + "to_qkv_mlp_proj",)),
        Entry(b + "linear2", (d + "to_out",)),
        Entry(b + "norm.query_norm", (d + "norm_q",), params=_NORM),
        Entry(b + "norm.key_norm", (d + "norm_k",), params=_NORM),
    ]


@cache
def module_table(num_double: int, num_single: int, guidance: bool) -> tuple[Entry, ...]:
    """Every weight-holding module of a FLUX.2 transformer (``guidance``: dev's ``guidance_in``)."""
    emb = "time_guidance_embed."
    top = [Entry("img_in", ("x_embedder",)), Entry("txt_in", ("context_embedder",)),
           Entry("time_in.in_layer", (emb + "timestep_embedder.linear_1",)),
           Entry("time_in.out_layer", (emb + "timestep_embedder.linear_2",))]  # fmt: skip
    if guidance:
        top += [Entry("guidance_in.in_layer", (emb + "guidance_embedder.linear_1",)),
                Entry("guidance_in.out_layer", (emb + "guidance_embedder.linear_2",))]  # fmt: skip
    top += [Entry(f"{m}.lin", (f"{m}.linear",)) for m in
            ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")]  # fmt: skip
    blocks = [e for i in range(num_double) for e in _double(i)] + [e for i in range(num_single) for e in _single(i)]
    final = [Entry("final_layer.linear", ("proj_out",)), Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",),
                                                               "swap")]  # fmt: skip
    return (*top, *blocks, *final)


def _count(keys: Iterable[str], head: str) -> int:
    found = [int(k.split(".")[1]) for k in keys if k.startswith(head)]
    return 1 + max(found) if found else 0


def layout_of_bfl(keys: Iterable[str]) -> tuple[int, int, bool]:
    """(double blocks, single blocks, guidance) of a BFL state dict's (unprefixed) keys."""
    keys = list(keys)
    return _count(keys, "double_blocks."), _count(keys, "single_blocks."), "guidance_in.in_layer.weight" in keys


def layout_of_diffusers(keys: Iterable[str]) -> tuple[int, int, bool]:
    keys = list(keys)
    guidance = any(k.startswith("time_guidance_embed.guidance_embedder.") for k in keys)
    return _count(keys, "transformer_blocks."), _count(keys, "single_transformer_blocks."), guidance


def _swap(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class BflView(Mapping):
    """A BFL transformer state dict (bare or under ``model.diffusion_model.``) seen under diffusers' names, each tensor
    read when asked (a ``qkv`` tensor is read once per leaf and chunked in three)."""

    def __init__(self, source: Mapping[str, Any]) -> None:
        self.source = source
        keys = list(source.keys())
        self.prefix = BFL_PREFIX if any(k.startswith(BFL_PREFIX + "img_in.") for k in keys) else ""
        bare = [k[len(self.prefix) :] for k in keys if k.startswith(self.prefix)]
        self.where: dict[str, tuple[str, str, int]] = {}  # diffusers key -> (source key, kind, leaf index)
        present = set(bare)
        for e in module_table(*layout_of_bfl(bare)):
            for bfl_param, diff_param in e.params:
                name = f"{e.bfl}.{bfl_param}"
                if name in present:
                    for i, leaf in enumerate(e.diffusers):
                        self.where[f"{leaf}.{diff_param}"] = (self.prefix + name, e.kind, i)
        self.unread = sorted(present - {w[0][len(self.prefix) :] for w in self.where.values()})

    def __getitem__(self, key: str) -> Tensor:
        source, kind, i = self.where[key]
        value = self.source[source]
        if kind == "rows":
            return value.chunk(3, dim=0)[i]
        return _swap(value) if kind == "swap" else value

    def shape(self, key: str) -> torch.Size:
        source, kind, _ = self.where[key]
        s = self.source.shape(source) if callable(getattr(self.source, "shape", None)) else self.source[source].shape
        return torch.Size((s[0] // 3, *s[1:])) if kind == "rows" else torch.Size(s)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def to_bfl(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A diffusers FLUX.2 transformer state dict -> BFL names (qkv concatenated, the final modulation swapped)."""
    out = {}
    for e in module_table(*layout_of_diffusers(state.keys())):
        for bfl_param, diff_param in e.params:
            leaves = [state[f"{leaf}.{diff_param}"] for leaf in e.diffusers]
            value = torch.cat(leaves, dim=0) if e.kind == "rows" else leaves[0]
            out[f"{e.bfl}.{bfl_param}"] = _swap(value) if e.kind == "swap" else value
    return out


def module_renames(num_double: int, num_single: int, guidance: bool) -> dict[str, str]:
    """diffusers module path -> BFL module path, for the modules that are one BFL module each (adapter names)."""
    return {e.diffusers[0]: e.bfl for e in module_table(num_double, num_single, guidance) if e.kind == "one"}


def fused_modules(num_double: int, num_single: int, guidance: bool, width: int) -> tuple[Fused, ...]:
    """The BFL modules that are several diffusers Linears (the double blocks' ``qkv``) or swapped (the final
    modulation: ``width`` rows each half), as adapter :class:`Fused` entries."""
    out = []
    for e in module_table(num_double, num_single, guidance):
        if e.kind == "rows":
            out.append(Fused(e.bfl, tuple(Segment(m) for m in e.diffusers)))
        elif e.kind == "swap":
            leaf = e.diffusers[0]
            out.append(Fused(e.bfl, (Segment(leaf, width, None), Segment(leaf, 0, width))))
    return tuple(out)


_BLOCK_PATH = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_module(path: str) -> str:
    """The BFL module path of a diffusers module path inside a block (``transformer_blocks.0.attn.to_q`` ->
    ``double_blocks.0.img_attn.qkv``); other paths are returned as they are."""
    m = _BLOCK_PATH.match(path)
    if m is None:
        return path
    i = int(m.group(2))
    for e in _double(i) if m.group(1) == "transformer_blocks" else _single(i):
        if path in e.diffusers:
            return e.bfl
    return path
