"""``--network_module networks.lora_zimage``: musubi-tuner's Z-Image LoRA (``networks/lora_zimage.py`` over its
``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's: ``lora_unet_`` + the module's path in the DiT (``layers.0.attention.to_q``, diffusers'
names, which musubi-tuner's model shares) with dots as underscores. diffusers' ``ZImagePipeline.load_lora_weights``
reads them (``_convert_non_diffusers_z_image_lora_to_diffusers``); ComfyUI reads them by its kohya rule.

* **Targets.** Every Linear inside the ``ZImageTransformerBlock`` modules, minus musubi-tuner's built-in exclusion
  ``.*(_modulation|_refiner).*`` (``re.fullmatch`` on the module path): the 30 main blocks' attention ``to_q/k/v``,
  ``to_out.0`` and feed-forward ``w1/w2/w3``; the refiner blocks and the ``adaLN_modulation`` Linears stay out, as
  does everything outside the blocks; no text-encoder adapters (musubi-tuner trains none).
* ``exclude_patterns`` / ``include_patterns`` (Python list literals, ``re.fullmatch`` on the module path; include
  wins), ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the module path), LoRA+, ``rank_dropout``,
  ``module_dropout``, ``verbose``: the common keys.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..adapters import PLAIN_LORA_NOT_READ, ArgSpec, LoraModuleArgs, NetworkSettings, Preset, Target, parse_reg_pairs

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_zimage"
BUILTIN_EXCLUDE = r".*(_modulation|_refiner).*"
BLOCK_CLASSES = ("ZImageTransformerBlock",)


def _patterns(value: str) -> tuple[str, ...]:
    """A Python literal: one regex or a list of them (musubi-tuner's ``ast.literal_eval``)."""
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError("expected a Python list of regular expressions, e.g. ['.*mlp.*']") from None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    for p in parsed:
        if not isinstance(p, str):
            raise ValueError(f"{p!r} is not a string")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{p!r} is not a regular expression ({e})") from None
    return tuple(parsed)


def path_regex(regex: str) -> str:
    """A regex over the module path -> the same over the kohya name."""
    return rf"^lora_unet_(?:{regex.replace(chr(92) + '.', '_')})$"


def _reg(value: str, number) -> tuple[tuple[str, int | float], ...]:
    return tuple((path_regex(r), v) for r, v in parse_reg_pairs(value, number))


@dataclass(frozen=True)
class ZImageLoraArgs(LoraModuleArgs):
    """The ``--network_args`` networks.lora_zimage reads."""

    exclude_patterns: tuple[str, ...] = ()
    include_patterns: tuple[str, ...] = ()
    reg_dims: tuple[tuple[str, int], ...] = ()


Args = ZImageLoraArgs

ARGS: dict[str, ArgSpec] = {
    "exclude_patterns": (_patterns, "exclude_patterns"),
    "include_patterns": (_patterns, "include_patterns"),
    "network_reg_dims": (lambda v: _reg(v, int), "reg_dims"),
    "network_reg_lrs": (lambda v: _reg(v, float), "reg_lrs"),
    "verbose": (None, "verbose"),
}
DESCRIPTION = "musubi-tuner's Z-Image LoRA"
HINT = ("Z-Image's modules are set by exclude_patterns / include_patterns; other algorithms with --network_module "
        "lycoris.kohya algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ + ("split_qkv",)
IGNORED_ELSEWHERE: dict[str, str] = {}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> ZImageLoraArgs:
    args = cfg.module_args
    return args if isinstance(args, ZImageLoraArgs) else ZImageLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: Z-Image's blocks have no convolution to adapt", cfg.conv_dim)


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    return []


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    return Preset(BLOCK_CLASSES, (), unet_name_kind="linear", te_by_prefix={})


def original_path(target: Target) -> str:
    return target.path


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """The built-in exclusion and ``exclude_patterns`` unless ``include_patterns`` (``re.fullmatch`` on the path);
    the DiT's modules only."""
    args = args_of(cfg)
    exclude = [re.compile(p) for p in (*args.exclude_patterns, BUILTIN_EXCLUDE)]
    include = [re.compile(p) for p in args.include_patterns]
    kept = []
    for t in targets:
        if not t.is_unet:
            continue
        path = original_path(t)
        if any(p.fullmatch(path) for p in exclude) and not any(p.fullmatch(path) for p in include):
            if args.verbose:
                logger.info("exclude: %s", path)
            continue
        kept.append(t)
    return kept


def block_counts(targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
    return {}


def block_masks(cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    return {}


def rank_for(cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
    args = args_of(cfg)
    for regex, dim in args.reg_dims:
        if re.search(regex, name):
            return int(dim), cfg.alpha, f"network_reg_dims {regex}"
    return cfg.dim, cfg.alpha, "--network_dim"


def split_rows(cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
    return None
