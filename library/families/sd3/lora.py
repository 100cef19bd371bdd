"""``--network_module networks.lora_sd3``: sd-scripts' SD3 / SD3.5 LoRA (``networks/lora_sd3.py``) as rules for our
adapter machinery: which modules get an adapter, at which rank, and ``split_qkv`` (``ModelFamily.adapter_rules`` of
the three SD3 families; see ``library.families.adapters.AdapterRules``).

The rules are sd-scripts' ``create_network`` / ``LoRANetwork.create_modules``, applied to kohya names on SAI keys
(``lora_unet_joint_blocks_0_x_block_attn_qkv``; the family's ``adapter_roots`` give them):

* **Targets.** Every Linear inside the joint blocks (the family's ``TargetClasses.transformer``: diffusers'
  ``JointTransformerBlock``, sd-scripts' ``SingleDiTBlock``): per block, for ``x_block`` and ``context_block``,
  ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``, ``adaLN_modulation.1``, and SD3.5-medium's ``x_block.attn2.*``
  (the last ``context_block`` of SD3 / 3.5 is pre-only: ``attn.qkv`` and ``adaLN_modulation.1``). CLIP-L
  (``lora_te1_``) and CLIP-G (``lora_te2_``) attention and MLP; T5-XXL's attention and gated MLP (``lora_te3_``) only
  with ``train_t5xxl=True``. ``emb_dims=[context, t, x, y, final_mod, final_linear]`` adds ``context_embedder``,
  ``t_embedder.mlp.*``, ``x_embedder.proj`` (the 2x2 patch convolution), ``y_embedder.mlp.*``,
  ``final_layer.adaLN_modulation.1``, ``final_layer.linear`` at those ranks (kohya names containing
  ``context_embedder``, ``_t_embedder``, ``x_embedder``, ``y_embedder``, ``final_layer_adaLN_modulation``,
  ``final_layer_linear``, sd-scripts' filters).
* **Ranks.** An embedder's ``emb_dims`` entry (``x_embedder``: ``conv_dim`` / ``conv_alpha`` (default 1.0) when
  ``conv_dim`` is given, as sd-scripts' conv rule comes first); else, in a joint block, the first type dim whose
  identifiers are all in the kohya name: ``context_attn_dim`` (``context_block`` + ``attn``), ``context_mlp_dim``,
  ``context_mod_dim`` (``adaLN_modulation``), ``x_attn_dim`` (``x_attn_dim`` also takes ``attn2``), ``x_mlp_dim``,
  ``x_mod_dim``; else ``--network_dim``. Then ``train_block_indices`` ("all", "none", "0-5,10") sets the rank of a
  joint block outside the selection to 0. Rank 0 skips the module. Alpha is ``--network_alpha`` everywhere (text
  encoders take ``--network_dim`` / ``--network_alpha``). ``conv_dim`` selects nothing else: SD3 has no other
  convolution.
* **split_qkv.** Every joint block's ``qkv`` (``attn`` and ``attn2`` of both streams: 3 equal parts q, k, v) gets one
  LoRA of rank r per part, held and saved as one LoRA of rank 3r with a block-diagonal ``lora_up`` (as
  ``networks.lora_flux``). The file's alpha is **3α**, so a reader's scale alpha/rank = α/r is the trained one;
  sd-scripts writes α (its split files load 3x weaker than trained).
* sd-scripts' other arguments: ``rank_dropout``, ``module_dropout``, ``loraplus_*``, ``verbose`` work as in
  ``networks.lora_flux``; anything else is an error naming the key.
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
    T5_TARGET_CLASSES,
    ArgSpec,
    LoraModuleArgs,
    NetworkSettings,
    Preset,
    Target,
    check_block_selection,
    parse_block_selection,
    parse_dim,
    parse_rank_list,
    t5_cache_problems,
)
from .lora_formats import CONVERSION  # noqa: F401  (AdapterRules.CONVERSION: networks/convert_sd3_lora.py)

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")  # the network flags' messages come from one logger

MODULE = "networks.lora_sd3"
# sd-scripts' type_dims, in its order, with the identifiers that must all be in the kohya name
TYPE_DIMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("context_attn_dim", ("context_block", "attn")),
    ("context_mlp_dim", ("context_block", "mlp")),
    ("context_mod_dim", ("context_block", "adaLN_modulation")),
    ("x_attn_dim", ("x_block", "attn")),
    ("x_mlp_dim", ("x_block", "mlp")),
    ("x_mod_dim", ("x_block", "adaLN_modulation")),
)
# emb_dims order: sd-scripts' kohya-name filter of each entry, and the SAI module path pattern that selects it
EMB_MODULES: tuple[tuple[str, str], ...] = (
    ("context_embedder", r"context_embedder$"),
    ("_t_embedder", r"t_embedder\."),
    ("x_embedder", r"x_embedder\."),
    ("y_embedder", r"y_embedder\."),
    ("final_layer_adaLN_modulation", r"final_layer\.adaLN_modulation\."),
    ("final_layer_linear", r"final_layer\.linear$"),
)
EMB_NAMES = ("context", "t", "x", "y", "final_mod", "final_linear")
X_EMBEDDER = 2
_BLOCK = re.compile(r"lora_unet_joint_blocks_(\d+)_")


@dataclass(frozen=True)
class SD3LoraArgs(LoraModuleArgs):
    """The ``--network_args`` only networks.lora_sd3 reads (sd-scripts' ``create_network``); None: not given."""

    context_attn_dim: int | None = None
    context_mlp_dim: int | None = None
    context_mod_dim: int | None = None
    x_attn_dim: int | None = None
    x_mlp_dim: int | None = None
    x_mod_dim: int | None = None
    emb_dims: tuple[int, ...] | None = None  # context, t, x, y, final_mod, final_linear
    train_block_indices: str | None = None
    train_t5xxl: bool = False


Args = SD3LoraArgs


def parse_emb_dims(value: str) -> tuple[int, ...]:
    """``"[4,0,0,0,4,4]"`` (brackets optional) -> 6 ranks (context, t, x, y, final_mod, final_linear)."""
    return parse_rank_list(value, EMB_NAMES, "ranks must not be negative (0 skips that embedder)")


# key -> (parser, SD3LoraArgs field). The keys only networks.lora_sd3 reads (sd-scripts' create_network); the common
# ones (conv_dim, rank_dropout, loraplus_*...) are networks.config's.
ARGS: dict[str, ArgSpec] = {
    **{key: (parse_dim, key) for key, _ in TYPE_DIMS},
    "emb_dims": (parse_emb_dims, "emb_dims"),
    "train_block_indices": (check_block_selection, "train_block_indices"),
    "split_qkv": (None, "split_qkv"),  # None: the shared true/false parser
    "train_t5xxl": (None, "train_t5xxl"),
    "verbose": (None, "verbose"),
}
# the common keys of networks.lora that sd-scripts' lora_sd3 does not read (its plain LoRA)
NOT_READ = PLAIN_LORA_NOT_READ
HINT = ("SD3 ranks are set by context_attn_dim / x_attn_dim ... / emb_dims / train_block_indices, other algorithms "
        "with --network_module lycoris.kohya algo=...")  # fmt: skip
DESCRIPTION = "sd-scripts' SD3 LoRA"
IGNORED_ELSEWHERE = {"train_t5xxl": "LyCORIS 4.1.3 stores it but adapts no T5 module"}


def args_of(cfg: NetworkSettings) -> SD3LoraArgs:
    """The config's networks.lora_sd3 arguments (the defaults when it holds none)."""
    args = cfg.module_args
    return args if isinstance(args, SD3LoraArgs) else SD3LoraArgs()


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    """The checks that need the whole config (called by ``NetworkConfig.from_args`` for networks.lora_sd3)."""
    if cfg.conv_dim and args_of(cfg).emb_dims is None:
        logger.warning("--network_args conv_dim=%s: SD3's only convolution is x_embedder.proj, which only emb_dims "
                       "adds (as in sd-scripts' lora_sd3), so no module takes it", cfg.conv_dim)  # fmt: skip


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    """T5's adapters change its outputs, so they cannot be cached (sd-scripts refuses it too)."""
    return t5_cache_problems(args_of(cfg).train_t5xxl, cfg)


# ---------------------------------------------------------------------------------------------------- targets
def wants_conv(cfg: NetworkSettings) -> bool:
    """k > 1 convolutions are targets: x_embedder.proj, with emb_dims."""
    return args_of(cfg).emb_dims is not None


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    """The denoiser's joint-block classes (+ the embedders for ``emb_dims``), CLIP-L's and CLIP-G's classes under
    ``lora_te1`` / ``lora_te2`` and, with ``train_t5xxl``, T5's under ``lora_te3``."""
    te = {prefix: tuple(names) for prefix, names in classes.text_encoder.items() if prefix != "lora_te3"}
    te["lora_te3"] = T5_TARGET_CLASSES if args_of(cfg).train_t5xxl else ()
    emb = wants_conv(cfg)
    names = tuple(pattern for _, pattern in EMB_MODULES) if emb else ()
    return Preset(tuple(classes.transformer), names, enable_conv=emb, te_by_prefix=te)


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """All targets (sd-scripts' lora_sd3 has no ``train_blocks``)."""
    return list(targets)


def block_of(name: str) -> int | None:
    """The joint-block index of a kohya name, else None."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def emb_module(name: str) -> int | None:
    """The ``emb_dims`` index of an embedder's kohya name (sd-scripts' substring filters), else None."""
    if not name.startswith("lora_unet") or block_of(name) is not None:
        return None
    for i, (flt, _) in enumerate(EMB_MODULES):
        if flt in name:
            return i
    return None


def block_counts(targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
    """How many joint blocks the model has (the denoiser's ``transformer_blocks`` when given, else the names)."""
    if denoiser is not None and hasattr(denoiser, "transformer_blocks"):
        return {"joint": len(denoiser.transformer_blocks)}
    found = [b for t in targets if (b := block_of(t.name)) is not None]
    return {"joint": max(found) + 1 if found else 0}


def block_masks(cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    """The parsed ``train_block_indices`` (``ValueError`` for an index outside the model, where sd-scripts parses
    against 999 blocks and silently trains none of the missing ones)."""
    value = args_of(cfg).train_block_indices
    if value is None:
        return {"joint": None}
    return {"joint": parse_block_selection(value, counts["joint"], "train_block_indices")}


def rank_for(cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
    """(rank, alpha, the argument that set them) of one module by sd-scripts' rules (see the module docstring);
    rank 0: no adapter."""
    args = args_of(cfg)
    index = emb_module(name)
    if index is not None and args.emb_dims is not None:  # the embedders are targets only with emb_dims (see preset)
        if index == X_EMBEDDER and cfg.conv_dim is not None:
            return cfg.conv_dim, 1.0 if cfg.conv_alpha is None else cfg.conv_alpha, "conv_dim"
        return args.emb_dims[index], cfg.alpha, f"emb_dims[{index}] ({EMB_NAMES[index]})"
    dim, which = cfg.dim, "--network_dim"
    block = block_of(name)
    if block is not None:
        for key, ids in TYPE_DIMS:
            value = getattr(args, key)
            if value is not None and all(i in name for i in ids):
                dim, which = value, key
                break
        mask = masks.get("joint")
        if dim and mask is not None and not mask[block]:
            dim, which = 0, "train_block_indices"
    return dim, cfg.alpha, which


# -------------------------------------------------------------------------------------------------- split_qkv
def split_rows(cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
    """The rows of q, k, v that ``split_qkv`` gives their own LoRA, or None: every joint block's fused ``qkv``."""
    if not args_of(cfg).split_qkv or target.fused is None or block_of(target.name) is None:
        return None
    if not target.name.endswith("qkv"):
        return None
    return tuple(stop - start for _, start, stop, _ in target.module.segments)
