"""Which modules get an adapter and under which kohya name (the UNet block numbering is the family's:
``library.families.blocks``).

Targets are chosen the way sd-scripts (``networks.lora``) and LyCORIS (``lycoris.kohya`` presets) choose them: every
Linear / Conv2d (and, with ``train_norm``, GroupNorm / LayerNorm) inside a module of a target *class*, plus modules
whose path matches a target *name*. The built-in presets are written in the family's class groups
(:class:`~library.families.base.TargetClasses`: ``transformer``, ``conv_blocks``, ``attention``, ``text_encoder``,
``full_names``) and resolved with :func:`builtin_preset`, so SD's presets select ``Transformer2DModel`` /
``ResnetBlock2D`` / ``CLIPAttention`` and FLUX's ``FluxTransformerBlock`` / ``T5Attention``.

A root is a :class:`~library.families.base.Root` ``(prefix, module, rename, fused)`` from the model family: the kohya
name of a module is ``prefix + "_" + rename(path).replace(".", "_")`` (e.g. SDXL's UNet is renamed to the sgm layout
and a flat transformers-5 ``CLIPTextModel`` gets its ``text_model.`` level back). A *fused* module (``Root.fused``:
FLUX's ``double_blocks.0.img_attn.qkv`` = ``to_q | to_k | to_v``) is one target named ``prefix + "_" + name`` (dots as
underscores, no rename) whose weight is its segments' rows stacked (:class:`networks.fused.FusedBase`); it is a target
when the preset selects any of its leaves (or its name), and its leaves are never targets on their own. Plain
3-tuples ``(prefix, module, rename)`` are accepted wherever roots are (:func:`as_root`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from library.families.adapters import Preset, Target
from library.families.base import Fused, Root, TargetClasses

from .fused import FusedLeaf, build_fused
from .layers import weight_kind

__all__ = ["PRESETS", "Preset", "Root", "Target", "builtin_preset", "find_targets", "kohya_name"]


def as_root(root) -> Root:
    """A :class:`Root` from a Root or a plain ``(prefix, module, rename[, fused])`` tuple."""
    return root if isinstance(root, Root) else Root(*root)


@dataclass(frozen=True)
class PresetSpec:
    """A built-in preset in terms of a family's :class:`TargetClasses` groups.

    ``unet``: the groups (``transformer``, ``conv_blocks``, ``attention``) whose classes are selected in the denoiser;
    ``full_names``: add the family's ``full_names`` (of ``name_kind`` only, when given); ``te``: ``"all"`` (the
    ``text_encoder`` classes), ``"attention"`` (``text_encoder_attention``) or ``""`` (no text encoder).
    """

    unet: tuple[str, ...]
    te: str = "all"
    full_names: bool = False
    name_kind: str | None = None
    enable_conv: bool = False

    def resolve(self, classes: TargetClasses) -> Preset:
        unet = tuple(c for group in self.unet for c in getattr(classes, group))
        te_map = {"all": classes.text_encoder, "attention": classes.text_encoder_attention}.get(self.te, {})
        te = tuple(dict.fromkeys(c for names in te_map.values() for c in names))
        names = classes.full_names if self.full_names else ()
        by_prefix = dict(te_map) if set(te_map) - {"*"} else None  # "*" alone: te_classes says it all
        return Preset(unet, names, te, (), enable_conv=self.enable_conv, unet_name_kind=self.name_kind,
                      te_by_prefix=by_prefix)  # fmt: skip


# LyCORIS' built-in presets (lycoris/config.py) in class groups. "kohya" is networks.lora's default (LyCORIS
# "attn-mlp"); networks.lora adds the conv blocks when conv_dim / conv_block_dims are given. "full-lin" takes the
# full names that are Linear, "unet-convblock-only" those that are convolutions (SD: conv_in / conv_out).
PRESETS: dict[str, PresetSpec] = {
    "kohya": PresetSpec(("transformer",)),
    "attn-mlp": PresetSpec(("transformer",)),
    "full": PresetSpec(("transformer", "conv_blocks"), full_names=True, enable_conv=True),
    "full-lin": PresetSpec(("transformer", "conv_blocks"), full_names=True, name_kind="linear"),
    "attn-only": PresetSpec(("attention",), te="attention"),
    "unet-only": PresetSpec(("transformer", "conv_blocks"), te="", full_names=True, enable_conv=True),
    "unet-transformer-only": PresetSpec(("transformer",), te=""),
    "unet-convblock-only": PresetSpec(("conv_blocks",), te="", full_names=True, name_kind="conv", enable_conv=True),
}


def default_classes() -> TargetClasses:
    """The classes of the first registered family (the SD UNet families'), used where a caller passes none."""
    from library.families import FAMILIES

    return next(iter(FAMILIES.values())).target_classes


def builtin_preset(name: str, classes: TargetClasses | None = None) -> Preset:
    """The built-in preset ``name`` with the family's class names (``classes`` None: the SD UNet families')."""
    return PRESETS[name].resolve(classes or default_classes())


def renamed(rename: Callable[[str], str], path: str) -> str:
    """``rename(path)``, or ``path`` itself for paths the rename has no entry for (containers, embeddings)."""
    try:
        return rename(path)
    except KeyError:
        return path


def kohya_name(prefix: str, rename: Callable[[str], str], path: str) -> str:
    return f"{prefix}_{renamed(rename, path)}".replace(".", "_")


def fused_name(prefix: str, fused: Fused) -> str:
    """The kohya name of a fused module: ``prefix + "_" + name`` with dots as underscores (no rename)."""
    return f"{prefix}_{fused.name}".replace(".", "_")


def fused_targets(roots: Sequence[Root]) -> tuple[dict[tuple[int, str], Target], dict[tuple[int, str], Target]]:
    """``(by_leaf, by_name)``: the fused target of each leaf path ``(root index, path)``, and each fused target by
    ``(root index, fused name)``. ``ValueError`` naming the root and module for fused entries that do not fit the
    model (see :func:`networks.fused.build_fused`)."""
    by_leaf: dict[tuple[int, str], Target] = {}
    by_name: dict[tuple[int, str], Target] = {}
    for index, root in enumerate(roots):
        prefix, module, _, fused = as_root(root)
        for entry in fused:
            base = build_fused(prefix, module, entry)
            target = Target(fused_name(prefix, entry), base, index, entry.name, "linear", entry)
            by_name[(index, entry.name)] = target
            for seg in entry.segments:
                taken = by_leaf.setdefault((index, seg.path), target)
                if taken is not target:
                    raise ValueError(f"{prefix}: {seg.path} is a leaf of two fused modules, {taken.path} and "
                                     f"{entry.name}; a Linear belongs to one fused module")  # fmt: skip
    return by_leaf, by_name


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
    """Every module the preset selects, in model order, de-duplicated. ``conv``: include k > 1 convolutions.

    Roots with the ``lora_unet`` prefix take the preset's UNet classes and names, the others its text-encoder ones.
    A fused module is selected when one of its leaves is (or its name matches a name), and not when its name is
    excluded; it stands in the order of its first selected leaf."""
    wanted = {"linear"} | ({"conv"} if conv else set()) | ({"norm"} if train_norm else set())
    roots = [as_root(r) for r in roots]
    by_leaf, by_name = fused_targets(roots)
    targets: dict[str, Target] = {}
    for index, (prefix, root, rename, _) in enumerate(roots):
        is_unet = prefix.startswith("lora_unet")
        classes = preset.unet_classes if is_unet else preset.te_classes_of(prefix)
        names = preset.unet_names if is_unet else preset.te_names
        name_kind = preset.unet_name_kind if is_unet else None
        for path, module in root.named_modules():
            if isinstance(module, FusedLeaf) or (hasattr(module, "base_layer") and hasattr(module, "adapter")):
                raise ValueError(f"{prefix}: {path} already holds an adapter; eject() the first network before "
                                 "injecting another (or merge it with --base_weights)")  # fmt: skip
            aliases = (path, renamed(rename, path)) if path else ()
            if _matches(preset.exclude_names, aliases, preset.use_fnmatch):
                continue
            if type(module).__name__ in classes:
                children = [(f"{path}.{c}" if c else path, m) for c, m in module.named_modules()]
            elif path and _matches(names, aliases, preset.use_fnmatch):
                children = [(path, module)]
                if name_kind is not None and weight_kind(module) != name_kind:
                    continue
            else:
                continue
            for child_path, child in children:
                fused = by_leaf.get((index, child_path))
                if fused is not None:
                    excluded = _matches(preset.exclude_names, (fused.path, child_path), preset.use_fnmatch)
                    if not excluded and fused.name not in targets:
                        targets[fused.name] = fused
                    continue
                kind = weight_kind(child)
                name = kohya_name(prefix, rename, child_path)
                excluded = _matches(preset.exclude_names, (child_path, renamed(rename, child_path)), preset.use_fnmatch)
                if kind in wanted and name not in targets and not excluded:
                    targets[name] = Target(name, child, index, child_path, kind)
        for (i, name), fused in by_name.items():  # fused modules selected by their own name
            if i == index and fused.name not in targets and _matches(names, (name,), preset.use_fnmatch):
                if not _matches(preset.exclude_names, (name,), preset.use_fnmatch):
                    targets[fused.name] = fused
    return list(targets.values())
