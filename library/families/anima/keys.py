"""Anima's two key layouts: sd-scripts' / ComfyUI's (``anima_models.Anima`` names, optionally under ``net.``, what
the released file, sd-scripts' full fine-tune and every LoRA file use) and diffusers' (``CosmosTransformer3DModel`` +
``AnimaTextConditioner``, what :class:`~library.families.anima.model.AnimaTransformer` holds).

The table is diffusers' own Cosmos-2.0 single-file conversion (``diffusers/loaders/single_file_utils.py:
convert_cosmos_transformer_checkpoint_to_diffusers``, the ``TRANSFORMER_KEYS_RENAME_DICT_COSMOS_2_0`` entries),
written per module path so it serves the weights (``sd_to_diffusers`` / ``diffusers_to_sd``) and the LoRA names (a
diffusers module path -> the sd-scripts path its ``lora_unet_`` name is made of: :func:`module_to_sd`). The LLM
adapter's names are the same in both layouts. sd-scripts' RoPE tables (``pos_embedder.seq``,
``dim_spatial_range``, ``dim_temporal_range``) are buffers diffusers computes: dropped on reading, written back on
saving (:func:`rope_buffers`) so sd-scripts' strict loader and ComfyUI read our files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

NET = "net."
ROPE_BUFFERS = ("pos_embedder.seq", "pos_embedder.dim_spatial_range", "pos_embedder.dim_temporal_range")

# (sd-scripts module path, diffusers module path): whole-path rules with the block index as \1
_BLOCK_RULES: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj", "attn1.to_q"), ("self_attn.k_proj", "attn1.to_k"), ("self_attn.v_proj", "attn1.to_v"),
    ("self_attn.output_proj", "attn1.to_out.0"), ("self_attn.q_norm", "attn1.norm_q"),
    ("self_attn.k_norm", "attn1.norm_k"),
    ("cross_attn.q_proj", "attn2.to_q"), ("cross_attn.k_proj", "attn2.to_k"), ("cross_attn.v_proj", "attn2.to_v"),
    ("cross_attn.output_proj", "attn2.to_out.0"), ("cross_attn.q_norm", "attn2.norm_q"),
    ("cross_attn.k_norm", "attn2.norm_k"),
    ("mlp.layer1", "ff.net.0.proj"), ("mlp.layer2", "ff.net.2"),
    ("adaln_modulation_self_attn.1", "norm1.linear_1"), ("adaln_modulation_self_attn.2", "norm1.linear_2"),
    ("adaln_modulation_cross_attn.1", "norm2.linear_1"), ("adaln_modulation_cross_attn.2", "norm2.linear_2"),
    ("adaln_modulation_mlp.1", "norm3.linear_1"), ("adaln_modulation_mlp.2", "norm3.linear_2"),
)  # fmt: skip
_TOP_RULES: tuple[tuple[str, str], ...] = (
    ("x_embedder.proj.1", "patch_embed.proj"),
    ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
    ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"),
    ("t_embedding_norm", "time_embed.norm"),
    ("final_layer.adaln_modulation.1", "norm_out.linear_1"),
    ("final_layer.adaln_modulation.2", "norm_out.linear_2"),
    ("final_layer.linear", "proj_out"),
)
_SD_TO_DIFF = {**dict(_TOP_RULES)}
_DIFF_TO_SD = {d: s for s, d in _TOP_RULES}
_BLOCK_SD = dict(_BLOCK_RULES)
_BLOCK_DIFF = {d: s for s, d in _BLOCK_RULES}
_SD_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_DIFF_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def module_to_diffusers(path: str) -> str:
    """sd-scripts module path -> diffusers module path; ``KeyError`` for one with no counterpart."""
    if path.startswith("llm_adapter.") or path == "llm_adapter":
        return path
    m = _SD_BLOCK.fullmatch(path)
    if m:
        return f"transformer_blocks.{m.group(1)}.{_BLOCK_SD[m.group(2)]}"
    return _SD_TO_DIFF[path]


def module_to_sd(path: str) -> str:
    """diffusers module path -> sd-scripts module path (the names of LoRA files); ``KeyError`` for none."""
    if path.startswith("llm_adapter.") or path == "llm_adapter":
        return path
    m = _DIFF_BLOCK.fullmatch(path)
    if m:
        return f"blocks.{m.group(1)}.{_BLOCK_DIFF[m.group(2)]}"
    return _DIFF_TO_SD[path]


def _split(key: str) -> tuple[str, str]:
    module, _, leaf = key.rpartition(".")
    return module, leaf


def strip_net(keys: list[str]) -> dict[str, str]:
    """bare sd-scripts key -> file key (``net.`` removed where present, as sd-scripts' loader does)."""
    return {(k[len(NET) :] if k.startswith(NET) else k): k for k in keys}


def sd_to_diffusers_names(sd_keys: list[str]) -> dict[str, str]:
    """diffusers key -> sd-scripts key for every weight (the RoPE buffers left out)."""
    names = {}
    for key in sd_keys:
        if key in ROPE_BUFFERS:
            continue
        module, leaf = _split(key)
        names[f"{module_to_diffusers(module)}.{leaf}"] = key
    return names


def diffusers_to_sd(state: Mapping[str, Tensor], prefix: str = NET) -> dict[str, Tensor]:
    """A diffusers state dict -> sd-scripts names under ``prefix`` (``net.``: sd-scripts' full fine-tune and ComfyUI),
    the RoPE buffers added (:func:`rope_buffers`)."""
    out = {}
    for key, value in state.items():
        module, leaf = _split(key)
        out[prefix + f"{module_to_sd(module)}.{leaf}"] = value
    return out


def rope_buffers(head_dim: int, max_size: tuple[int, int, int], patch: tuple[int, int, int]) -> dict[str, Tensor]:
    """sd-scripts' ``VideoRopePosition3DEmb`` persistent buffers (``seq``: 0..max-1; the spatial and temporal
    exponent ranges) for a head width and the position bound."""
    dim_h = head_dim // 6 * 2
    dim_t = head_dim - 2 * dim_h
    lengths = [m // p for m, p in zip(max_size, patch)]
    return {
        "pos_embedder.seq": torch.arange(max(lengths), dtype=torch.float32),
        "pos_embedder.dim_spatial_range": torch.arange(0, dim_h, 2)[: dim_h // 2].float() / dim_h,
        "pos_embedder.dim_temporal_range": torch.arange(0, dim_t, 2)[: dim_t // 2].float() / dim_t,
    }


def is_anima(keys: Any) -> bool:
    """Whether a state dict's keys are an Anima DiT's (sd-scripts names, with or without ``net.``): Cosmos-Predict2
    blocks and the LLM adapter (Cosmos-Predict2 files without the adapter are Anima DiTs waiting for
    ``--llm_adapter_path`` only when they carry the 16 + 1 channel patch embedding, which is every Cosmos-Predict2
    text-to-image file; they are taken too, the adapter flag then being required)."""
    keys = set(keys)
    for prefix in (NET, ""):
        if f"{prefix}x_embedder.proj.1.weight" in keys and f"{prefix}blocks.0.self_attn.q_proj.weight" in keys:
            return True
    return False
