"""The registered model families, and the questions answered by looking at all of them.

Families are found on first use (any read of :data:`FAMILIES`, :func:`get_family`, :func:`register_family` ...):

* in the family folders of ``library/families/``: each folder's ``__init__.py`` defines ``FAMILIES``, a tuple of
  family objects in registration order, and ``ORDER``, an int (the SD folder 0, FLUX 10, SD3 20);
* in installed packages, through the entry-point group ``sdtrain.families``: each entry point names a module with the
  same ``FAMILIES`` and ``ORDER`` (default 100), e.g. in a plug-in's ``pyproject.toml``::

      [project.entry-points."sdtrain.families"]
      lumina = "sdtrain_lumina.families"

sorted by ``ORDER``, then by folder / entry-point name. The first registered family is the default. A family made
at run time (a test's toy family) is added with :func:`register_family`. Everything that picks or recognises a
family (the entry scripts' family selection, model-file detection, adapter-file and TI-file checks, the block
numbering of adapter names, the lists of families in messages and ``--help``) asks this registry, so it needs no
edit when a family is added (see docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from library.families.protocol import ModelFamily, missing_members

from .blocks import BlockLayout

if TYPE_CHECKING:
    from .adapters import AdapterRules

ENTRY_POINT_GROUP = "sdtrain.families"
DEFAULT_ORDER = 100  # a plug-in's (or a folder's) ORDER when it states none


def _family_modules() -> list[tuple[int, str, ModuleType]]:
    """``(ORDER, name, module)`` of every family folder and ``sdtrain.families`` entry point, sorted."""
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.ispkg:
            module = importlib.import_module(f"{__package__}.{info.name}")
            if hasattr(module, "FAMILIES"):  # the shared packages (encoders, autoencoders) define none
                found.append((int(getattr(module, "ORDER", DEFAULT_ORDER)), info.name, module))
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            module = entry.load()
        except Exception as e:
            raise ImportError(f"model-family plug-in {entry.name!r} ({entry.value}, entry point group "
                              f"{ENTRY_POINT_GROUP}): {type(e).__name__}: {e}") from e  # fmt: skip
        if not isinstance(getattr(module, "FAMILIES", None), tuple | list):
            raise TypeError(f"model-family plug-in {entry.name!r} ({entry.value}): the module defines no FAMILIES "
                            "tuple of family objects")  # fmt: skip
        found.append((int(getattr(module, "ORDER", DEFAULT_ORDER)), entry.name, module))
    return sorted(found, key=lambda item: (item[0], item[1]))


class Registry(MutableMapping):
    """Family name -> family, in registration order; the families are discovered (module docstring) on first use."""

    def __init__(self) -> None:
        self._families: dict[str, ModelFamily] = {}
        self._discovered = False

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True  # first: registering asks this mapping again
        try:
            for _, _, module in _family_modules():
                for family in module.FAMILIES:
                    register_family(family)
        except BaseException:
            self._families.clear()
            self._discovered = False
            raise

    def __getitem__(self, name: str) -> ModelFamily:
        self._discover()
        return self._families[name]

    def __setitem__(self, name: str, family: ModelFamily) -> None:
        self._discover()
        self._families[name] = family

    def __delitem__(self, name: str) -> None:
        self._discover()
        del self._families[name]

    def __iter__(self) -> Iterator[str]:
        self._discover()
        return iter(self._families)

    def __len__(self) -> int:
        self._discover()
        return len(self._families)

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._families

    def __repr__(self) -> str:
        return f"<model families {list(self)}>"


FAMILIES: MutableMapping[str, ModelFamily] = Registry()


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


def default_families() -> tuple[str, ...]:
    """The families the first registered family's script trains: what a script or tool that takes any family's model
    assumes before it has read one (the registration order puts SD 1.x / 2.x first)."""
    return trained_together(next(iter(FAMILIES)))


def family_flags() -> dict[str, str]:
    """sd-scripts' family flags (without dashes) -> family name: {"v1": "sd1", "v2": "sd2", "sdxl": "sdxl"}."""
    return {f.spec.flag: name for name, f in FAMILIES.items() if f.spec.flag}


def flagged_family(args: object, flags: Iterable[str] | None = None) -> str | None:
    """The family an sd-scripts family flag set on ``args`` names (``--v1`` / ``--v2`` / ``--sdxl``, see
    :func:`family_flags`; only the flags in ``flags`` when given), or None when none is set."""
    names = family_flags()
    return next((names[f] for f in (names if flags is None else flags) if getattr(args, f, False)), None)


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


def network_module_problems(module: str, family: ModelFamily) -> list[str]:
    """A family's own sd-scripts network module (``networks.lora_flux``) given for a model of another family: one
    problem naming whose module it is and the modules that fit (its rules would select nothing of this model, or
    the wrong things, and the file would say it was made with them)."""
    owners = [f for f in FAMILIES.values() if module in f.adapter_rules]
    if not owners or module in family.adapter_rules:
        return []
    fits = [*family.adapter_rules, "networks.lora", "lycoris.kohya"]
    return [f"--network_module {module} is the network module of {_short_titles(owners)} models "
            f"({owners[0].spec.training_script}); this model is {family.spec.title}: use "
            f"{', '.join(dict.fromkeys(fits))}"]  # fmt: skip


def ti_keys_of_other_families(family: ModelFamily) -> set[str]:
    """Textual-inversion file keys that belong to other families' layouts (a file holding them is not for
    ``family``)."""
    return {k for f in FAMILIES.values() for k in f.ti_embedding_keys} - set(family.ti_embedding_keys)


def _short_titles(families: Iterable[ModelFamily]) -> str:
    return "/".join(dict.fromkeys(f.spec.title.removesuffix(".x") for f in families))


def block_swap_groups() -> tuple[list[str], list[str]]:
    """The groups (``spec.group_title``) and training scripts of the families whose denoisers ``--blocks_to_swap``
    applies to, in registration order (for messages: "FLUX and SD3 (flux_train_network.py, sd3_train_network.py)")."""
    swapping = [f.spec for f in FAMILIES.values() if f.spec.block_swap]
    return list(dict.fromkeys(s.group_title for s in swapping)), list(
        dict.fromkeys(s.training_script for s in swapping)
    )
