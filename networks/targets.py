"""Which modules get an adapter and under which kohya name (the UNet block numbering is the family's:
``library.families.blocks``).

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
    for index, (prefix, root, rename, *fused) in enumerate(roots):
        if fused and fused[0]:
            raise ValueError(f"{prefix}: this model fuses several Linear layers into one adapter module "
                             f"({fused[0][0].name}...), which this adapter injection cannot target yet")  # fmt: skip
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
