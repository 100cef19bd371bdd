"""SD single-file (original ldm / sgm) <-> diffusers key conversion, both directions: the UNet and the text encoders
(the VAE's LDM names and HF CLIP's canonical form are the shared ``convert.py``'s).

A single-file Stable Diffusion checkpoint holds every component under one prefix each:

    model.diffusion_model.*                 UNet, ldm names (see unet_keys.py)
    first_stage_model.*                     VAE, ldm names (../convert.py)
    cond_stage_model.transformer.text_model.*      SD1 text encoder, HF CLIP layout
    cond_stage_model.model.*                       SD2 text encoder, OpenCLIP layout
    conditioner.embedders.0.transformer.text_model.*   SDXL CLIP-L, HF layout
    conditioner.embedders.1.model.*                    SDXL OpenCLIP-bigG

OpenCLIP differs from HF CLIP in three ways: names (``transformer.resblocks.N.ln_1``, ``attn.out_proj``,
``mlp.c_fc``...), one stacked ``attn.in_proj_weight`` (q, k, v rows) instead of three projections, and
``text_projection`` stored as the matrix P of ``x @ P`` (the transpose of HF's ``text_projection.weight``), which
is how diffusers' ``convert_open_clip_checkpoint`` and ComfyUI read it.

HF text-encoder state dicts are handled in the shared *canonical* form with the ``text_model.`` level
(``convert.hf_state_dict`` / ``convert.hf_for_model``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..convert import clip_from_ldm, clip_to_ldm, hf_state_dict
from .unet_keys import unet_state_dict_from_ldm, unet_state_dict_to_ldm

UNET_PREFIX = "model.diffusion_model."

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
