"""``--network_module networks.lora_qwen_image``: musubi-tuner's Qwen-Image LoRA (``networks/lora_qwen_image.py`` over
its ``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's (ComfyUI reads them as they are): ``lora_unet_`` + the module's path in the DiT
(``transformer_blocks.0.attn.to_q``, diffusers' names, which musubi-tuner's model shares) with dots as underscores.

* **Targets.** Every Linear inside the ``QwenImageTransformerBlock`` modules (the 60 blocks: attention projections
  ``to_q/k/v``, ``add_q/k/v_proj``, ``to_out.0``, ``to_add_out``, the MLPs and the modulations ``img_mod.1`` /
  ``txt_mod.1``); nothing outside the blocks, no text-encoder adapters (musubi-tuner trains none).
* **Exclusion.** musubi-tuner's built-in ``.*(_mod_).*`` and ``exclude_patterns`` (a Python list literal), unless
  ``include_patterns`` names them, ``re.fullmatch`` on the module path (``transformer_blocks.0.img_mod.1``). As in
  musubi-tuner, the built-in pattern matches no module of the released DiT (its modulations are ``img_mod.1``), so the
  modulations are trained; ``exclude_patterns=[".*_mod.*"]`` leaves them out.
* Ranks: ``--network_dim`` / ``--network_alpha``; ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the module
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

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_qwen_image"
BUILTIN_EXCLUDE = r".*(_mod_).*"
BLOCK_CLASSES = ("QwenImageTransformerBlock",)


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
class QwenImageLoraArgs(LoraModuleArgs):
    """The ``--network_args`` networks.lora_qwen_image reads."""

    exclude_patterns: tuple[str, ...] = ()
    include_patterns: tuple[str, ...] = ()
    reg_dims: tuple[tuple[str, int], ...] = ()


Args = QwenImageLoraArgs

ARGS: dict[str, ArgSpec] = {
    "exclude_patterns": (_patterns, "exclude_patterns"),
    "include_patterns": (_patterns, "include_patterns"),
    "network_reg_dims": (lambda v: _reg(v, int), "reg_dims"),
    "network_reg_lrs": (lambda v: _reg(v, float), "reg_lrs"),
    "verbose": (None, "verbose"),
}
DESCRIPTION = "musubi-tuner's Qwen-Image LoRA"
HINT = ("Qwen-Image's modules are set by exclude_patterns / include_patterns; other algorithms with --network_module "
        "lycoris.kohya algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ + ("split_qkv",)
IGNORED_ELSEWHERE: dict[str, str] = {}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> QwenImageLoraArgs:
    args = cfg.module_args
    return args if isinstance(args, QwenImageLoraArgs) else QwenImageLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: Qwen-Image's blocks have no convolution to adapt", cfg.conv_dim)


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
