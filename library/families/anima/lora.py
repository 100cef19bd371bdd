"""``--network_module networks.lora_anima``: sd-scripts' Anima LoRA (``networks/lora_anima.py``) as rules for our
adapter machinery (``ModelFamily.adapter_rules``; see ``library.families.adapters.AdapterRules``).

Names are sd-scripts': ``lora_unet_`` + the module's path in ``anima_models.Anima`` (``blocks.0.self_attn.q_proj``,
``llm_adapter.blocks.0.cross_attn.k_proj``) with dots as underscores, ``lora_te_`` + the path in Qwen3
(``layers.0.self_attn.q_proj``); the family's ``adapter_roots`` give them.

* **Targets.** Every Linear of the DiT's blocks, patch embedding, time embedding and final layer (sd-scripts'
  ``Block``, ``PatchEmbed``, ``TimestepEmbedding``, ``FinalLayer``: diffusers' ``CosmosTransformerBlock``,
  ``CosmosPatchEmbed``, ``CosmosTimestepEmbedding``, ``CosmosAdaLayerNorm`` + ``proj_out``), less the built-in
  exclusion ``.*(_modulation|_norm|_embedder|final_layer).*`` and ``exclude_patterns`` (a Python list literal of
  regexes), unless ``include_patterns`` names them; all ``re.fullmatch`` on the sd-scripts module path. That leaves
  the attention projections and the MLP of every block. ``train_llm_adapter=True`` adds the LLM adapter's blocks
  (``LLMAdapterTransformerBlock`` = ``AnimaTextConditionerBlock``). Qwen3's attention and MLP under ``lora_te``
  unless ``--network_train_unet_only``.
* **Ranks.** ``network_reg_dims`` (``regex=dim,...``: the first regex that fullmatches the module path, alpha
  ``--network_alpha``), else ``--network_dim``; rank 0 skips the module. ``network_reg_lrs`` likewise gives modules
  their own optimizer group. The regexes are read over the module path as sd-scripts reads them, and matched
  against the kohya name (``^lora_(unet|te)_`` + the regex with its literal dots as underscores + ``$``), so the
  shared machinery's name matching means the same thing.
* LoRA+ (``loraplus_lr_ratio``, ``loraplus_unet_lr_ratio``, ``loraplus_text_encoder_lr_ratio``), ``rank_dropout``,
  ``module_dropout``, ``verbose``: the common keys, as every module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..adapters import (
    PLAIN_LORA_NOT_READ,
    ArgSpec,
    LoraModuleArgs,
    NetworkSettings,
    Preset,
    Target,
    parse_reg_pairs,
    parse_regex_list,
)
from . import keys as K

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_anima"
BUILTIN_EXCLUDE = r".*(_modulation|_norm|_embedder|final_layer).*"
ADAPTER_CLASSES = ("AnimaTextConditionerBlock",)
TE_CLASSES = ("Qwen3Attention", "Qwen3MLP", "Qwen3SdpaAttention", "Qwen3FlashAttention2")


def path_regex(regex: str) -> str:
    """A regex over sd-scripts' module path -> the same over the kohya name (module docstring)."""
    return rf"^lora_(?:unet|te)_(?:{regex.replace(chr(92) + '.', '_')})$"


def _reg(value: str, number) -> tuple[tuple[str, int | float], ...]:
    return tuple((path_regex(r), v) for r, v in parse_reg_pairs(value, number))


def _bool(value: str) -> bool:
    return value.strip().lower() == "true"  # sd-scripts: anything but "true" is False


@dataclass(frozen=True)
class AnimaLoraArgs(LoraModuleArgs):
    """The ``--network_args`` networks.lora_anima reads."""

    train_llm_adapter: bool = False
    exclude_patterns: tuple[str, ...] = ()
    include_patterns: tuple[str, ...] = ()
    reg_dims: tuple[tuple[str, int], ...] = ()


Args = AnimaLoraArgs

ARGS: dict[str, ArgSpec] = {
    "train_llm_adapter": (_bool, "train_llm_adapter"),
    "exclude_patterns": (parse_regex_list, "exclude_patterns"),
    "include_patterns": (parse_regex_list, "include_patterns"),
    "network_reg_dims": (lambda v: _reg(v, int), "reg_dims"),
    "network_reg_lrs": (lambda v: _reg(v, float), "reg_lrs"),
    "verbose": (None, "verbose"),
}
DESCRIPTION = "sd-scripts' Anima LoRA"
HINT = ("Anima's ranks are set by network_reg_dims and its modules by exclude_patterns / include_patterns / "
        "train_llm_adapter; other algorithms with --network_module lycoris.kohya algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ + ("split_qkv",)
IGNORED_ELSEWHERE = {"train_llm_adapter": "only networks.lora_anima reads it (LyCORIS' presets decide there)"}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> AnimaLoraArgs:
    args = cfg.module_args
    return args if isinstance(args, AnimaLoraArgs) else AnimaLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: Anima has no convolution to adapt (as sd-scripts' lora_anima)",
                       cfg.conv_dim)  # fmt: skip


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    return []  # the shared rule (Qwen3 adapters need --network_train_unet_only with a text cache) applies


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    args = args_of(cfg)
    unet = tuple(classes.transformer) + (ADAPTER_CLASSES if args.train_llm_adapter else ())
    return Preset(unet, ("proj_out",), unet_name_kind="linear", te_by_prefix={"lora_te": TE_CLASSES})


def original_path(target: Target) -> str:
    """sd-scripts' module path of a target (the kohya name's source)."""
    return K.module_to_sd(target.path) if target.is_unet else target.path


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """The built-in exclusion and ``exclude_patterns`` unless ``include_patterns`` (``re.fullmatch`` on the path)."""
    args = args_of(cfg)
    exclude = [re.compile(p) for p in (*args.exclude_patterns, BUILTIN_EXCLUDE)]
    include = [re.compile(p) for p in args.include_patterns]
    kept = []
    for t in targets:
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
