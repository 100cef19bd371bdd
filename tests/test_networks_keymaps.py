"""Every key we write maps to a module in ComfyUI's and A1111/Forge's LoRA name maps (docs/formats.md "Module names").

Neither program is installable here (GPL/AGPL, not on PyPI), so their key maps are re-typed below from their
sources (ComfyUI ``comfy/lora.py`` ``model_lora_keys_unet`` / ``model_lora_keys_clip``; A1111
``extensions-builtin/Lora/networks.py`` ``convert_diffusers_name_to_compvis`` + ``load_network``'s fallbacks) and
applied to the released architectures built on the meta device. The ldm (original) UNet names both use are taken
from ``unet_keys``, which the test first checks against diffusers' own single-file converter.
"""

from __future__ import annotations

import re

import pytest
from _networks_helpers import (
    adapter_roots,
    make_config,
    real_parts,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
)
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

from library.families.sd.unet_keys import unet_state_dict_to_ldm
from networks import inject

CONFIGS = {
    "locon": dict(args=("conv_dim=8",)),
    "lycoris-full": dict(args=("algo=loha",), module="lycoris.kohya"),  # adds conv_in, conv_out, time embedding
    "norms": dict(args=("train_norm=True", "preset=unet-only"), module="lycoris.kohya"),
}


def _ldm_unet_keys(unet) -> list[str]:
    sd = unet.state_dict()
    ldm = unet_state_dict_to_ldm(sd, unet.config)
    assert set(convert_ldm_unet_checkpoint(ldm, dict(unet.config))) == set(sd)  # diffusers agrees on the names
    return [k[len("model.diffusion_model.") :] for k in ldm]


def _te_layers(te) -> int:
    return te.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------- ComfyUI
LORA_CLIP_MAP = ["mlp_fc1", "mlp_fc2", "self_attn_k_proj", "self_attn_q_proj", "self_attn_v_proj", "self_attn_out_proj"]


def comfy_key_map(parts, family: str) -> set[str]:
    keys = set()
    for k in _ldm_unet_keys(parts.denoiser):  # lora_unet_<ldm path>
        if k.endswith(".weight"):
            keys.add("lora_unet_" + k[: -len(".weight")].replace(".", "_"))
    for k in parts.denoiser.state_dict():  # lora_unet_<diffusers path> via utils.unet_to_diffusers
        if k.endswith(".weight"):
            keys.add("lora_unet_" + k[: -len(".weight")].replace(".", "_"))
    if family == "sdxl":  # clip_l -> lora_te1 (and lora_te), clip_g -> lora_te2
        prefixes = [("lora_te1", 0), ("lora_te", 0), ("lora_te2", 1)]
    else:  # clip_l (SD1) / clip_h (SD2) -> lora_te, lora_te1
        prefixes = [("lora_te", 0), ("lora_te1", 0)]
    for prefix, i in prefixes:
        for b in range(_te_layers(parts.text_encoders[i])):
            keys |= {f"{prefix}_text_model_encoder_layers_{b}_{c}" for c in LORA_CLIP_MAP}
    return keys


# ------------------------------------------------------------------------------------------------ A1111 / Forge
_SUFFIX = {"conv1": "in_layers_2", "conv2": "out_layers_3", "norm1": "in_layers_0", "norm2": "out_layers_0",
           "time_emb_proj": "emb_layers_1", "conv_shortcut": "skip_connection"}  # fmt: skip


def a1111_convert(key: str, is_sd2: bool) -> str:
    """A1111 1.10 ``convert_diffusers_name_to_compvis``."""
    rules = [
        (r"lora_unet_conv_in(.*)", lambda m: f"diffusion_model_input_blocks_0_0{m[0]}"),
        (r"lora_unet_conv_out(.*)", lambda m: f"diffusion_model_out_2{m[0]}"),
        (r"lora_unet_time_embedding_linear_(\d+)(.*)", lambda m: f"diffusion_model_time_embed_{int(m[0]) * 2 - 2}{m[1]}"),
        (r"lora_unet_down_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)",
         lambda m: f"diffusion_model_input_blocks_{1 + int(m[0]) * 3 + int(m[2])}_{1 if m[1] == 'attentions' else 0}_"
                   f"{_SUFFIX.get(m[3], m[3]) if m[1] == 'resnets' else m[3]}"),
        (r"lora_unet_mid_block_(attentions|resnets)_(\d+)_(.+)",
         lambda m: f"diffusion_model_middle_block_{1 if m[0] == 'attentions' else int(m[1]) * 2}_"
                   f"{_SUFFIX.get(m[2], m[2]) if m[0] == 'resnets' else m[2]}"),
        (r"lora_unet_up_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)",
         lambda m: f"diffusion_model_output_blocks_{int(m[0]) * 3 + int(m[2])}_{1 if m[1] == 'attentions' else 0}_"
                   f"{_SUFFIX.get(m[3], m[3]) if m[1] == 'resnets' else m[3]}"),
        (r"lora_unet_down_blocks_(\d+)_downsamplers_0_conv", lambda m: f"diffusion_model_input_blocks_{3 + int(m[0]) * 3}_0_op"),
        (r"lora_unet_up_blocks_(\d+)_upsamplers_0_conv",
         lambda m: f"diffusion_model_output_blocks_{2 + int(m[0]) * 3}_{2 if int(m[0]) > 0 else 1}_conv"),
    ]  # fmt: skip
    for pattern, build in rules:
        m = re.match(pattern, key)
        if m:
            return build(m.groups())
    m = re.match(r"lora_te_text_model_encoder_layers_(\d+)_(.+)", key)
    if m:
        b, rest = m.groups()
        if not is_sd2:
            return f"transformer_text_model_encoder_layers_{b}_{rest}"
        rest = rest.replace("mlp_fc1", "mlp_c_fc").replace("mlp_fc2", "mlp_c_proj").replace("self_attn", "attn")
        return f"model_transformer_resblocks_{b}_{rest}"
    m = re.match(r"lora_te2_text_model_encoder_layers_(\d+)_(.+)", key)
    if m:
        b, rest = m.groups()
        rest = rest.replace("mlp_fc1", "mlp_c_fc").replace("mlp_fc2", "mlp_c_proj").replace("self_attn", "attn")
        return f"1_model_transformer_resblocks_{b}_{rest}"
    return key


def _open_clip_modules(prefix: str, layers: int) -> set[str]:
    names = set()
    for b in range(layers):
        base = f"{prefix}model_transformer_resblocks_{b}"
        names |= {f"{base}_attn", f"{base}_attn_out_proj", f"{base}_mlp_c_fc", f"{base}_mlp_c_proj", f"{base}_ln_1"}
    return names


def a1111_modules(parts, family: str) -> set[str]:
    """A1111's ``network_layer_mapping`` names for the ldm model (UNet modules and the wrapped text encoders)."""
    names = set()
    for k in _ldm_unet_keys(parts.denoiser):
        parts_ = k.split(".")[:-1]
        for i in range(1, len(parts_) + 1):
            names.add("diffusion_model_" + "_".join(parts_[:i]))
    te_prefix = {"sd1": ["transformer_"], "sd2": [None], "sdxl": ["0_transformer_", None]}[family]
    for te, prefix in zip(parts.text_encoders, te_prefix, strict=True):
        if prefix is None:  # OpenCLIP: MultiheadAttention ("attn", q/k/v stacked) and c_fc / c_proj
            names |= _open_clip_modules("1_" if family == "sdxl" else "", _te_layers(te))
            continue
        for path, _ in te.named_modules():
            path = path if path.startswith("text_model") else f"text_model.{path}"
            names.add(prefix + path.replace(".", "_"))
    return names


def a1111_lookup(key: str, modules: set[str], is_sd2: bool) -> str | None:
    """``load_network``'s lookup: convert, then the q/k/v_proj fallback, then the SDXL prefix replacements."""
    name = a1111_convert(key, is_sd2)
    if name in modules:
        return name
    m = re.match(r"(.*)_([qkv]_proj)$", name)
    if m and m.group(1) in modules:
        return m.group(1)
    if "lora_unet" in key:
        name = key.replace("lora_unet", "diffusion_model")
        return name if name in modules else None
    if "lora_te1_text_model" in key:
        for new in ("0_transformer_text_model", "transformer_text_model"):
            name = key.replace("lora_te1_text_model", new)
            if name in modules:
                return name
    return None


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_every_key_maps_in_comfyui_and_a1111(family, config):
    parts = real_parts(family)
    spec = CONFIGS[config]
    network = inject(make_config(*spec["args"], module=spec.get("module", "networks.lora")), adapter_roots(parts))
    names = list(network.names)
    network.eject()  # the consumers' maps are built from the plain model
    comfy = comfy_key_map(parts, family)
    comfy_missing = [n for n in names if n not in comfy and not n.startswith("lora_te")]
    comfy_missing += [n for n in names if n.startswith("lora_te") and n not in comfy]
    assert not comfy_missing, comfy_missing[:5]
    modules = a1111_modules(parts, family)
    a1111_missing = [n for n in names if a1111_lookup(n, modules, family == "sd2") is None]
    assert not a1111_missing, a1111_missing[:5]


@pytest.mark.parametrize("family", ["sd2", "sdxl"])
def test_open_clip_layers_get_all_of_q_k_v_out(family):
    """A1111 applies q/k/v_proj to OpenCLIP's fused in_proj only when q, k, v and out_proj are all present."""
    parts = real_parts(family)
    network = inject(make_config(), adapter_roots(parts))
    prefix = "lora_te2" if family == "sdxl" else "lora_te"
    layers = {}
    for n in network.names:
        m = re.match(rf"{prefix}_text_model_encoder_layers_(\d+)_self_attn_(\w+)_proj$", n)
        if m:
            layers.setdefault(m.group(1), set()).add(m.group(2))
    assert layers and all(v == {"q", "k", "v", "out"} for v in layers.values())
