r"""``--network_module networks.lora_flux_2``: musubi-tuner's FLUX.2 LoRA (``networks/lora_flux_2.py`` over its
``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's (BFL module paths, which ComfyUI and diffusers' ``_convert_kohya_flux2_lora_to_diffusers``
read): ``lora_unet_`` + the module's BFL path with dots as underscores (``lora_unet_double_blocks_0_img_attn_qkv``,
``lora_unet_single_blocks_0_linear1``). A double block's ``img_attn.qkv`` / ``txt_attn.qkv`` is one adapter over
diffusers' three Linears (a fused target, ``keys.fused_modules``).

* **Targets.** Every Linear inside the double and single blocks (``DoubleStreamBlock`` / ``SingleStreamBlock`` =
  diffusers' ``Flux2TransformerBlock`` / ``Flux2SingleTransformerBlock``): ``img_attn.qkv``, ``img_attn.proj``,
  ``img_mlp.0``, ``img_mlp.2``, the same for ``txt_``, and ``linear1`` / ``linear2``; no text-encoder adapters.
* **Exclusion.** musubi-tuner's default ``exclude_patterns`` ``.*(img_mod\.lin|txt_mod\.lin|modulation\.lin).*``
  (replaced when ``exclude_patterns`` is given) plus the always-added ``.*(norm).*``, unless ``include_patterns``
  names them; ``re.fullmatch`` on the BFL module path.
* Ranks: ``--network_dim`` / ``--network_alpha``; ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the BFL
  path), LoRA+, ``rank_dropout``, ``module_dropout``, ``verbose``: the common keys.
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
from . import keys as K

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_flux_2"
DEFAULT_EXCLUDE = r".*(img_mod\.lin|txt_mod\.lin|modulation\.lin).*"
ALWAYS_EXCLUDE = r".*(norm).*"
BLOCK_CLASSES = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")


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
class Flux2LoraArgs(LoraModuleArgs):
    """The ``--network_args`` networks.lora_flux_2 reads (``exclude_patterns`` None: musubi-tuner's default)."""

    exclude_patterns: tuple[str, ...] | None = None
    include_patterns: tuple[str, ...] = ()
    reg_dims: tuple[tuple[str, int], ...] = ()


Args = Flux2LoraArgs

ARGS: dict[str, ArgSpec] = {
    "exclude_patterns": (_patterns, "exclude_patterns"),
    "include_patterns": (_patterns, "include_patterns"),
    "network_reg_dims": (lambda v: _reg(v, int), "reg_dims"),
    "network_reg_lrs": (lambda v: _reg(v, float), "reg_lrs"),
    "verbose": (None, "verbose"),
}
DESCRIPTION = "musubi-tuner's FLUX.2 LoRA"
HINT = ("FLUX.2's modules are set by exclude_patterns / include_patterns; other algorithms with --network_module "
        "lycoris.kohya algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ + ("split_qkv",)
IGNORED_ELSEWHERE: dict[str, str] = {}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> Flux2LoraArgs:
    args = cfg.module_args
    return args if isinstance(args, Flux2LoraArgs) else Flux2LoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: FLUX.2's blocks have no convolution to adapt", cfg.conv_dim)


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    return []


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    return Preset(BLOCK_CLASSES, (), unet_name_kind="linear", te_by_prefix={})


def original_path(target: Target) -> str:
    """musubi-tuner's module path of a target (BFL names; a fused target's path is its BFL name already)."""
    return target.path if target.fused is not None else K.bfl_module(target.path)


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """The built-in exclusion and ``exclude_patterns`` unless ``include_patterns`` (``re.fullmatch`` on the path);
    the DiT's modules only."""
    args = args_of(cfg)
    given = (DEFAULT_EXCLUDE,) if args.exclude_patterns is None else args.exclude_patterns
    exclude = [re.compile(p) for p in (*given, ALWAYS_EXCLUDE)]
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
