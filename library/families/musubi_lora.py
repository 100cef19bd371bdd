"""musubi-tuner's per-family LoRA modules (``networks/lora_<family>.py`` over its ``networks/lora.py``) as rules for
our adapter machinery (:class:`~library.families.adapters.AdapterRules`): one :class:`MusubiLoraRules` a family
configures with its module name, title, block classes and exclusions.

Names are musubi-tuner's: ``lora_unet_`` + the module's path in the DiT (the family's ``musubi_path`` of a target)
with dots as underscores.

* **Targets.** Every Linear inside the family's block classes; nothing outside the blocks, no text-encoder adapters
  (musubi-tuner trains none).
* **Exclusion.** ``re.fullmatch`` on the module path: the family's default ``exclude_patterns`` (replaced when
  ``exclude_patterns`` is given, a Python list literal) plus its always-added pattern, unless ``include_patterns``
  names the module (include wins).
* Ranks: ``--network_dim`` / ``--network_alpha``; ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the module
  path), LoRA+, ``rank_dropout``, ``module_dropout``, ``verbose``: the common keys. ``split_qkv`` is not read;
  ``conv_dim`` warns (the blocks have no convolution).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .adapters import (
    PLAIN_LORA_NOT_READ,
    ArgSpec,
    LoraModuleArgs,
    NetworkSettings,
    Preset,
    Target,
    parse_reg_pairs,
    parse_regex_list,
)

if TYPE_CHECKING:
    from .base import TargetClasses

logger = logging.getLogger("networks.config")


def path_regex(regex: str) -> str:
    """A regex over the module path -> the same over the kohya name."""
    return rf"^lora_unet_(?:{regex.replace(chr(92) + '.', '_')})$"


def _reg(value: str, number) -> tuple[tuple[str, int | float], ...]:
    return tuple((path_regex(r), v) for r, v in parse_reg_pairs(value, number))


@dataclass(frozen=True)
class MusubiLoraArgs(LoraModuleArgs):
    """The ``--network_args`` musubi-tuner's LoRA modules read (``exclude_patterns`` None: the module's default)."""

    exclude_patterns: tuple[str, ...] | None = None
    include_patterns: tuple[str, ...] = ()
    reg_dims: tuple[tuple[str, int], ...] = ()


def _own_path(target: Target) -> str:
    return target.path


class MusubiLoraRules:
    """The rules of one musubi-tuner LoRA module (module docstring).

    ``module``: the ``--network_module`` name; ``title``: the family, for messages; ``block_classes``: the classes
    whose Linears are targets; ``always_exclude``: the pattern musubi-tuner always adds; ``default_exclude``: its
    ``exclude_patterns`` when none are given; ``musubi_path``: musubi-tuner's module path of a target (default: the
    target's own path).
    """

    Args = MusubiLoraArgs
    ARGS: dict[str, ArgSpec] = {
        "exclude_patterns": (parse_regex_list, "exclude_patterns"),
        "include_patterns": (parse_regex_list, "include_patterns"),
        "network_reg_dims": (lambda v: _reg(v, int), "reg_dims"),
        "network_reg_lrs": (lambda v: _reg(v, float), "reg_lrs"),
        "verbose": (None, "verbose"),
    }
    NOT_READ = PLAIN_LORA_NOT_READ + ("split_qkv",)
    IGNORED_ELSEWHERE: dict[str, str] = {}
    CONVERSION = None

    def __init__(self, module: str, title: str, block_classes: tuple[str, ...], always_exclude: str, *,
                 default_exclude: tuple[str, ...] = (),
                 musubi_path: Callable[[Target], str] = _own_path) -> None:  # fmt: skip
        self.MODULE = module
        self.DESCRIPTION = f"musubi-tuner's {title} LoRA"
        self.HINT = (f"{title}'s modules are set by exclude_patterns / include_patterns; other algorithms with "
                     "--network_module lycoris.kohya algo=...")  # fmt: skip
        self.title, self.block_classes = title, block_classes
        self.always_exclude, self.default_exclude = always_exclude, default_exclude
        self.musubi_path = musubi_path

    def __repr__(self) -> str:
        return f"MusubiLoraRules({self.MODULE!r})"

    def args_of(self, cfg: NetworkSettings) -> MusubiLoraArgs:
        args = cfg.module_args
        return args if isinstance(args, MusubiLoraArgs) else MusubiLoraArgs()

    def wants_conv(self, cfg: NetworkSettings) -> bool:
        return False

    def validate(self, cfg: NetworkSettings, errors: list[str]) -> None:
        if cfg.conv_dim:
            logger.warning("--network_args conv_dim=%s: %s's blocks have no convolution to adapt", cfg.conv_dim,
                           self.title)  # fmt: skip

    def text_cache_problems(self, cfg: NetworkSettings) -> list[str]:
        return []

    def preset(self, cfg: NetworkSettings, classes: TargetClasses) -> Preset:
        return Preset(self.block_classes, (), unet_name_kind="linear", te_by_prefix={})

    def select(self, cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
        """The exclusions unless ``include_patterns`` (``re.fullmatch`` on the path); the DiT's modules only."""
        args = self.args_of(cfg)
        given = self.default_exclude if args.exclude_patterns is None else args.exclude_patterns
        exclude = [re.compile(p) for p in (*given, self.always_exclude)]
        include = [re.compile(p) for p in args.include_patterns]
        kept = []
        for t in targets:
            if not t.is_unet:
                continue
            path = self.musubi_path(t)
            if any(p.fullmatch(path) for p in exclude) and not any(p.fullmatch(path) for p in include):
                if args.verbose:
                    logger.info("exclude: %s", path)
                continue
            kept.append(t)
        return kept

    def block_counts(self, targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
        return {}

    def block_masks(self, cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
        return {}

    def rank_for(self, cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
        for regex, dim in self.args_of(cfg).reg_dims:
            if re.search(regex, name):
                return int(dim), cfg.alpha, f"network_reg_dims {regex}"
        return cfg.dim, cfg.alpha, "--network_dim"

    def split_rows(self, cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
        return None
