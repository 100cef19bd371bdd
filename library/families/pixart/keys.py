"""PixArt transformer names: the official checkpoint layout (``PixArt-XL-2-1024-MS.pth``,
``PixArt-Sigma-XL-2-1024-MS.pth``; ComfyUI's ``diffusion_model.`` names) <-> diffusers ``PixArtTransformer2DModel``,
both ways, any width and depth.

The pairs are those of diffusers' ``scripts/convert_pixart_alpha_to_diffusers.py`` and
``convert_pixart_sigma_to_diffusers.py`` (tests/test_pixart_family.py replays the scripts' conversion on every key of a
tiny file): ``attn.qkv`` is ``attn1.to_q | to_k | to_v`` (rows stacked), ``cross_attn.kv_linear`` is ``attn2.to_k |
to_v``; the micro-conditioning embedders (``csize_embedder``, ``ar_embedder``) exist in PixArt-α 1024 only. Two
official tensors have no diffusers counterpart: ``pos_embed`` (the fixed sin-cos table the model recomputes) and
``y_embedder.y_embedding`` (the learned null caption of the original trainer's caption dropout, (T5 tokens, 4096):
120 rows for α, 300 for Σ, what ComfyUI reads the token length from). Both are dropped when read and written back on
save (:func:`diffusers_to_official`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..base import Fused, Segment

PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI-saved files
POS_EMBED = "pos_embed"
Y_EMBEDDING = "y_embedder.y_embedding"
EXTRA = (POS_EMBED, Y_EMBEDDING)
_TOP = {
    "x_embedder.proj": "pos_embed.proj",
    "y_embedder.y_proj.fc1": "caption_projection.linear_1",
    "y_embedder.y_proj.fc2": "caption_projection.linear_2",
    "t_embedder.mlp.0": "adaln_single.emb.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "adaln_single.emb.timestep_embedder.linear_2",
    "csize_embedder.mlp.0": "adaln_single.emb.resolution_embedder.linear_1",
    "csize_embedder.mlp.2": "adaln_single.emb.resolution_embedder.linear_2",
    "ar_embedder.mlp.0": "adaln_single.emb.aspect_ratio_embedder.linear_1",
    "ar_embedder.mlp.2": "adaln_single.emb.aspect_ratio_embedder.linear_2",
    "t_block.1": "adaln_single.linear",
    "final_layer.linear": "proj_out",
}
_BLOCK = {
    "attn.proj": "attn1.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "cross_attn.q_linear": "attn2.to_q",
    "cross_attn.proj": "attn2.to_out.0",
}
FUSED = {"attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v")}
_RE_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_RE_DIFF_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")


def strip(key: str) -> str:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def is_official(keys: Iterable[str]) -> bool:
    """Whether state-dict keys are an official PixArt transformer (prefix or not)."""
    return any(strip(k) == "t_block.1.weight" for k in keys)


def is_diffusers(keys: Iterable[str]) -> bool:
    """Whether keys are a diffusers ``PixArtTransformer2DModel`` (ComfyUI's rule: the adaLN-single timestep embedder
    and the patch embedding, without SD3's context embedder)."""
    keys = set(keys)
    return ("adaln_single.emb.timestep_embedder.linear_1.bias" in keys and "pos_embed.proj.bias" in keys
            and "caption_projection.linear_1.weight" in keys)  # fmt: skip


def has_micro_conditions(keys: Iterable[str]) -> bool:
    """Whether the weights hold the resolution / aspect-ratio embedders (PixArt-α 1024), either layout."""
    return any(strip(k).startswith(("ar_embedder.", "adaln_single.emb.aspect_ratio_embedder.")) for k in keys)


def module_to_diffusers(path: str) -> str | None:
    """The diffusers module path of an official module path (the fused modules excluded), else None."""
    if path in _TOP:
        return _TOP[path]
    m = _RE_BLOCK.match(path)
    if m is None:
        return None
    i, rest = m.groups()
    return f"transformer_blocks.{i}.{_BLOCK[rest]}" if rest in _BLOCK else None


def module_to_official(path: str) -> str:
    """The official module path of a diffusers module path (``KeyError`` for the leaves of a fused module)."""
    for official, diff in _TOP.items():
        if diff == path:
            return official
    m = _RE_DIFF_BLOCK.match(path)
    if m is not None:
        i, rest = m.groups()
        for official, diff in _BLOCK.items():
            if diff == rest:
                return f"blocks.{i}.{official}"
    raise KeyError(path)


def official_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An official state dict (prefix or not) -> diffusers names, ``pos_embed`` and ``y_embedder.y_embedding``
    left out; ``ValueError`` naming a key it has no place for (a qk-norm variant, another model)."""
    out: dict[str, Tensor] = {}
    for key in state.keys():
        name = strip(key)
        if name in EXTRA:
            continue
        module, _, param = name.rpartition(".")
        if name == "final_layer.scale_shift_table":
            out["scale_shift_table"] = state[key]
            continue
        m = _RE_BLOCK.match(name)
        if m and m.group(2) == "scale_shift_table":
            out[f"transformer_blocks.{m.group(1)}.scale_shift_table"] = state[key]
            continue
        m = _RE_BLOCK.match(module)
        if m and m.group(2) in FUSED:
            leaves = FUSED[m.group(2)]
            for leaf, t in zip(leaves, torch.chunk(state[key], len(leaves), dim=0)):
                out[f"transformer_blocks.{m.group(1)}.{leaf}.{param}"] = t
            continue
        target = module_to_diffusers(module)
        if target is None:
            raise ValueError(f"{key}: not a PixArt transformer weight (qk-norm and other variants are not supported)")
        out[f"{target}.{param}"] = state[key]
    return out


def diffusers_to_official(state: Mapping[str, Tensor], *, extras: Mapping[str, Tensor] | None = None,
                          prefix: str = "") -> dict[str, Tensor]:  # fmt: skip
    """A diffusers state dict -> official names under ``prefix`` (q, k, v stacked into ``attn.qkv``, k, v into
    ``cross_attn.kv_linear``), plus ``extras`` (``pos_embed``, ``y_embedder.y_embedding``) as given."""
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        if key == "pos_embed.pos_embed":  # diffusers' buffer when persistent: the official pos_embed
            continue
        if key == "scale_shift_table":
            out[prefix + "final_layer.scale_shift_table"] = tensor
            continue
        module, _, param = key.rpartition(".")
        m = _RE_DIFF_BLOCK.match(key)
        if m and m.group(2) == "scale_shift_table":
            out[f"{prefix}blocks.{m.group(1)}.scale_shift_table"] = tensor
            continue
        m = _RE_DIFF_BLOCK.match(module)
        fused = next(((name, leaves) for name, leaves in FUSED.items() if m and m.group(2) in leaves), None)
        if fused is not None:
            name, leaves = fused
            if m.group(2) == leaves[0]:
                rows = [state[f"transformer_blocks.{m.group(1)}.{leaf}.{param}"] for leaf in leaves]
                out[f"{prefix}blocks.{m.group(1)}.{name}.{param}"] = torch.cat(rows, dim=0)
            continue
        out[f"{prefix}{module_to_official(module)}.{param}"] = tensor
    for name, tensor in (extras or {}).items():
        out[prefix + name] = tensor
    return out


def rename(path: str) -> str:
    """Adapter roots' rename: diffusers module path -> official module path (``KeyError`` when it has none)."""
    return module_to_official(path)


def fused_modules(denoiser: Any) -> tuple[Fused, ...]:
    """Every block's ``attn.qkv`` and ``cross_attn.kv_linear`` as fused modules over their diffusers leaves."""
    fused = []
    for i in range(len(denoiser.transformer_blocks)):
        for name, leaves in FUSED.items():
            fused.append(
                Fused(f"blocks.{i}.{name}", tuple(Segment(f"transformer_blocks.{i}.{leaf}") for leaf in leaves))
            )
    return tuple(fused)


def depth(keys: Iterable[str]) -> int:
    """The number of transformer blocks in official keys (prefix or not)."""
    found = [int(m.group(1)) for k in keys if (m := _RE_BLOCK.match(strip(k)))]
    return 1 + max(found) if found else 0
