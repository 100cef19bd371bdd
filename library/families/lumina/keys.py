"""Lumina Image 2.0 transformer names: the Alpha-VLLM single-file layout (sd-scripts' ``lumina_models.NextDiT``,
ComfyUI, ``lumina_2_model_bf16.safetensors``) <-> diffusers ``Lumina2Transformer2DModel``, both ways, any width and
block count.

One module table drives the state-dict conversion both ways, the module renames of adapter keys (kohya names use
Alpha-VLLM module paths: sd-scripts' ``networks/lora_lumina.py`` names ``lora_unet_layers_0_attention_qkv``) and the
fused adapter modules (``attention.qkv`` = diffusers' ``attn.to_q | to_k | to_v``, rows stacked: q has ``heads ·
head_dim`` rows, k and v ``kv_heads · head_dim`` each, read from the leaves' shapes).

The pairs are those of diffusers' ``convert_lumina2_to_diffusers`` (single_file_utils.py), which
tests/test_lumina_family.py uses as the oracle at the released widths. ``norm_final.weight`` (an RMSNorm that
NextDiT builds and never calls) has no diffusers counterpart: it is dropped when read and written as ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..base import Fused, Segment

PREFIX = "model.diffusion_model."  # ComfyUI / Neta-Lumina files
UNUSED = "norm_final.weight"  # NextDiT's unused RMSNorm
BLOCK_LISTS = ("layers", "noise_refiner", "context_refiner")
# module renames outside the blocks: Alpha-VLLM -> diffusers
_TOP = {
    "x_embedder": "x_embedder",
    "t_embedder.mlp.0": "time_caption_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_caption_embed.timestep_embedder.linear_2",
    "cap_embedder.0": "time_caption_embed.caption_embedder.0",
    "cap_embedder.1": "time_caption_embed.caption_embedder.1",
    "final_layer.adaLN_modulation.1": "norm_out.linear_1",
    "final_layer.linear": "norm_out.linear_2",
}
# module renames inside a block (Alpha-VLLM -> diffusers); attention_norm1 depends on the block's modulation
_BLOCK = {
    "attention.out": "attn.to_out.0",
    "attention.q_norm": "attn.norm_q",
    "attention.k_norm": "attn.norm_k",
    "feed_forward.w1": "feed_forward.linear_1",
    "feed_forward.w2": "feed_forward.linear_2",
    "feed_forward.w3": "feed_forward.linear_3",
    "adaLN_modulation.1": "norm1.linear",
    "attention_norm2": "norm2",
    "ffn_norm1": "ffn_norm1",
    "ffn_norm2": "ffn_norm2",
}
QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_BLOCK_RE = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")


def is_alpha(keys: Iterable[str]) -> bool:
    """Whether state-dict keys are an Alpha-VLLM Lumina 2 transformer (with or without ``model.diffusion_model.``)."""
    return any(k.removeprefix(PREFIX) == "cap_embedder.0.weight" for k in keys)


def is_diffusers(keys: Iterable[str]) -> bool:
    """Whether keys are a diffusers ``Lumina2Transformer2DModel`` state dict."""
    return any(k == "time_caption_embed.caption_embedder.0.weight" for k in keys)


def _norm1(block_list: str) -> str:
    return "norm1" if block_list == "context_refiner" else "norm1.norm"  # the context refiner has no modulation


def alpha_module_to_diffusers(path: str) -> str | None:
    """The diffusers module path of an Alpha-VLLM module path (``attention.qkv`` excluded: it is three), else None."""
    if path in _TOP:
        return _TOP[path]
    m = _BLOCK_RE.match(path)
    if m is None:
        return None
    lst, i, rest = m.groups()
    if rest == "attention_norm1":
        return f"{lst}.{i}.{_norm1(lst)}"
    return f"{lst}.{i}.{_BLOCK[rest]}" if rest in _BLOCK else None


def diffusers_module_to_alpha(path: str) -> str:
    """The Alpha-VLLM module path of a diffusers module path (``KeyError`` for one it has no name for, such as the
    leaves of ``attention.qkv``, which are a fused module)."""
    for alpha, diff in _TOP.items():
        if diff == path:
            return alpha
    m = _BLOCK_RE.match(path)
    if m is not None:
        lst, i, rest = m.groups()
        if rest == _norm1(lst):
            return f"{lst}.{i}.attention_norm1"
        for alpha, diff in _BLOCK.items():
            if diff == rest:
                return f"{lst}.{i}.{alpha}"
    raise KeyError(path)


def alpha_to_diffusers(state: Mapping[str, Tensor], heads: int, kv_heads: int) -> dict[str, Tensor]:
    """An Alpha-VLLM state dict (prefix or not) -> diffusers names; ``attention.qkv`` split into q (``heads`` parts of
    the head width) and k, v (``kv_heads`` each). ``ValueError`` naming a key it has no place for."""
    out: dict[str, Tensor] = {}
    for key in state.keys():
        name = key.removeprefix(PREFIX)
        if name == UNUSED:
            continue
        module, _, param = name.rpartition(".")
        if module.endswith("attention.qkv"):
            tensor = state[key]
            head = tensor.shape[0] // (heads + 2 * kv_heads)
            q, k, v = torch.split(tensor, [heads * head, kv_heads * head, kv_heads * head], dim=0)
            base = module.removesuffix("attention.qkv")
            out.update({f"{base}{leaf}.{param}": t for leaf, t in zip(QKV, (q, k, v))})
            continue
        target = alpha_module_to_diffusers(module)
        if target is None:
            raise ValueError(f"{key}: not a Lumina 2 (NextDiT) transformer weight")
        out[f"{target}.{param}"] = state[key]
    return out


def diffusers_to_alpha(state: Mapping[str, Tensor], *, prefix: str = "", dim: int | None = None) -> dict[str, Tensor]:
    """A diffusers ``Lumina2Transformer2DModel`` state dict -> Alpha-VLLM names under ``prefix`` (q, k, v stacked into
    ``attention.qkv``); ``dim``: the width, for the unused ``norm_final.weight`` (ones; None: read from
    ``x_embedder``)."""
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        if module.endswith(QKV[1:]):
            continue
        if module.endswith(QKV[0]):
            base = module.removesuffix(QKV[0])
            parts = [state[f"{base}{leaf}.{param}"] for leaf in QKV]
            out[f"{prefix}{base}attention.qkv.{param}"] = torch.cat(parts, dim=0)
            continue
        out[f"{prefix}{diffusers_module_to_alpha(module)}.{param}"] = tensor
    width = dim if dim is not None else state["x_embedder.weight"].shape[0]
    like = state["x_embedder.weight"]
    out[prefix + UNUSED] = torch.ones(width, dtype=like.dtype, device=like.device)
    return out


def rename(path: str) -> str:
    """Adapter roots' rename: diffusers module path -> Alpha-VLLM module path (``KeyError`` when it has none)."""
    return diffusers_module_to_alpha(path)


def fused_modules(denoiser: Any) -> tuple[Fused, ...]:
    """Every block's ``attention.qkv`` as the fused module over its ``attn.to_q | to_k | to_v`` leaves."""
    fused = []
    for lst in BLOCK_LISTS:
        for i in range(len(getattr(denoiser, lst))):
            fused.append(Fused(f"{lst}.{i}.attention.qkv", tuple(Segment(f"{lst}.{i}.{leaf}") for leaf in QKV)))
    return tuple(fused)


def block_counts(keys: Iterable[str]) -> dict[str, int]:
    """The number of blocks of each list in Alpha-VLLM keys (prefix or not)."""
    counts = dict.fromkeys(BLOCK_LISTS, 0)
    for key in keys:
        m = _BLOCK_RE.match(key.removeprefix(PREFIX))
        if m:
            counts[m.group(1)] = max(counts[m.group(1)], int(m.group(2)) + 1)
    return counts
