"""Which modules get an adapter, under which kohya name, and which UNet block each belongs to.

Targets are chosen the way sd-scripts (``networks.lora``) and LyCORIS (``lycoris.kohya`` presets) choose them: every
Linear / Conv2d (and, with ``train_norm``, GroupNorm / LayerNorm) inside a module of a target *class*, plus modules
whose path matches a target *name*. The class names are diffusers' / transformers' (``Transformer2DModel``,
``ResnetBlock2D``, ``CLIPAttention``...), which sd-scripts' own UNets mirror, so the module sets are the same.

A root is ``(prefix, module, rename)`` from the model family: the kohya name of a module is
``prefix + "_" + rename(path).replace(".", "_")`` (e.g. SDXL's UNet is renamed to the sgm layout and a flat
transformers-5 ``CLIPTextModel`` gets its ``text_model.`` level back).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from .layers import weight_kind

Root = tuple[str, nn.Module, Callable[[str], str]]

TE_CLASSES = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP")
TRANSFORMER = ("Transformer2DModel",)
CONV_BLOCKS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")


@dataclass(frozen=True)
class Preset:
    """Target classes and names for the UNet and the text encoders (LyCORIS preset semantics).

    ``enable_conv``: whether k > 1 convolutions inside the targets get adapters. Names are matched against the
    module path in the model and its renamed (kohya) path: equal, or ``re.match`` (a prefix regex, as LyCORIS
    does), or ``fnmatch`` with ``use_fnmatch``.
    """

    unet_classes: tuple[str, ...] = ()
    unet_names: tuple[str, ...] = ()
    te_classes: tuple[str, ...] = ()
    te_names: tuple[str, ...] = ()
    enable_conv: bool = False
    exclude_names: tuple[str, ...] = ()
    use_fnmatch: bool = False


_FULL_NAMES = ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2")

# LyCORIS' built-in presets (lycoris/config.py), with diffusers' class names. "kohya" is networks.lora's default
# (LyCORIS "attn-mlp"); networks.lora adds CONV_BLOCKS when conv_dim / conv_block_dims are given.
PRESETS: dict[str, Preset] = {
    "kohya": Preset(TRANSFORMER, (), TE_CLASSES, ()),
    "attn-mlp": Preset(TRANSFORMER, (), TE_CLASSES, ()),
    "full": Preset(TRANSFORMER + CONV_BLOCKS, _FULL_NAMES, TE_CLASSES, (), enable_conv=True),
    "full-lin": Preset(TRANSFORMER + ("ResnetBlock2D",), _FULL_NAMES[2:], TE_CLASSES, ()),
    "attn-only": Preset(("Attention",), (), TE_CLASSES[:3], ()),
    "unet-only": Preset(TRANSFORMER + CONV_BLOCKS, _FULL_NAMES, (), (), enable_conv=True),
    "unet-transformer-only": Preset(TRANSFORMER, (), (), ()),
    "unet-convblock-only": Preset(CONV_BLOCKS, _FULL_NAMES[:2], (), (), enable_conv=True),
}


@dataclass(frozen=True)
class Target:
    """One module to adapt: its kohya ``name``, the module, where it sits, and its kind."""

    name: str
    module: nn.Module
    root: int  # index into the roots
    path: str  # module path inside its root
    kind: str  # "linear" | "conv" | "norm"

    @property
    def is_unet(self) -> bool:
        return self.name.startswith("lora_unet_")


def renamed(rename: Callable[[str], str], path: str) -> str:
    """``rename(path)``, or ``path`` itself for paths the rename has no entry for (containers, embeddings)."""
    try:
        return rename(path)
    except KeyError:
        return path


def kohya_name(prefix: str, rename: Callable[[str], str], path: str) -> str:
    return f"{prefix}_{renamed(rename, path)}".replace(".", "_")


def _matches(patterns: Sequence[str], paths: Sequence[str], use_fnmatch: bool) -> bool:
    for pattern in patterns:
        for path in paths:
            if path == pattern:
                return True
            if use_fnmatch and fnmatch.fnmatch(path, pattern):
                return True
            if not use_fnmatch and re.match(pattern, path):
                return True
    return False


def find_targets(roots: Sequence[Root], preset: Preset, *, conv: bool, train_norm: bool) -> list[Target]:
    """Every module the preset selects, in model order, de-duplicated. ``conv``: include k > 1 convolutions."""
    wanted = {"linear"} | ({"conv"} if conv else set()) | ({"norm"} if train_norm else set())
    targets: dict[str, Target] = {}
    for index, (prefix, root, rename) in enumerate(roots):
        is_unet = prefix.startswith("lora_unet")
        classes = preset.unet_classes if is_unet else preset.te_classes
        names = preset.unet_names if is_unet else preset.te_names
        for path, module in root.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "adapter"):
                raise ValueError(f"{prefix}: {path} already holds an adapter; eject() the first network before "
                                 "injecting another (or merge it with --base_weights)")  # fmt: skip
            aliases = (path, renamed(rename, path)) if path else ()
            if _matches(preset.exclude_names, aliases, preset.use_fnmatch):
                continue
            if type(module).__name__ in classes:
                children = [(f"{path}.{c}" if c else path, m) for c, m in module.named_modules()]
            elif path and _matches(names, aliases, preset.use_fnmatch):
                children = [(path, module)]
            else:
                continue
            for child_path, child in children:
                kind = weight_kind(child)
                name = kohya_name(prefix, rename, child_path)
                excluded = _matches(preset.exclude_names, (child_path, renamed(rename, child_path)), preset.use_fnmatch)
                if kind in wanted and name not in targets and not excluded:
                    targets[name] = Target(name, child, index, child_path, kind)
    return list(targets.values())


# ----------------------------------------------------------------------------------------------------- UNet blocks
_RE_SD = re.compile(r"lora_unet_(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")
_RE_SGM = re.compile(r"lora_unet_(input_blocks|middle_block|output_blocks)_(\d+)_")


@dataclass(frozen=True)
class BlockLayout:
    """sd-scripts' block numbering for ``block_dims`` / ``*_lr_weight``: SD1/SD2 (diffusers names) use 25 blocks
    (IN00-IN11, MID, OUT00-OUT11), SDXL (sgm names) 23 (embeddings, input_blocks 0-8, middle 0-2, output 0-8, out).
    ``down``/``mid``/``up``: how many values ``down_lr_weight`` / ``mid_lr_weight`` / ``up_lr_weight`` take.
    """

    name: str
    num_blocks: int
    down: int
    mid: int
    up: int

    def lr_weights(self, down: list[float], mid: list[float], up: list[float]) -> list[float]:
        """One weight per block from the three lists (SDXL: 1.0 for the embedding and out blocks)."""
        if self.name == "sgm":
            return [1.0, *down, *mid, *up, 1.0]
        return [*down, *mid, *up]


SD_BLOCKS = BlockLayout("diffusers", 25, 12, 1, 12)
SGM_BLOCKS = BlockLayout("sgm", 23, 9, 3, 9)


def block_layout(names: Sequence[str]) -> BlockLayout:
    """The numbering that fits a network's UNet module names (sgm names mean the SDXL numbering)."""
    return SGM_BLOCKS if any(_RE_SGM.match(n) for n in names) else SD_BLOCKS


def block_index(name: str) -> int:
    """sd-scripts' ``get_block_index`` for a kohya UNet module name; -1 for modules outside the numbered blocks."""
    m = _RE_SD.match(name)
    if m:
        side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
        return 1 + idx if side == "down" else 13 + idx
    if name.startswith("lora_unet_mid_block_"):
        return 12
    m = _RE_SGM.match(name)
    if m:
        offset = {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}[m.group(1)]
        return offset + int(m.group(2))
    if name.startswith(("lora_unet_time_embed_", "lora_unet_label_emb_")):
        return 0
    if name.startswith("lora_unet_out_"):
        return 22
    return -1
