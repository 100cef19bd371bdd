"""ControlNet file keys: diffusers' ``ControlNetModel`` names <-> the original (LDM) ControlNet names sd-scripts'
``train_control_net.py`` writes (``input_hint_block.N``, ``zero_convs.N.0``, ``middle_block_out.0``,
``input_blocks.N.M``, ``time_embed.N`` ...; without the ``control_model.`` prefix of lllyasviel's files, which
readers strip: diffusers' ``from_single_file``, ComfyUI, A1111).

The map is built from the model's own keys and its ``layers_per_block``, so it holds for any block count (sd-scripts'
table assumes the 4-level, 2-layer SD UNet; on that layout both give the same names)."""

from __future__ import annotations

import re

# resnet sub-layers: diffusers -> LDM
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
           "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}  # fmt: skip
_FIXED = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
          "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
          "conv_in": "input_blocks.0.0", "controlnet_mid_block": "middle_block_out.0",
          "controlnet_cond_embedding.conv_in": "input_hint_block.0"}  # fmt: skip
LDM_PREFIX = "control_model."


def _resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESNET.get(head, head)}.{tail}" if tail else _RESNET.get(head, head)


def ldm_name(key: str, layers_per_block: int, hint_blocks: int) -> str:
    """The LDM name of one diffusers ControlNet key (``hint_blocks``: the conditioning embedding's ``blocks`` count)."""
    module, _, param = key.rpartition(".")
    if module in _FIXED:
        return f"{_FIXED[module]}.{param}"
    per_level = layers_per_block + 1
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
        index = 1 + int(m[1]) * per_level + int(m[3])
        return f"input_blocks.{index}.0.{_resnet(m[4])}" if m[2] == "resnets" else f"input_blocks.{index}.1.{m[4]}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"input_blocks.{(int(m[1]) + 1) * per_level}.0.op.{m[2]}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", key):
        return f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", key):
        return f"middle_block.1.{m[1]}"
    if m := re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)\.(.+)", key):
        return f"input_hint_block.{2 * (int(m[1]) + 1)}.{m[2]}"
    if m := re.fullmatch(r"controlnet_cond_embedding\.conv_out\.(.+)", key):
        return f"input_hint_block.{2 * (hint_blocks + 1)}.{m[1]}"
    if m := re.fullmatch(r"controlnet_down_blocks\.(\d+)\.(.+)", key):
        return f"zero_convs.{m[1]}.0.{m[2]}"
    raise KeyError(f"no LDM name for the ControlNet key {key!r}")


def ldm_map(keys: list[str], layers_per_block: int) -> dict[str, str]:
    """diffusers key -> LDM key for every key of a ControlNet's state dict."""
    hint_blocks = len({k.split(".")[2] for k in keys if k.startswith("controlnet_cond_embedding.blocks.")})
    out = {k: ldm_name(k, layers_per_block, hint_blocks) for k in keys}
    if len(set(out.values())) != len(out):
        raise ValueError("two ControlNet keys map to one LDM name; the layout is not a UNet-encoder ControlNet")
    return out


def is_ldm(keys) -> bool:
    """Whether a file's keys are LDM names (with or without ``control_model.``), not diffusers'."""
    return any(k.removeprefix(LDM_PREFIX).startswith(("input_hint_block.", "zero_convs.")) for k in keys)
