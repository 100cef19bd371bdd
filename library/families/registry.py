"""The registered model families, and the questions answered by looking at all of them.

``library.families`` registers SD1, SD2 and SDXL on import; a new family calls :func:`register_family` once (see
docs/architecture.md, "Adding a model family"). Everything that picks or recognises a family (the entry scripts'
family selection, model-file detection, adapter-file and TI-file checks, the block numbering of adapter names)
asks this registry, so it needs no edit when a family is added.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .base import ModelFamily, missing_members
from .blocks import BlockLayout

if TYPE_CHECKING:
    from .adapters import AdapterRules

FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Add ``family`` under ``family.name``; ``TypeError`` when it lacks a member of :class:`ModelFamily`,
    ``ValueError`` when the name is taken (unless ``replace``). Returns the family."""
    missing = missing_members(family)
    if missing:
        raise TypeError(f"{family!r} is no ModelFamily: it lacks {', '.join(missing)}")
    if family.name in FAMILIES and not replace and FAMILIES[family.name] is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a registered family (tests that register a toy family clean up with this)."""
    FAMILIES.pop(name, None)


def get_family(name: str) -> ModelFamily:
    """The family object for a registered name ("sd1" | "sd2" | "sdxl" | ..., case-insensitive)."""
    family = FAMILIES.get(str(name).lower())
    if family is None:
        raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}")
    return family


def family_title(name: str) -> str:
    """The family's display name ("SD1.x", "SDXL"...), or ``name`` itself when it is not registered."""
    family = FAMILIES.get(name)
    return family.spec.title if family is not None else name


def trained_together(name: str) -> tuple[str, ...]:
    """The families one training script takes together with ``name`` (same ``spec.training_script``): ("sd1",
    "sd2") for SD1 or SD2, ("sdxl",) for SDXL; the registration order is kept (the first is the default)."""
    script = get_family(name).spec.training_script
    return tuple(n for n, f in FAMILIES.items() if f.spec.training_script == script)


def family_flags() -> dict[str, str]:
    """sd-scripts' family flags (without dashes) -> family name: {"v1": "sd1", "v2": "sd2", "sdxl": "sdxl"}."""
    return {f.spec.flag: name for name, f in FAMILIES.items() if f.spec.flag}


def block_layout(names: Iterable[str]) -> BlockLayout:
    """The block numbering of a network whose UNet module names are ``names`` (kohya names): the registered
    families' numberings that name a block of it, else the first family's."""
    names = list(names)
    layouts = list(dict.fromkeys(f.blocks for f in FAMILIES.values()))
    for layout in layouts:
        if any(layout.names_match(n) for n in names):
            return layout
    return layouts[0]


def block_layout_title(layout: BlockLayout) -> str:
    """ "SD1/SD2" or "SDXL": the families that number blocks this way, for messages."""
    return _short_titles(f for f in FAMILIES.values() if f.blocks == layout)


def adapter_families(prefixes: Iterable[str], names: Iterable[str] = ()) -> list[str]:
    """The families an adapter file with these kohya prefixes can be for. ``names``: its module names, which narrow
    the choice where prefixes cannot: SDXL and FLUX files both use ``lora_unet`` / ``lora_te1``, but only FLUX's
    denoiser names are ``lora_unet_double_blocks_...`` (each family's ``blocks.names_match``)."""
    prefixes = set(prefixes)
    fitting = [name for name, f in FAMILIES.items() if prefixes <= set(f.adapter_prefixes)]
    unet = [n for n in names if n.startswith("lora_unet_")]
    by_blocks = [name for name in fitting if any(FAMILIES[name].blocks.names_match(n) for n in unet)]
    return by_blocks or fitting


def adapter_family_label(prefixes: Iterable[str], names: Iterable[str] = ()) -> str | None:
    """Which families an adapter file with these kohya prefixes (and module ``names``, see :func:`adapter_families`)
    can be for, for messages ("SD1/SD2", "SDXL"), or None when they tell nothing (every family has them, e.g. a
    UNet-only file without block names, or no family has them)."""
    prefixes = set(prefixes)
    fitting = adapter_families(prefixes, names)
    if not prefixes or not fitting or len(fitting) == len(FAMILIES):
        return None
    return _short_titles(FAMILIES[name] for name in fitting)


def rules_by_module() -> dict[str, AdapterRules]:
    """Every registered family's sd-scripts network modules (``ModelFamily.adapter_rules``) -> their rules, in
    registration order (families sharing a module share its rules; the first family to state it gives them)."""
    rules: dict[str, AdapterRules] = {}
    for family in FAMILIES.values():
        for module, family_rules in family.adapter_rules.items():
            rules.setdefault(module, family_rules)
    return rules


def ti_keys_of_other_families(family: ModelFamily) -> set[str]:
    """Textual-inversion file keys that belong to other families' layouts (a file holding them is not for
    ``family``)."""
    return {k for f in FAMILIES.values() for k in f.ti_embedding_keys} - set(family.ti_embedding_keys)


def _short_titles(families: Iterable[ModelFamily]) -> str:
    return "/".join(dict.fromkeys(f.spec.title.removesuffix(".x") for f in families))
