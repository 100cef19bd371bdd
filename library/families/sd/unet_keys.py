"""UNet module names: diffusers <-> original (ldm / sgm) layout.

The original Stable Diffusion code names UNet modules ``input_blocks.N.M``, ``middle_block.N`` and
``output_blocks.N.M``; diffusers names them ``down_blocks.i.resnets.j`` etc. Single-file checkpoints
(``model.diffusion_model.<ldm name>``) and kohya SDXL LoRA keys (``lora_unet_<ldm name with _>``) use the original
names. The map is derived from the UNet config (layers per block, which blocks have attention), so it holds for
SD1, SD2, SDXL and their tiny test versions alike:

    conv_in                         -> input_blocks.0.0
    time_embedding.linear_{1,2}     -> time_embed.{0,2}          add_embedding.linear_{1,2} -> label_emb.0.{0,2}
    down_blocks.i.resnets.j         -> input_blocks.{(L+1)i+j+1}.0      (attentions.j -> ... .1)
    down_blocks.i.downsamplers.0.conv -> input_blocks.{(L+1)(i+1)}.0.op
    mid_block.resnets.j             -> middle_block.{2j}         mid_block.attentions.0 -> middle_block.1
    up_blocks.i.resnets.j           -> output_blocks.{(L+1)i+j}.0       (attentions.j -> ... .1)
    up_blocks.i.upsamplers.0.conv   -> output_blocks.{(L+1)i+L}.{2 if the block has attention else 1}.conv
    conv_norm_out / conv_out        -> out.0 / out.2
    inside resnets: norm1 in_layers.0, conv1 in_layers.2, time_emb_proj emb_layers.1, norm2 out_layers.0,
                    conv2 out_layers.3, conv_shortcut skip_connection

Parameters keep their shapes (SD1's 1x1-conv proj_in/out are convs on both sides), so converting a UNet state
dict is a pure rename.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_RESNET_INNER = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_RESNET_INNER_BACK = {v: k for k, v in _RESNET_INNER.items()}

_FIXED = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}


def _get(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, Mapping) else getattr(config, key)


def block_map(config: Any) -> dict[str, tuple[str, bool]]:
    """Map each diffusers block prefix to ``(ldm prefix, is_resnet)`` for a UNet config (dict or FrozenDict)."""
    layers = _get(config, "layers_per_block")
    down_types = list(_get(config, "down_block_types"))
    up_types = list(_get(config, "up_block_types"))
    if not isinstance(layers, int):
        raise ValueError(f"per-block layers_per_block {layers!r} is not supported by the single-file layout")
    m: dict[str, tuple[str, bool]] = {k: (v, False) for k, v in _FIXED.items()}
    for i, kind in enumerate(down_types):
        for j in range(layers):
            n = (layers + 1) * i + j + 1
            m[f"down_blocks.{i}.resnets.{j}"] = (f"input_blocks.{n}.0", True)
            if "CrossAttn" in kind:
                m[f"down_blocks.{i}.attentions.{j}"] = (f"input_blocks.{n}.1", False)
        if i < len(down_types) - 1:
            m[f"down_blocks.{i}.downsamplers.0.conv"] = (f"input_blocks.{(layers + 1) * (i + 1)}.0.op", False)
    m["mid_block.resnets.0"] = ("middle_block.0", True)
    m["mid_block.attentions.0"] = ("middle_block.1", False)
    m["mid_block.resnets.1"] = ("middle_block.2", True)
    for i, kind in enumerate(up_types):
        has_attn = "CrossAttn" in kind
        for j in range(layers + 1):
            n = (layers + 1) * i + j
            m[f"up_blocks.{i}.resnets.{j}"] = (f"output_blocks.{n}.0", True)
            if has_attn:
                m[f"up_blocks.{i}.attentions.{j}"] = (f"output_blocks.{n}.1", False)
        if i < len(up_types) - 1:
            n = (layers + 1) * i + layers
            m[f"up_blocks.{i}.upsamplers.0.conv"] = (f"output_blocks.{n}.{2 if has_attn else 1}.conv", False)
    return m


def _convert(name: str, table: dict[str, tuple[str, bool]], inner: dict[str, str]) -> str:
    parts = name.split(".")
    # longest block prefix first (block prefixes have 1 to 5 dotted parts)
    for cut in range(min(len(parts), 6), 0, -1):
        head = ".".join(parts[:cut])
        if head in table:
            new_head, is_resnet = table[head]
            rest = parts[cut:]
            if is_resnet and rest:
                for depth in (2, 1):
                    key = ".".join(rest[:depth])
                    if len(rest) >= depth and key in inner:
                        rest = inner[key].split(".") + rest[depth:]
                        break
            return ".".join([new_head, *rest])
    raise KeyError(name)


def diffusers_to_ldm(name: str, config: Any, table: dict | None = None) -> str:
    """``down_blocks.1.resnets.0.conv1.weight`` -> ``input_blocks.4.0.in_layers.2.weight`` (module or param name)."""
    return _convert(name, table or block_map(config), _RESNET_INNER)


def ldm_to_diffusers(name: str, config: Any, table: dict | None = None) -> str:
    """Inverse of :func:`diffusers_to_ldm`."""
    if table is None:
        table = {v: (k, r) for k, (v, r) in block_map(config).items()}
    return _convert(name, table, _RESNET_INNER_BACK)


def unet_state_dict_to_ldm(state_dict: Mapping, config: Any, prefix: str = "model.diffusion_model.") -> dict:
    """Rename a diffusers UNet state dict to single-file keys (``prefix`` + ldm name). Shapes are unchanged."""
    table = block_map(config)
    return {prefix + diffusers_to_ldm(k, config, table): v for k, v in state_dict.items()}


def unet_state_dict_from_ldm(state_dict: Mapping, config: Any, prefix: str = "model.diffusion_model.") -> dict:
    """Inverse of :func:`unet_state_dict_to_ldm`: keys under ``prefix`` renamed to diffusers names; others ignored."""
    back = {v: (k, r) for k, (v, r) in block_map(config).items()}
    out = {}
    for k, v in state_dict.items():
        if k.startswith(prefix):
            out[ldm_to_diffusers(k[len(prefix) :], config, back)] = v
    return out
