"""``--network_module networks.lora_lumina``: sd-scripts' Lumina 2 LoRA (``networks/lora_lumina.py``) as rules for our
adapter machinery (``ModelFamily.adapter_rules``; see ``library.families.adapters.AdapterRules``).

The rules are sd-scripts' ``create_network`` / ``LoRANetwork.create_modules``, on kohya names of Alpha-VLLM module
paths (``lora_unet_layers_0_attention_qkv``; the family's ``adapter_roots`` give them):

* **Targets.** Every Linear inside the transformer blocks and the final layer (sd-scripts' ``JointTransformerBlock``
  / ``FinalLayer``; diffusers' ``Lumina2TransformerBlock`` / ``LuminaLayerNormContinuous``): per block of ``layers``,
  ``noise_refiner`` and ``context_refiner``: ``attention.qkv`` (fused over ``to_q | to_k | to_v``), ``attention.out``,
  ``feed_forward.w1/w2/w3``, ``adaLN_modulation.1`` (not in the context refiner); ``final_layer.linear`` and
  ``final_layer.adaLN_modulation.1``. Gemma-2's attention and MLP (``lora_te_``; sd-scripts' one-encoder prefix).
  ``embedder_dims=[x,t,cap]`` adds ``x_embedder``, ``t_embedder.mlp.0/2`` and ``cap_embedder.1`` at those ranks.
* **Ranks.** ``--network_dim`` (an embedder: its ``embedder_dims`` entry), then the first of ``attn_dim``
  (``attention`` in the kohya name), ``mlp_dim`` (``mlp``: only the time embedder's ``t_embedder_mlp_*`` has it, as
  in sd-scripts, whose feed-forward modules are ``feed_forward_w*``), ``mod_dim`` (``modulation``), ``refiner_dim``
  (``refiner``) that is given and whose identifier is in the name. Rank 0 skips the module. Text encoders take
  ``--network_dim``. Alpha is ``--network_alpha`` everywhere.
* **train_blocks** ``all`` (default) | ``transformer`` (``layers_``) | ``refiners`` | ``noise_refiner`` |
  ``context_refiner`` keeps those blocks' modules (the final layer only with ``all``; embedders and Gemma always).
* **split_qkv.** ``attention.qkv`` gets one LoRA per part (q, k, v: ``heads · head_dim``, ``kv_heads · head_dim`` and
  ``kv_heads · head_dim`` rows), held and saved as one LoRA of rank 3r with a block-diagonal ``lora_up``, as sd-scripts
  saves it; the file's alpha is 3α (a reader's scale alpha/rank = α/r is the trained one; sd-scripts writes α).
* ``rank_dropout``, ``module_dropout``, ``loraplus_lr_ratio`` / ``loraplus_unet_lr_ratio`` /
  ``loraplus_text_encoder_lr_ratio``, ``verbose`` as every module; ``conv_dim`` / ``conv_alpha`` select nothing
  (Lumina 2 has no convolution; a warning, as sd-scripts' commented-out conv path).
"""

from __future__ import annotations

import logging
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
    parse_dim,
    parse_rank_list,
)

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_lumina"
TRAIN_BLOCKS = ("all", "transformer", "refiners", "noise_refiner", "context_refiner")
BLOCK_FILTERS = {"transformer": ("layers_",), "noise_refiner": ("noise_refiner",),
                 "context_refiner": ("context_refiner",), "refiners": ("noise_refiner", "context_refiner")}  # fmt: skip
TYPE_DIMS = (("attn_dim", "attention"), ("mlp_dim", "mlp"), ("mod_dim", "modulation"), ("refiner_dim", "refiner"))
EMBEDDERS = (("x_embedder", r"x_embedder$"), ("t_embedder", r"t_embedder\."), ("cap_embedder", r"cap_embedder\."))
GEMMA_CLASSES = ("Gemma2Attention", "Gemma2MLP")


@dataclass(frozen=True)
class LuminaLoraArgs(LoraModuleArgs):
    """The ``--network_args`` only networks.lora_lumina reads; None: not given."""

    attn_dim: int | None = None
    mlp_dim: int | None = None
    mod_dim: int | None = None
    refiner_dim: int | None = None
    embedder_dims: tuple[int, ...] | None = None  # x, t, cap
    train_blocks: str | None = None


Args = LuminaLoraArgs


def parse_embedder_dims(value: str) -> tuple[int, ...]:
    return parse_rank_list(value, ("x_embedder", "t_embedder", "cap_embedder"))


ARGS: dict[str, ArgSpec] = {
    **{key: (parse_dim, key) for key, _ in TYPE_DIMS},
    "embedder_dims": (parse_embedder_dims, "embedder_dims"),
    "train_blocks": (str.strip, "train_blocks"),
    "split_qkv": (None, "split_qkv"),
    "verbose": (None, "verbose"),
}
DESCRIPTION = "sd-scripts' Lumina 2 LoRA"
HINT = ("Lumina 2 ranks are set by attn_dim / mlp_dim / mod_dim / refiner_dim / embedder_dims, other algorithms with "
        "--network_module lycoris.kohya algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ
IGNORED_ELSEWHERE: dict[str, str] = {}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> LuminaLoraArgs:
    args = cfg.module_args
    return args if isinstance(args, LuminaLoraArgs) else LuminaLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    args = args_of(cfg)
    if args.train_blocks is not None and args.train_blocks not in TRAIN_BLOCKS:
        errors.append(f"--network_args train_blocks={args.train_blocks}: expected one of {', '.join(TRAIN_BLOCKS)}")
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: Lumina 2's transformer and Gemma have no convolution, so no "
                       "module takes it (as in sd-scripts' lora_lumina)", cfg.conv_dim)  # fmt: skip


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    return []


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    """The transformer blocks and the final layer, Gemma's attention / MLP under ``lora_te``; with
    ``embedder_dims``, the embedders by name."""
    names = tuple(pattern for _, pattern in EMBEDDERS) if args_of(cfg).embedder_dims is not None else ()
    te = {prefix: tuple(c) for prefix, c in classes.text_encoder.items()}
    return Preset(tuple(classes.transformer), names, unet_name_kind="linear", te_by_prefix=te)


def embedder_of(name: str) -> int | None:
    """The ``embedder_dims`` index of a kohya name (sd-scripts' substring filters), else None."""
    if not name.startswith("lora_unet_"):
        return None
    for i, (flt, _) in enumerate(EMBEDDERS):
        if flt in name:
            return i
    return None


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """``train_blocks``: keep those blocks (embedders and text encoders stay)."""
    kind = args_of(cfg).train_blocks or "all"
    if kind == "all":
        return list(targets)
    filters = BLOCK_FILTERS[kind]
    return [t for t in targets
            if not t.is_unet or embedder_of(t.name) is not None or any(f in t.name for f in filters)]  # fmt: skip


def block_counts(targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
    return {}


def block_masks(cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    return {}


def rank_for(cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
    """(rank, alpha, what set them) by sd-scripts' rules (module docstring)."""
    args = args_of(cfg)
    if not name.startswith("lora_unet"):
        return cfg.dim, cfg.alpha, "--network_dim"
    dim, arg = cfg.dim, "--network_dim"
    index = embedder_of(name)
    if index is not None and args.embedder_dims is not None:
        dim, arg = args.embedder_dims[index], f"embedder_dims[{index}]"
    for key, ident in TYPE_DIMS:
        value = getattr(args, key)
        if value is not None and ident in name:
            dim, arg = value, key
            break
    return dim, cfg.alpha, arg


def split_rows(cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
    """q, k, v rows of an ``attention.qkv`` target with ``split_qkv``, else None."""
    if not args_of(cfg).split_qkv or target.fused is None or "attention_qkv" not in target.name:
        return None
    return tuple(stop - start for _, start, stop, _ in target.module.segments)


def reg_lr_index(cfg: NetworkSettings, name: str) -> int | None:
    return None
