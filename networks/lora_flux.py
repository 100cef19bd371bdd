"""``--network_module networks.lora_flux``: sd-scripts' FLUX.1 / Chroma LoRA (``networks/lora_flux.py``) on our
adapter machinery: which modules get an adapter, at which rank, in which optimizer group, and ``split_qkv``.

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
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .targets import Preset, Target

if TYPE_CHECKING:
    from library.families.base import TargetClasses

    from .config import NetworkConfig
    from .layers import AdapterWeights

logger = logging.getLogger("networks.config")

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


# ---------------------------------------------------------------------------------------------------- parsing
def parse_rank_list(value: str, names: Sequence[str], negative: str = "ranks must not be negative") -> tuple[int, ...]:
    """``"[4,0,4]"`` (brackets optional) -> one rank per name; ``negative`` is the message for a rank below 0."""
    listed = ",".join(names)
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected {len(names)} comma-separated integers [{listed}]") from None
    if len(dims) != len(names):
        raise ValueError(f"{len(dims)} values given; {len(names)} are needed [{listed}]")
    if any(d < 0 for d in dims):
        raise ValueError(negative)
    return dims


def parse_in_dims(value: str) -> tuple[int, ...]:
    """``"[4,0,0,0,4]"`` (brackets optional) -> 5 ranks (img, time, vector, guidance, txt)."""
    return parse_rank_list(value, ("img", "time", "vector", "guidance", "txt"))


def check_block_selection(value: str) -> str:
    """Check the syntax of ``"all"``, ``"none"``, ``""`` or ``"0-5,10"`` (the range is checked against the model)."""
    text = value.strip()
    if text in ("all", "none", ""):
        return text
    for part in text.split(","):
        ends = [p.strip() for p in part.split("-")] if "-" in part else [part.strip()]
        if len(ends) > 2 or not all(e.isdigit() for e in ends):
            raise ValueError(f"{part!r}: expected all, none, or indices and ranges like 0-5,10")
        if len(ends) == 2 and int(ends[0]) > int(ends[1]):
            raise ValueError(f"invalid range {part.strip()}: start > end")
    return text


def parse_block_selection(value: str, total: int, key: str) -> tuple[bool, ...]:
    """sd-scripts' ``parse_block_selection``: one bool per block (``total`` blocks in this model). ``ValueError``
    naming ``key`` for an index outside ``0..total-1``."""
    text = check_block_selection(value)
    if text == "all":
        return (True,) * total
    selected = [False] * total
    if text in ("none", ""):
        return tuple(selected)
    for part in text.split(","):
        a, _, b = part.partition("-")
        start, end = int(a), int(b or a)
        if not (0 <= start < total and 0 <= end < total):
            raise ValueError(f"--network_args {key}={value}: index {end if 0 <= start < total else start} is outside "
                             f"this model's {total} blocks (0-{total - 1})")  # fmt: skip
        for i in range(start, end + 1):
            selected[i] = True
    return tuple(selected)


def parse_reg_pairs(value: str, number) -> tuple[tuple[str, float | int], ...]:
    """``"regex=value,regex2=value2"`` -> pairs in order (sd-scripts' ``parse_kv_pairs``; the regex is compiled, and
    an entry that is not ``regex=number`` is an error here where sd-scripts only warns)."""
    pairs = []
    for pair in value.split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, num = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{pair!r}: expected regex=value")
        try:
            re.compile(key.strip())
        except re.error as e:
            raise ValueError(f"{key.strip()!r} is not a regular expression ({e})") from None
        try:
            pairs.append((key.strip(), number(num.strip())))
        except ValueError:
            raise ValueError(
                f"{pair!r}: {num.strip()!r} is not {'an integer' if number is int else 'a number'}"
            ) from None
    return tuple(pairs)


def parse_reg_dims(value: str) -> tuple[tuple[str, int], ...]:
    return parse_reg_pairs(value, int)


def parse_reg_lrs(value: str) -> tuple[tuple[str, float], ...]:
    return parse_reg_pairs(value, float)


def refuse_ggpo(value: str) -> float:
    raise ValueError(
        "LoRA-GGPO is not supported: its perturbation needs per-module weight and gradient norms refreshed around "
        "every optimizer step (sd-scripts' update_norms / update_grad_norms hooks in its training loop), which our run "
        "layer does not call; drop ggpo_beta / ggpo_sigma"
    )


def parse_dim(value: str) -> int:
    """One module type's rank (``img_attn_dim=4``, ``context_attn_dim=4``): an integer >= 0, 0 skips the modules."""
    try:
        dim = int(value)
    except ValueError:
        raise ValueError("expected an integer rank (0 skips these modules)") from None
    if dim < 0:
        raise ValueError("must not be negative (0 skips these modules)")
    return dim


# key -> (parser, NetworkConfig field). The keys only networks.lora_flux reads (sd-scripts' create_network).
FLUX_ARGS: dict = {
    "train_blocks": (str.strip, "train_blocks"),
    **{key: (parse_dim, key) for key, _ in TYPE_DIMS},
    "in_dims": (parse_in_dims, "in_dims"),
    "train_double_block_indices": (check_block_selection, "train_double_block_indices"),
    "train_single_block_indices": (check_block_selection, "train_single_block_indices"),
    "split_qkv": (None, "split_qkv"),  # the bool parser is config's
    "train_t5xxl": (None, "train_t5xxl"),
    "verbose": (None, "verbose"),
    "network_reg_dims": (parse_reg_dims, "reg_dims"),
    "network_reg_lrs": (parse_reg_lrs, "reg_lrs"),
    "ggpo_beta": (refuse_ggpo, None),
    "ggpo_sigma": (refuse_ggpo, None),
}
ARGS = FLUX_ARGS  # the names networks.config reads every per-family module's rules by
DESCRIPTION = "sd-scripts' FLUX LoRA"
HINT = ("FLUX ranks are set by img_attn_dim / single_dim / in_dims / train_*_block_indices / network_reg_dims, other "
        "algorithms with --network_module lycoris.kohya algo=...")  # fmt: skip
# networks.lora_flux is sd-scripts' plain LoRA: these _COMMON keys of our networks.lora have no meaning there
NOT_FOR_FLUX = ("algo", "dora_wd", "wd_on_output", "use_tucker", "use_cp", "use_conv_cp", "disable_conv_cp",
                "use_scalar", "rs_lora", "train_norm", "factor", "decompose_both", "full_matrix",
                "unbalanced_factorization", "preset", "train_on_input", "block_size", "constraint", "rescaled",
                "rank_dropout_scale", "dropout")  # fmt: skip
NOT_READ = NOT_FOR_FLUX


def wants_conv(cfg: NetworkConfig) -> bool:
    """FLUX has no convolution to adapt."""
    return False


def validate(cfg: NetworkConfig, errors: list[str]) -> None:
    """The checks that need the whole config (called by ``NetworkConfig.from_args`` for networks.lora_flux)."""
    if cfg.train_blocks is not None and cfg.train_blocks not in TRAIN_BLOCKS:
        errors.append(f"--network_args train_blocks={cfg.train_blocks}: expected one of {', '.join(TRAIN_BLOCKS)}")
    conv_dim = cfg.conv_dim
    if conv_dim:
        logger.warning("--network_args conv_dim=%s: FLUX's transformer and text encoders have no convolution, so no "
                       "module takes it (as in sd-scripts' lora_flux)", conv_dim)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- targets
def preset(cfg: NetworkConfig, classes: TargetClasses) -> Preset:
    """The denoiser's transformer-block classes (+ the in-modules for ``in_dims``), CLIP-L's classes under
    ``lora_te1`` and, with ``train_t5xxl``, T5's under ``lora_te3``."""
    from library.families.flux.family import T5_TARGET_CLASSES

    te = {prefix: tuple(names) for prefix, names in classes.text_encoder.items() if prefix != "lora_te3"}
    te["lora_te3"] = T5_TARGET_CLASSES if cfg.train_t5xxl else ()
    names = tuple(pattern for _, pattern in IN_MODULES) if cfg.in_dims is not None else ()
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


def select(cfg: NetworkConfig, targets: Sequence[Target]) -> list[Target]:
    """``train_blocks``: keep the double or the single blocks (in-modules and text encoders stay)."""
    kind = cfg.train_blocks or "all"
    if kind == "all":
        return list(targets)
    return [t for t in targets if (b := block_of(t.name)) is None or b[0] == kind]


def block_counts(targets: Sequence[Target], denoiser=None) -> dict[str, int]:
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


def block_masks(cfg: NetworkConfig, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    """The parsed ``train_double/single_block_indices`` (``ValueError`` for an index outside the model)."""
    return {
        "double": None if cfg.train_double_block_indices is None else parse_block_selection(
            cfg.train_double_block_indices, counts["double"], "train_double_block_indices"),
        "single": None if cfg.train_single_block_indices is None else parse_block_selection(
            cfg.train_single_block_indices, counts["single"], "train_single_block_indices"),
    }  # fmt: skip


def rank_for(cfg: NetworkConfig, name: str, masks: dict) -> tuple[int, float, str]:
    """(rank, alpha, the argument that set them) of one module by sd-scripts' rules (see the module docstring);
    rank 0: no adapter."""
    for regex, dim in cfg.reg_dims:
        if re.search(regex, name):
            return dim, cfg.alpha, f"network_reg_dims {regex}"
    index = in_module(name)
    if index is not None:
        return cfg.in_dims[index], cfg.alpha, f"in_dims[{index}]"
    dim, arg = cfg.dim, "--network_dim"
    if name.startswith("lora_unet"):
        for key, ids in TYPE_DIMS:
            value = getattr(cfg, key)
            if value is not None and all(i in name for i in ids):
                dim, arg = value, key
                break
        block = block_of(name)
        if dim and block is not None and masks.get(block[0]) is not None and not masks[block[0]][block[1]]:
            dim, arg = 0, f"train_{block[0]}_block_indices"
    return dim, cfg.alpha, arg


# -------------------------------------------------------------------------------------------------- split_qkv
def split_rows(cfg: NetworkConfig, target: Target) -> tuple[int, ...] | None:
    """The rows of each part ``split_qkv`` gives its own LoRA (q, k, v[, mlp]), or None: double blocks' ``qkv`` and
    single blocks' ``linear1``, as sd-scripts splits them."""
    if not cfg.split_qkv or target.fused is None:
        return None
    block = block_of(target.name)
    if block is None or not ((block[0] == "double" and "qkv" in target.name) or
                             (block[0] == "single" and "linear1" in target.name)):  # fmt: skip
        return None
    base = target.module
    return tuple(stop - start for _, start, stop, _ in base.segments)


def split_spec(rank: int, alpha: float, parts: int) -> tuple[int, float]:
    """The (rank, alpha) of the block-diagonal LoRA of ``parts`` rank-``rank`` LoRAs: (k·r, k·α), the same scale."""
    return rank * parts, alpha * parts


def block_diagonal_mask(rows: Sequence[int], rank: int) -> Tensor:
    """(Σ rows, k·r) bool: part i's rows × its rank columns."""
    mask = torch.zeros(sum(rows), rank * len(rows), dtype=torch.bool)
    start = 0
    for i, n in enumerate(rows):
        mask[start : start + n, i * rank : (i + 1) * rank] = True
        start += n
    return mask


def make_split(adapter: AdapterWeights, rows: Sequence[int], rank: int) -> None:
    """Make a fresh rank-k·r LoRA the k separate LoRAs of ``split_qkv``: zero ``lora_up`` outside its diagonal
    blocks and mask its gradient there (so every optimizer, weight decay included, keeps them 0)."""
    up = adapter.params["lora_up"]
    blocks = []
    start = 0
    for i, n in enumerate(rows):
        blocks.append((slice(start, start + n), slice(i * rank, (i + 1) * rank)))
        start += n

    def keep_blocks(grad: Tensor) -> Tensor:
        out = torch.zeros_like(grad)
        for r, c in blocks:
            out[r, c] = grad[r, c]
        return out

    with torch.no_grad():
        up.copy_(keep_blocks(up))
    up.register_hook(keep_blocks)
    adapter.split_blocks = tuple(blocks)


def check_loaded_splits(network, source: str) -> list[str]:
    """After ``--network_weights`` into a ``split_qkv`` network: the split modules whose file ``lora_up`` is not
    block-diagonal (a plain rank-k·r LoRA, not a split file). Those values are kept (the file's ΔW, exactly) but
    their off-diagonal blocks get no gradient; sd-scripts would keep only the diagonal blocks. Warns once, naming
    them; returns their names."""
    odd = []
    for name, adapter in network.adapters.items():
        blocks = getattr(adapter, "split_blocks", None)
        if blocks is None:
            continue
        up = adapter.params["lora_up"].detach()
        mask = torch.ones_like(up, dtype=torch.bool)
        for r, c in blocks:
            mask[r, c] = False
        if up[mask].abs().sum() > 0:
            odd.append(name)
    if odd:
        logger.warning("%s: %d split_qkv module(s) hold a lora_up that is not block-diagonal (not a split_qkv file), "
                       "e.g. %s; loaded as they are (the file's ΔW), their off-diagonal blocks stay fixed while "
                       "training", source, len(odd), ", ".join(odd[:3]))  # fmt: skip
    return odd


# -------------------------------------------------------------------------------------------------- lr groups
def reg_lr_index(cfg, name: str) -> int | None:
    """The index of the first ``network_reg_lrs`` regex that ``re.search``-es ``name``, else None."""
    for i, (regex, _) in enumerate(getattr(cfg, "reg_lrs", ()) or ()):
        if re.search(regex, name):
            return i
    return None
