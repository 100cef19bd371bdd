"""``--network_module networks.lora_flux``: sd-scripts' FLUX.1 / Chroma LoRA (``networks/lora_flux.py``) as rules for
our adapter machinery: which modules get an adapter, at which rank, in which optimizer group, and ``split_qkv``
(``ModelFamily.adapter_rules`` of the three FLUX families; see ``library.families.adapters.AdapterRules``).

The rules are sd-scripts' ``create_network`` / ``LoRANetwork.create_modules``, applied to kohya names on BFL keys
(``lora_unet_double_blocks_0_img_attn_qkv``; the family's ``adapter_roots`` give them):

* **Targets.** Every Linear inside the denoiser's transformer blocks (the family's ``TargetClasses.transformer``:
  diffusers' ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock``, sd-scripts' ``DoubleStreamBlock`` /
  ``SingleStreamBlock``): ``img_mod.lin``, ``img_attn.qkv``, ``img_attn.proj``, ``img_mlp.0``, ``img_mlp.2``, the
  same for ``txt_``, ``single_blocks.N.linear1``, ``linear2``, ``modulation.lin``. ``train_blocks=single|double``
  keeps one kind of block. CLIP-L's attention and MLP (``lora_te1_``); T5's attention and gated MLP (``lora_te3_``)
  only with ``train_t5xxl=True``. ``in_dims=[img,time,vector,guidance,txt]`` adds ``img_in``, ``time_in.*``,
  ``vector_in.*``, ``guidance_in.*``, ``txt_in`` (kohya names containing ``_img_in``, ``_time_in``...) at those ranks.
* **Ranks** (first rule that applies): ``network_reg_dims`` (the first regex that ``re.search``-es the kohya name,
  alpha ``--network_alpha``; it also applies to text encoders and in-modules, and wins over the rules below); an
  in-module's ``in_dims`` entry; a type dim (``img_attn_dim``, ``txt_attn_dim``, ``img_mlp_dim``, ``txt_mlp_dim``,
  ``img_mod_dim``, ``txt_mod_dim``, ``single_dim`` for ``single_blocks`` ``linear1`` / ``linear2``,
  ``single_mod_dim`` for ``modulation``: the first whose identifiers are all in the name); else ``--network_dim``.
  Then ``train_double_block_indices`` / ``train_single_block_indices`` ("all", "none", "0-5,10") set the rank of a
  block outside the selection to 0. Rank 0 skips the module.
* **Learning rates.** ``network_reg_lrs``: modules whose name a regex ``re.search``-es go to their own group
  (``<part> reg_lr_<i>``) at that lr, LoRA+ applying inside it; text encoders and the denoiser each get their own.
* **split_qkv.** ``img_attn.qkv`` / ``txt_attn.qkv`` (3 parts: q, k, v) and ``linear1`` (4 parts: q, k, v, mlp)
  get one LoRA of rank r per part. It is held (and saved, as sd-scripts saves it) as one LoRA of rank k·r over the
  fused weight: ``lora_down`` the parts' downs stacked, (k·r, in), ``lora_up`` block-diagonal, (Σ rows, k·r), whose
  off-diagonal blocks stay 0 (their gradient is masked). ΔW = α/r · blockdiag(up_i) @ stack(down_i) =
  ``cat_i(α/r · up_i @ down_i)``. The file's alpha is **k·α**, so any reader's scale alpha/rank = k·α / (k·r) = α/r
  is the trained one; sd-scripts writes α (a file that loads k× weaker than trained: 3× for qkv, 4× for linear1).
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
    first_match,
    parse_block_selection,
    parse_dim,
    parse_rank_list,
    parse_reg_dims,
    parse_reg_lrs,
    t5_cache_problems,
)
from .lora_formats import CONVERSION  # noqa: F401  (AdapterRules.CONVERSION: networks/convert_flux_lora.py)

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")  # the network flags' messages come from one logger

MODULE = "networks.lora_flux"
TRAIN_BLOCKS = ("all", "single", "double")
# sd-scripts' type_dims, in its order, with the identifiers that must all be in the kohya name
TYPE_DIMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("img_attn_dim", ("img_attn",)),
    ("txt_attn_dim", ("txt_attn",)),
    ("img_mlp_dim", ("img_mlp",)),
    ("txt_mlp_dim", ("txt_mlp",)),
    ("img_mod_dim", ("img_mod",)),
    ("txt_mod_dim", ("txt_mod",)),
    ("single_dim", ("single_blocks", "linear")),
    ("single_mod_dim", ("modulation",)),
)
# in_dims order: the kohya-name filter of each entry, and the BFL module path prefix that selects it
IN_MODULES: tuple[tuple[str, str], ...] = (
    ("_img_in", r"img_in$"),
    ("_time_in", r"time_in\."),
    ("_vector_in", r"vector_in\."),
    ("_guidance_in", r"guidance_in\."),
    ("_txt_in", r"txt_in$"),
)
_BLOCK = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_")


@dataclass(frozen=True)
class FluxLoraArgs(LoraModuleArgs):
    """The ``--network_args`` only networks.lora_flux reads (sd-scripts' ``create_network``); None: not given."""

    train_blocks: str | None = None  # all | single | double
    img_attn_dim: int | None = None
    txt_attn_dim: int | None = None
    img_mlp_dim: int | None = None
    txt_mlp_dim: int | None = None
    img_mod_dim: int | None = None
    txt_mod_dim: int | None = None
    single_dim: int | None = None
    single_mod_dim: int | None = None
    in_dims: tuple[int, ...] | None = None  # img, time, vector, guidance, txt
    train_double_block_indices: str | None = None
    train_single_block_indices: str | None = None
    train_t5xxl: bool = False
    reg_dims: tuple[tuple[str, int], ...] = ()  # (regex, rank) in order


Args = FluxLoraArgs


def parse_in_dims(value: str) -> tuple[int, ...]:
    """``"[4,0,0,0,4]"`` (brackets optional) -> 5 ranks (img, time, vector, guidance, txt)."""
    return parse_rank_list(value, ("img", "time", "vector", "guidance", "txt"))


def refuse_ggpo(value: str) -> float:
    raise ValueError(
        "LoRA-GGPO is not supported: its perturbation needs per-module weight and gradient norms refreshed around "
        "every optimizer step (sd-scripts' update_norms / update_grad_norms hooks in its training loop), which our run "
        "layer does not call; drop ggpo_beta / ggpo_sigma"
    )


# key -> (parser, FluxLoraArgs field). The keys only networks.lora_flux reads (sd-scripts' create_network).
ARGS: dict[str, ArgSpec] = {
    "train_blocks": (str.strip, "train_blocks"),
    **{key: (parse_dim, key) for key, _ in TYPE_DIMS},
    "in_dims": (parse_in_dims, "in_dims"),
    "train_double_block_indices": (check_block_selection, "train_double_block_indices"),
    "train_single_block_indices": (check_block_selection, "train_single_block_indices"),
    "split_qkv": (None, "split_qkv"),  # None: the shared true/false parser
    "train_t5xxl": (None, "train_t5xxl"),
    "verbose": (None, "verbose"),
    "network_reg_dims": (parse_reg_dims, "reg_dims"),
    "network_reg_lrs": (parse_reg_lrs, "reg_lrs"),
    "ggpo_beta": (refuse_ggpo, None),
    "ggpo_sigma": (refuse_ggpo, None),
}
DESCRIPTION = "sd-scripts' FLUX LoRA"
HINT = ("FLUX ranks are set by img_attn_dim / single_dim / in_dims / train_*_block_indices / network_reg_dims, other "
        "algorithms with --network_module lycoris.kohya algo=...")  # fmt: skip
# networks.lora_flux is sd-scripts' plain LoRA: these common keys of our networks.lora have no meaning there
NOT_READ = PLAIN_LORA_NOT_READ
IGNORED_ELSEWHERE = {"train_t5xxl": "LyCORIS 4.1.3 stores it but adapts no T5 module"}


def args_of(cfg: NetworkSettings) -> FluxLoraArgs:
    """The config's networks.lora_flux arguments (the defaults when it holds none)."""
    args = cfg.module_args
    return args if isinstance(args, FluxLoraArgs) else FluxLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    """FLUX has no convolution to adapt."""
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    """The checks that need the whole config (called by ``NetworkConfig.from_args`` for networks.lora_flux)."""
    args = args_of(cfg)
    if args.train_blocks is not None and args.train_blocks not in TRAIN_BLOCKS:
        errors.append(f"--network_args train_blocks={args.train_blocks}: expected one of {', '.join(TRAIN_BLOCKS)}")
    conv_dim = cfg.conv_dim
    if conv_dim:
        logger.warning("--network_args conv_dim=%s: FLUX's transformer and text encoders have no convolution, so no "
                       "module takes it (as in sd-scripts' lora_flux)", conv_dim)  # fmt: skip


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    """T5's adapters change its outputs, so they cannot be cached (sd-scripts refuses it too)."""
    return t5_cache_problems(args_of(cfg).train_t5xxl, cfg)


# ---------------------------------------------------------------------------------------------------- targets
def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    """The denoiser's transformer-block classes (+ the in-modules for ``in_dims``), CLIP-L's classes under
    ``lora_te1`` and, with ``train_t5xxl``, T5's under ``lora_te3``."""
    args = args_of(cfg)
    te = {prefix: tuple(names) for prefix, names in classes.text_encoder.items() if prefix != "lora_te3"}
    te["lora_te3"] = T5_TARGET_CLASSES if args.train_t5xxl else ()
    names = tuple(pattern for _, pattern in IN_MODULES) if args.in_dims is not None else ()
    return Preset(tuple(classes.transformer), names, unet_name_kind="linear", te_by_prefix=te)


def block_of(name: str) -> tuple[str, int] | None:
    """``("double" | "single", index)`` of a kohya name in a transformer block, else None."""
    m = _BLOCK.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def in_module(name: str) -> int | None:
    """The ``in_dims`` index of an in-module's kohya name (sd-scripts' substring filter), else None."""
    for i, (flt, _) in enumerate(IN_MODULES):
        if name.startswith("lora_unet") and flt in name:
            return i
    return None


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    """``train_blocks``: keep the double or the single blocks (in-modules and text encoders stay)."""
    kind = args_of(cfg).train_blocks or "all"
    if kind == "all":
        return list(targets)
    return [t for t in targets if (b := block_of(t.name)) is None or b[0] == kind]


def block_counts(targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
    """How many double / single blocks the model has (from the denoiser's block lists when given, else from the
    target names)."""
    if denoiser is not None and hasattr(denoiser, "transformer_blocks"):
        return {"double": len(denoiser.transformer_blocks), "single": len(denoiser.single_transformer_blocks)}
    counts = {"double": 0, "single": 0}
    for t in targets:
        b = block_of(t.name)
        if b is not None:
            counts[b[0]] = max(counts[b[0]], b[1] + 1)
    return counts


def block_masks(cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    """The parsed ``train_double/single_block_indices`` (``ValueError`` for an index outside the model)."""
    args = args_of(cfg)
    return {
        "double": None if args.train_double_block_indices is None else parse_block_selection(
            args.train_double_block_indices, counts["double"], "train_double_block_indices"),
        "single": None if args.train_single_block_indices is None else parse_block_selection(
            args.train_single_block_indices, counts["single"], "train_single_block_indices"),
    }  # fmt: skip


def rank_for(cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
    """(rank, alpha, the argument that set them) of one module by sd-scripts' rules (see the module docstring);
    rank 0: no adapter."""
    args = args_of(cfg)
    reg = first_match(args.reg_dims, name)
    if reg is not None:
        regex, dim = args.reg_dims[reg]
        return dim, cfg.alpha, f"network_reg_dims {regex}"
    index = in_module(name)
    if index is not None and args.in_dims is not None:
        return args.in_dims[index], cfg.alpha, f"in_dims[{index}]"
    dim, arg = cfg.dim, "--network_dim"
    if name.startswith("lora_unet"):
        for key, ids in TYPE_DIMS:
            value = getattr(args, key)
            if value is not None and all(i in name for i in ids):
                dim, arg = value, key
                break
        block = block_of(name)
        if dim and block is not None and masks.get(block[0]) is not None and not masks[block[0]][block[1]]:
            dim, arg = 0, f"train_{block[0]}_block_indices"
    return dim, cfg.alpha, arg


# -------------------------------------------------------------------------------------------------- split_qkv
def split_rows(cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
    """The rows of each part ``split_qkv`` gives its own LoRA (q, k, v[, mlp]), or None: double blocks' ``qkv`` and
    single blocks' ``linear1``, as sd-scripts splits them."""
    if not args_of(cfg).split_qkv or target.fused is None:
        return None
    block = block_of(target.name)
    if block is None or not ((block[0] == "double" and "qkv" in target.name) or
                             (block[0] == "single" and "linear1" in target.name)):  # fmt: skip
        return None
    return tuple(stop - start for _, start, stop, _ in target.module.segments)


def reg_lr_index(cfg: NetworkSettings, name: str) -> int | None:
    """The index of the first ``network_reg_lrs`` regex that ``re.search``-es ``name``, else None."""
    return first_match(args_of(cfg).reg_lrs, name)
