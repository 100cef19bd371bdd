"""HunyuanImage 2.1 transformer names: Tencent's single file (``hunyuanimage2.1.safetensors``, what sd-scripts'
``hunyuan_image_models.HYImageDiffusionTransformer`` loads with ``strict=True`` and ComfyUI reads) <-> diffusers
``HunyuanImageTransformer2DModel``, both ways, any width and block count.

One table of module pairs drives the state-dict conversion both ways, the module renames of adapter keys (kohya
names use Tencent's module paths: sd-scripts' ``networks/lora_hunyuan_image.py`` names
``lora_unet_double_blocks_0_img_attn_qkv``) and the fused adapter modules. Tencent fuses, diffusers splits:

* ``double_blocks.N.img_attn_qkv`` = ``transformer_blocks.N.attn.to_q | to_k | to_v`` (three equal row blocks);
* ``double_blocks.N.txt_attn_qkv`` = ``attn.add_q_proj | add_k_proj | add_v_proj``;
* ``txt_in.individual_token_refiner.blocks.N.self_attn_qkv`` = the refiner block's ``attn.to_q | to_k | to_v``;
* ``single_blocks.N.linear1`` = ``single_transformer_blocks.N.attn.to_q | to_k | to_v | proj_mlp`` (three blocks of
  the width, then the MLP's rows);
* ``final_layer.adaLN_modulation.1`` (shift, scale) = ``norm_out.linear`` (scale, shift): the halves swapped.

The pairs are those of diffusers' ``scripts/convert_hunyuan_image_to_diffusers.py`` (HunyuanImage 2.1: no guidance
embedder, no meanflow); ``benchmarks/hunyuan_image_vs_sdscripts.py`` checks the forward of sd-scripts' own model
against diffusers' on the same tiny weights through this table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..base import Fused, Segment

PREFIX = "model.diffusion_model."  # ComfyUI-saved checkpoints may carry it
FINAL_MOD = "final_layer.adaLN_modulation.1"
FINAL_MOD_DIFFUSERS = "norm_out.linear"
# module renames outside the blocks: Tencent -> diffusers
_TOP = {
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "img_in.proj": "x_embedder.proj",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "time_in.mlp.0": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
# block lists: Tencent list -> (diffusers list, module renames inside a block, fused modules -> leaves)
_REFINER = "txt_in.individual_token_refiner.blocks"
_LISTS: dict[str, tuple[str, dict[str, str], dict[str, tuple[str, ...]]]] = {
    "double_blocks": (
        "transformer_blocks",
        {
            "img_mod.linear": "norm1.linear",
            "txt_mod.linear": "norm1_context.linear",
            "img_attn_q_norm": "attn.norm_q",
            "img_attn_k_norm": "attn.norm_k",
            "img_attn_proj": "attn.to_out.0",
            "img_mlp.fc1": "ff.net.0.proj",
            "img_mlp.fc2": "ff.net.2",
            "txt_attn_q_norm": "attn.norm_added_q",
            "txt_attn_k_norm": "attn.norm_added_k",
            "txt_attn_proj": "attn.to_add_out",
            "txt_mlp.fc1": "ff_context.net.0.proj",
            "txt_mlp.fc2": "ff_context.net.2",
        },
        {
            "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
            "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        },
    ),
    "single_blocks": (
        "single_transformer_blocks",
        {"modulation.linear": "norm.linear", "q_norm": "attn.norm_q", "k_norm": "attn.norm_k", "linear2": "proj_out"},
        {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")},
    ),
    _REFINER: (
        "context_embedder.token_refiner.refiner_blocks",
        {
            "norm1": "norm1",
            "norm2": "norm2",
            "self_attn_proj": "attn.to_out.0",
            "mlp.fc1": "ff.net.0.proj",
            "mlp.fc2": "ff.net.2",
            "adaLN_modulation.1": "norm_out.linear",
        },
        {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")},
    ),
}
_TENCENT_RE = re.compile(r"^(double_blocks|single_blocks|txt_in\.individual_token_refiner\.blocks)\.(\d+)\.(.+)$")
_DIFFUSERS_RE = re.compile(
    r"^(transformer_blocks|single_transformer_blocks|context_embedder\.token_refiner\.refiner_blocks)\.(\d+)\.(.+)$"
)
_BY_DIFFUSERS_LIST = {diff: tencent for tencent, (diff, _, _) in _LISTS.items()}


def is_tencent(keys: Iterable[str]) -> bool:
    """Whether state-dict keys are a Tencent HunyuanImage 2.1 transformer (``model.diffusion_model.`` or not)."""
    return any(k.removeprefix(PREFIX) == "byt5_in.fc1.weight" for k in keys)


def is_diffusers(keys: Iterable[str]) -> bool:
    """Whether keys are a diffusers ``HunyuanImageTransformer2DModel`` state dict."""
    return any(k == "context_embedder.token_refiner.refiner_blocks.0.norm1.weight" for k in keys)


def tencent_module_to_diffusers(path: str) -> str | None:
    """The diffusers module path of a Tencent module path (fused modules and the final modulation excluded: they are
    several leaves or reordered rows), else None."""
    if path in _TOP:
        return _TOP[path]
    m = _TENCENT_RE.match(path)
    if m is None:
        return None
    lst, i, rest = m.groups()
    diff_list, renames, _ = _LISTS[lst]
    return f"{diff_list}.{i}.{renames[rest]}" if rest in renames else None


def diffusers_module_to_tencent(path: str) -> str:
    """The Tencent module path of a diffusers module path (``KeyError`` for the leaves of a fused module and for
    ``norm_out.linear``, whose rows Tencent orders the other way)."""
    for tencent, diff in _TOP.items():
        if diff == path:
            return tencent
    m = _DIFFUSERS_RE.match(path)
    if m is not None:
        diff_list, i, rest = m.groups()
        tencent_list = _BY_DIFFUSERS_LIST[diff_list]
        for tencent, diff in _LISTS[tencent_list][1].items():
            if diff == rest:
                return f"{tencent_list}.{i}.{tencent}"
    raise KeyError(path)


def _fused_sizes(lst: str, leaves: tuple[str, ...], total: int, width: int) -> list[int]:
    if len(leaves) == 3:
        return [total // 3] * 3
    return [width, width, width, total - 3 * width]  # single_blocks.linear1: q, k, v, then the MLP's rows


def _swap_halves(tensor: Tensor) -> Tensor:
    a, b = tensor.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


Piece = tuple[str, int, int | None, bool]  # (source key, first row, last row (None: to the end), halves swapped)


def tencent_plan(shapes: Mapping[str, Sequence[int]]) -> dict[str, Piece]:
    """diffusers key -> where its tensor is in a Tencent state dict (prefix or not) of these ``shapes``: fused rows
    split, the final modulation's halves swapped. ``ValueError`` naming a key it has no place for."""
    width = None
    for key, shape in shapes.items():
        if key.removeprefix(PREFIX) == "img_in.proj.weight":
            width = int(shape[0])
    plan: dict[str, Piece] = {}
    for key, shape in shapes.items():
        name = key.removeprefix(PREFIX)
        module, _, param = name.rpartition(".")
        if module == FINAL_MOD:
            plan[f"{FINAL_MOD_DIFFUSERS}.{param}"] = (key, 0, None, True)
            continue
        m = _TENCENT_RE.match(module)
        if m is not None and m.group(3) in _LISTS[m.group(1)][2]:
            lst, i, rest = m.groups()
            diff_list, _, fused = _LISTS[lst]
            if width is None:
                raise ValueError(f"{key}: the file has no img_in.proj.weight, so the width is unknown")
            leaves, start = fused[rest], 0
            for leaf, size in zip(leaves, _fused_sizes(lst, leaves, int(shape[0]), width)):
                plan[f"{diff_list}.{i}.{leaf}.{param}"] = (key, start, start + size, False)
                start += size
            continue
        target = tencent_module_to_diffusers(module)
        if target is None:
            raise ValueError(f"{key}: not a HunyuanImage 2.1 transformer weight (Tencent layout)")
        plan[f"{target}.{param}"] = (key, 0, None, False)
    return plan


def piece(tensor: Tensor, where: Piece) -> Tensor:
    """The rows ``where`` names of a source tensor (halves swapped when it says so)."""
    _, start, stop, swap = where
    out = tensor if (start == 0 and stop is None) else tensor[start:stop]
    return _swap_halves(out) if swap else out


def tencent_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A Tencent state dict (prefix or not) -> diffusers names (:func:`tencent_plan`)."""
    plan = tencent_plan({k: tuple(v.shape) for k, v in state.items()})
    return {key: piece(state[where[0]], where) for key, where in plan.items()}


def diffusers_to_tencent(state: Mapping[str, Tensor], *, prefix: str = "") -> dict[str, Tensor]:
    """A diffusers ``HunyuanImageTransformer2DModel`` state dict -> Tencent names under ``prefix`` (fused rows
    stacked, the final modulation's halves swapped back)."""
    leaf_of: dict[str, tuple[str, str, tuple[str, ...], int]] = {}  # diffusers leaf -> (fused, base, leaves, index)
    out: dict[str, Tensor] = {}
    for key in state:
        module, _, param = key.rpartition(".")
        m = _DIFFUSERS_RE.match(module)
        if m is None:
            continue
        diff_list, i, rest = m.groups()
        tencent_list = _BY_DIFFUSERS_LIST[diff_list]
        for fused, leaves in _LISTS[tencent_list][2].items():
            if rest in leaves:
                leaf_of[module] = (f"{tencent_list}.{i}.{fused}", f"{diff_list}.{i}.", leaves, leaves.index(rest))
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        if module == FINAL_MOD_DIFFUSERS:
            out[f"{prefix}{FINAL_MOD}.{param}"] = _swap_halves(tensor)
        elif module in leaf_of:
            fused, base, leaves, position = leaf_of[module]
            if position:
                continue
            out[f"{prefix}{fused}.{param}"] = torch.cat([state[f"{base}{leaf}.{param}"] for leaf in leaves], dim=0)
        else:
            out[f"{prefix}{diffusers_module_to_tencent(module)}.{param}"] = tensor
    return out


def rename(path: str) -> str:
    """Adapter roots' rename: diffusers module path -> Tencent module path (``KeyError`` when it has none)."""
    return diffusers_module_to_tencent(path)


def fused_modules(denoiser: Any) -> tuple[Fused, ...]:
    """Every fused Tencent module over its diffusers leaves, in row order (module docstring)."""
    fused: list[Fused] = []
    lists = {"double_blocks": denoiser.transformer_blocks, "single_blocks": denoiser.single_transformer_blocks,
             _REFINER: denoiser.context_embedder.token_refiner.refiner_blocks}  # fmt: skip
    for tencent_list, blocks in lists.items():
        diff_list = _LISTS[tencent_list][0]
        for i in range(len(blocks)):
            for name, leaves in _LISTS[tencent_list][2].items():
                segments = tuple(Segment(f"{diff_list}.{i}.{leaf}") for leaf in leaves)
                fused.append(Fused(f"{tencent_list}.{i}.{name}", segments))
    return tuple(fused)


def block_counts(keys: Iterable[str]) -> dict[str, int]:
    """The number of double and single blocks (and refiner blocks) in Tencent keys (prefix or not)."""
    counts = dict.fromkeys(_LISTS, 0)
    for key in keys:
        m = _TENCENT_RE.match(key.removeprefix(PREFIX))
        if m:
            counts[m.group(1)] = max(counts[m.group(1)], int(m.group(2)) + 1)
    return counts


# ------------------------------------------------------------------------------------------------ the VAE
# Tencent's VAE (``hunyuan_image_2.1_vae_fp16.safetensors``, sd-scripts' ``HunyuanVAE2D``) nests resnets and
# resamplers per level (``encoder.down.L.block.R`` / ``encoder.down.L.downsample``, ``decoder.up.L.block.R`` /
# ``decoder.up.L.upsample``); diffusers' ``AutoencoderKLHunyuanImage`` numbers them in one flat list, level by level
# (``encoder.down_blocks.K``, ``decoder.up_blocks.K``). The middle blocks and the attention's 1x1 convs are renamed.
_VAE_LEVEL = re.compile(r"^(encoder|decoder)\.(down|up)\.(\d+)\.(block\.(\d+)|downsample|upsample)\.(.+)$")
_VAE_FLAT = re.compile(r"^(encoder|decoder)\.(down_blocks|up_blocks)\.(\d+)\.(.+)$")
_VAE_MID = {"mid.block_1": "mid_block.resnets.0", "mid.block_2": "mid_block.resnets.1",
            "mid.attn_1.norm": "mid_block.attentions.0.norm", "mid.attn_1.q": "mid_block.attentions.0.to_q",
            "mid.attn_1.k": "mid_block.attentions.0.to_k", "mid.attn_1.v": "mid_block.attentions.0.to_v",
            "mid.attn_1.proj_out": "mid_block.attentions.0.proj"}  # fmt: skip


def is_tencent_vae(keys: Iterable[str]) -> bool:
    return any(k == "encoder.down.0.block.0.conv1.weight" for k in keys)


def _vae_layout(keys: Iterable[str]) -> dict[tuple[str, int], tuple[int, bool]]:
    """(side, level) -> (resnets, has a resampler) of Tencent VAE keys."""
    layout: dict[tuple[str, int], list] = {}
    for key in keys:
        m = _VAE_LEVEL.match(key)
        if m:
            side, _, level, what, resnet, _ = m.groups()
            entry = layout.setdefault((side, int(level)), [0, False])
            if resnet is not None:
                entry[0] = max(entry[0], int(resnet) + 1)
            else:
                entry[1] = True
    return {k: (v[0], v[1]) for k, v in layout.items()}


def _vae_flat_index(layout: Mapping[tuple[str, int], tuple[int, bool]]) -> dict[tuple[str, int, str], int]:
    """(side, level, "R" or "resample") -> the flat diffusers index."""
    index: dict[tuple[str, int, str], int] = {}
    for side in ("encoder", "decoder"):
        k = 0
        for level in sorted(lvl for s, lvl in layout if s == side):
            resnets, resample = layout[(side, level)]
            for r in range(resnets):
                index[(side, level, str(r))] = k
                k += 1
            if resample:
                index[(side, level, "resample")] = k
                k += 1
    return index


def vae_tencent_to_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tencent VAE names -> diffusers ``AutoencoderKLHunyuanImage`` names; 5-D single-frame conv weights (Tencent's
    original checkpoint) squeezed to 4-D. ``ValueError`` naming a key it has no place for."""
    index = _vae_flat_index(_vae_layout(state.keys()))
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        if tensor.ndim == 5 and tensor.shape[2] == 1:
            tensor = tensor.squeeze(2)
        m = _VAE_LEVEL.match(key)
        if m:
            side, kind, level, what, resnet, rest = m.groups()
            flat = index[(side, int(level), resnet if resnet is not None else "resample")]
            out[f"{side}.{kind}_blocks.{flat}.{rest}"] = tensor
            continue
        side, _, rest = key.partition(".")
        for tencent, diff in _VAE_MID.items():
            if rest.startswith(tencent + "."):
                out[f"{side}.{diff}{rest[len(tencent) :]}"] = tensor
                break
        else:
            if side not in ("encoder", "decoder") or not rest.startswith(("conv_in.", "conv_out.", "norm_out.")):
                raise ValueError(f"{key}: not a HunyuanImage 2.1 VAE weight (Tencent layout)")
            out[key] = tensor
    return out


def vae_diffusers_to_tencent(state: Mapping[str, Tensor], layout: Mapping[tuple[str, int], tuple[int, bool]]
                             ) -> dict[str, Tensor]:  # fmt: skip
    """diffusers VAE names -> Tencent names, for the level ``layout`` ((side, level) -> (resnets, resampler))."""
    back = {(side, flat): (level, what) for (side, level, what), flat in _vae_flat_index(layout).items()}
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        m = _VAE_FLAT.match(key)
        if m:
            side, kind, flat, rest = m.groups()
            level, what = back[(side, int(flat))]
            short = kind.removesuffix("_blocks")
            middle = f"block.{what}" if what != "resample" else ("downsample" if short == "down" else "upsample")
            out[f"{side}.{short}.{level}.{middle}.{rest}"] = tensor
            continue
        side, _, rest = key.partition(".")
        for tencent, diff in _VAE_MID.items():
            if rest.startswith(diff + "."):
                out[f"{side}.{tencent}{rest[len(diff) :]}"] = tensor
                break
        else:
            out[key] = tensor
    return out


def vae_layout_of(levels: int, layers_per_block: int) -> dict[tuple[str, int], tuple[int, bool]]:
    """The level layout of a HunyuanImage VAE with ``levels`` block widths, resamplers on all but the last level."""
    layout = {}
    for level in range(levels):
        layout[("encoder", level)] = (layers_per_block, level < levels - 1)
        layout[("decoder", level)] = (layers_per_block + 1, level < levels - 1)
    return layout
