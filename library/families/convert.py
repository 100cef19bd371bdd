"""Key names of the parts several families share: HF CLIP text encoders in a *canonical* form, the LDM (original) <->
diffusers names of an ``AutoencoderKL``, and the helpers every family's converters use.

HF text-encoder state dicts are handled in a *canonical* form with the ``text_model.`` level (transformers >= 5.6
made ``CLIPTextModel`` flat; :func:`hf_state_dict` / :func:`hf_for_model` convert between the two). A VAE in a
single file has LDM names (``encoder.down.N.block.M``, attention as 1x1 convs: :func:`vae_to_ldm` /
:func:`vae_from_ldm`), under ``first_stage_model.`` in SD and SD3 checkpoints, bare in VAE-only files and FLUX's
``ae.safetensors``. The SD checkpoints' own layout (UNet, OpenCLIP) is in ``sd/convert.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn

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


# -------------------------------------------------------------------------------------------- HF CLIP
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
