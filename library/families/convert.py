"""Single-file (original ldm / sgm) <-> diffusers key conversion, both directions, in one place.

A single-file Stable Diffusion checkpoint holds every component under one prefix each:

    model.diffusion_model.*                 UNet, ldm names (see unet_keys.py)
    first_stage_model.*                     VAE, ldm names (this module)
    cond_stage_model.transformer.text_model.*      SD1 text encoder, HF CLIP layout
    cond_stage_model.model.*                       SD2 text encoder, OpenCLIP layout
    conditioner.embedders.0.transformer.text_model.*   SDXL CLIP-L, HF layout
    conditioner.embedders.1.model.*                    SDXL OpenCLIP-bigG

OpenCLIP differs from HF CLIP in three ways: names (``transformer.resblocks.N.ln_1``, ``attn.out_proj``,
``mlp.c_fc``...), one stacked ``attn.in_proj_weight`` (q, k, v rows) instead of three projections, and
``text_projection`` stored as the matrix P of ``x @ P`` (the transpose of HF's ``text_projection.weight``), which
is how diffusers' ``convert_open_clip_checkpoint`` and ComfyUI read it.

HF text-encoder state dicts are handled in a *canonical* form with the ``text_model.`` level (transformers >= 5.6
made ``CLIPTextModel`` flat; :func:`hf_state_dict` / :func:`hf_for_model` convert between the two).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .unet_keys import unet_state_dict_from_ldm, unet_state_dict_to_ldm

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
# Keys some single files carry at the top level for the VAE (bare ``encoder.*`` VAE files have no prefix).
VAE_PREFIXES = (VAE_PREFIX, "vae.", "")

# ---------------------------------------------------------------------------------------------------------- VAE
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_ATTN_OLD = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}  # diffusers < 0.14


def _get(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, Mapping) else getattr(config, key)


def vae_key_to_ldm(key: str, num_up_blocks: int) -> str:
    """``decoder.up_blocks.0.resnets.1.conv1.weight`` -> ``decoder.up.3.block.1.conv1.weight`` (4 up blocks)."""
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return key  # quant_conv / post_quant_conv
    p = rest.split(".")
    if p[0] == "conv_norm_out":
        p[0] = "norm_out"
    elif p[0] in ("down_blocks", "up_blocks"):
        down = p[0] == "down_blocks"
        level = int(p[1]) if down else num_up_blocks - 1 - int(p[1])
        head = ["down" if down else "up", str(level)]
        if p[2] == "resnets":
            p = head + ["block", p[3], _VAE_RESNET.get(p[4], p[4])] + p[5:]
        else:  # downsamplers.0.conv / upsamplers.0.conv
            p = head + ["downsample" if down else "upsample"] + p[4:]
    elif p[0] == "mid_block" and p[1] == "resnets":
        p = ["mid", f"block_{int(p[2]) + 1}", _VAE_RESNET.get(p[3], p[3])] + p[4:]
    elif p[0] == "mid_block" and p[1] == "attentions":
        inner = ".".join(p[3:-1])
        p = ["mid", "attn_1", _VAE_ATTN.get(inner, inner), p[-1]]
    return ".".join([side, *p])


def _is_vae_attn_weight(ldm_key: str) -> bool:
    return (
        ".mid.attn_1." in f".{ldm_key}"
        and ldm_key.rsplit(".", 2)[-2] in ("q", "k", "v", "proj_out")
        and (ldm_key.endswith(".weight"))
    )


def vae_to_ldm(state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
    """Diffusers ``AutoencoderKL`` state dict -> ldm VAE names (no prefix). Attention q/k/v/proj_out become 1x1 convs."""
    n_up = len(_get(config, "up_block_types"))
    out = {}
    for key, value in state_dict.items():
        ldm = vae_key_to_ldm(key, n_up)
        out[ldm] = value[:, :, None, None] if _is_vae_attn_weight(ldm) and value.ndim == 2 else value
    return out


def vae_from_ldm(ldm: Mapping[str, Tensor], config: Any, keys: Iterable[str]) -> dict[str, Tensor]:
    """ldm VAE names (no prefix) -> the diffusers ``keys`` that are present; 1x1 conv attention weights -> linear."""
    n_up = len(_get(config, "up_block_types"))
    out = {}
    for key in keys:
        name = vae_key_to_ldm(key, n_up)
        if name in ldm:
            value = ldm[name]
            out[key] = value.flatten(1) if _is_vae_attn_weight(name) and value.ndim == 4 else value
    return out


def vae_diffusers_rename_old(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename pre-0.14 diffusers VAE attention keys (``query``, ``proj_attn``...) to the current names."""
    out = {}
    for key, value in state_dict.items():
        p = key.split(".")
        if "attentions" in p and len(p) >= 2 and p[-2] in _VAE_ATTN_OLD:
            key = ".".join(p[:-2] + [_VAE_ATTN_OLD[p[-2]], p[-1]])
        out[key] = value
    return out


# -------------------------------------------------------------------------------------------- HF CLIP (SD1, SDXL TE1)
def hf_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """A text encoder's state dict in canonical form (every key but ``text_projection.*`` under ``text_model.``)."""
    sd = model.state_dict()
    if hasattr(model, "text_model"):
        return dict(sd)
    return {f"text_model.{k}": v for k, v in sd.items()}


def hf_for_model(canonical: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Inverse of :func:`hf_state_dict`: canonical keys -> the names ``model.load_state_dict`` expects."""
    if hasattr(model, "text_model"):
        return dict(canonical)
    return {k.removeprefix("text_model."): v for k, v in canonical.items()}


def clip_to_ldm(canonical: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF CLIP-L (canonical) -> the keys under ``cond_stage_model.transformer.``: the same names (buffers dropped)."""
    return {k: v for k, v in canonical.items() if not k.endswith("position_ids")}


def clip_from_ldm(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys under ``cond_stage_model.transformer.`` -> canonical HF names; old files without ``text_model.`` too."""
    out = {}
    for key, value in sd.items():
        if key.endswith("position_ids"):
            continue
        out[key if key.startswith(("text_model.", "text_projection")) else f"text_model.{key}"] = value
    return out


# ------------------------------------------------------------------------------------- OpenCLIP (SD2, SDXL TE2)
_OC_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
_OC_LAYER_BACK = {v: k for k, v in _OC_LAYER.items()}
_OC_TOP = {
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_OC_TOP_BACK = {v: k for k, v in _OC_TOP.items()}
_LAYERS = "text_model.encoder.layers."
_BLOCKS = "transformer.resblocks."
LOGIT_SCALE_DEFAULT = math.log(100.0)  # CLIP's trained temperature (exp = 100); unused by Stable Diffusion


def open_clip_to_ldm(
    canonical: Mapping[str, Tensor], extras: Mapping[str, Tensor] | None = None, *, add_final_block: bool = False
) -> dict[str, Tensor]:
    """HF (canonical) -> OpenCLIP names under ``cond_stage_model.model.`` / ``conditioner.embedders.1.model.``.

    q/k/v projections are stacked into ``attn.in_proj_weight`` (3·D, D); ``text_projection.weight`` (P, D) becomes
    ``text_projection`` (D, P). ``extras`` are OpenCLIP tensors the HF model does not hold (SD2's 24th block,
    ``text_projection`` and ``logit_scale`` of SD2, TE2's ``logit_scale``), kept from the file the model was loaded
    from; missing ones get defaults. ``add_final_block``: write a block N (N = number of HF layers) when ``extras``
    lacks it, copied from block N-1 as sd-scripts does — SD2 uses OpenCLIP-H's penultimate layer, so HF holds 23 of
    its 24 blocks and every other reader expects 24.
    """
    out: dict[str, Tensor] = {}
    qkv: dict[str, dict[str, Tensor]] = {}
    for key, value in canonical.items():
        if key in _OC_TOP:
            out[_OC_TOP[key]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.t().contiguous()
        elif key.startswith(_LAYERS):
            index, _, rest = key[len(_LAYERS) :].partition(".")
            module, _, param = rest.rpartition(".")
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault(f"{_BLOCKS}{index}.attn.in_proj_{param}", {})[module[-6]] = value
            else:
                out[f"{_BLOCKS}{index}.{_OC_LAYER[module]}.{param}"] = value
        elif not key.endswith("position_ids"):
            raise ValueError(f"text encoder key {key!r} has no OpenCLIP equivalent")
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    out.update(extras or {})
    num_layers = len({k[len(_LAYERS) :].split(".")[0] for k in canonical if k.startswith(_LAYERS)})
    if add_final_block and f"{_BLOCKS}{num_layers}.ln_1.weight" not in out:
        last = f"{_BLOCKS}{num_layers - 1}."
        out.update(
            {k.replace(last, f"{_BLOCKS}{num_layers}.", 1): v.clone() for k, v in out.items() if k.startswith(last)}
        )
    width = out["ln_final.weight"].shape[0]
    if "text_projection" not in out:
        out["text_projection"] = torch.eye(width, dtype=out["ln_final.weight"].dtype)
    out.setdefault("logit_scale", torch.tensor(LOGIT_SCALE_DEFAULT, dtype=out["ln_final.weight"].dtype))
    return out


def open_clip_from_ldm(
    sd: Mapping[str, Tensor], num_layers: int, with_projection: bool
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """OpenCLIP keys (prefix removed) -> ``(canonical HF state dict, extras)``.

    Blocks ``>= num_layers`` (SD2's unused 24th), ``logit_scale``, ``text_projection`` when the HF model has none
    (SD2) and any other key go to ``extras`` so that saving again reproduces the file.
    """
    out: dict[str, Tensor] = {}
    extras: dict[str, Tensor] = {}
    for key, value in sd.items():
        if key in _OC_TOP_BACK:
            out[_OC_TOP_BACK[key]] = value
        elif key == "text_projection" and with_projection:
            out["text_projection.weight"] = value.t().contiguous()
        elif key.startswith(_BLOCKS) and int(key[len(_BLOCKS) :].split(".")[0]) < num_layers:
            index, _, rest = key[len(_BLOCKS) :].partition(".")
            module, _, param = rest.rpartition(".")
            prefix = f"{_LAYERS}{index}."
            if module == "attn" and param in ("in_proj_weight", "in_proj_bias"):
                kind = param.removeprefix("in_proj_")
                for name, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{name}.{kind}"] = chunk.clone()
            elif module in _OC_LAYER_BACK:
                out[f"{prefix}{_OC_LAYER_BACK[module]}.{param}"] = value
            else:
                extras[key] = value
        else:
            extras[key] = value
    return out, extras


# ------------------------------------------------------------------------------------------- whole checkpoints
def text_encoder_to_ldm(model: nn.Module, layout: str, extras: Mapping[str, Tensor], add_final_block: bool) -> dict:
    """One text encoder module -> its single-file keys (without the component prefix)."""
    canonical = hf_state_dict(model)
    if layout == "clip":
        return clip_to_ldm(canonical)
    return open_clip_to_ldm(canonical, extras, add_final_block=add_final_block)


def text_encoder_from_ldm(
    sd: Mapping[str, Tensor], layout: str, num_layers: int, with_projection: bool
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Single-file keys (prefix removed) of one text encoder -> ``(canonical HF state dict, extras)``."""
    if layout == "clip":
        return clip_from_ldm(sd), {}
    return open_clip_from_ldm(sd, num_layers, with_projection)


def unet_to_ldm(unet: nn.Module) -> dict[str, Tensor]:
    """Diffusers UNet -> ``model.diffusion_model.*`` keys."""
    return unet_state_dict_to_ldm(unet.state_dict(), unet.config, UNET_PREFIX)


def unet_from_ldm(sd: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
    """``model.diffusion_model.*`` keys -> diffusers UNet names."""
    return unet_state_dict_from_ldm(sd, config, UNET_PREFIX)


def strip_prefix(sd: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``sd`` under ``prefix``, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def vae_ldm_keys(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The ldm VAE entries of a checkpoint or a VAE file (``first_stage_model.*``, ``vae.*`` or bare ``encoder.*``)."""
    for prefix in VAE_PREFIXES:
        found = strip_prefix(sd, prefix)
        if any(k.startswith(("encoder.down.", "decoder.up.")) for k in found):
            return {
                k: v for k, v in found.items() if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant"))
            }
    return {}


def hf_module_path(model: nn.Module):
    """A function mapping ``model.named_modules()`` paths to the HF paths with the ``text_model.`` level, the names
    kohya LoRA keys use (``lora_te_text_model_encoder_layers_0_mlp_fc1``) whatever the transformers version."""
    if hasattr(model, "text_model"):
        return lambda path: path
    return lambda path: f"text_model.{path}" if path else "text_model"
