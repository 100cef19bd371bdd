"""Building adapter networks on a model: from flags, from a file, and baking files into base weights.

Build adapter networks on a model: from a :class:`NetworkConfig` (``inject``), from a file (``network_from_file``,
``--dim_from_weights``), and bake files into the base weights (``merge_files_into_base``, ``--base_weights``).

``roots`` come from the model family: ``family.adapter_roots(parts)``, :class:`~library.families.base.Root` tuples
``(prefix, module, rename, fused)`` (see ``networks.targets``); ``classes`` its ``target_classes``, which the built-in
presets are resolved through (None: the SD UNet families' classes).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError
from library.families import block_layout, block_layout_title
from library.families.adapters import split_spec
from library.families.base import TargetClasses
from library.families.blocks import BlockLayout

from . import files
from .algos import ALGOS, dora
from .algos import norm as norm_algo
from .config import NetworkConfig
from .fused import FusedAdapterLayer, FusedLeaf, check_loaded_splits, make_split
from .layers import AdapterLayer, AdapterWeights, DyLoRALayer, NormAdapterLayer, NormWeights, max_rank
from .network import AdapterNetwork, Slot
from .network_args import rules_for
from .targets import PRESETS, Preset, Root, Target, as_root, builtin_preset, default_classes, find_targets

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------- presets
def load_preset(cfg: NetworkConfig, classes: TargetClasses | None = None) -> Preset:
    """The target preset: ``preset=`` (a built-in name, resolved through the family's ``classes``, or a LyCORIS
    preset TOML), else the module's default (networks.lora: sd-scripts' targets, plus conv blocks with conv dims;
    lycoris.kohya: ``full``)."""
    classes = classes or default_classes()
    if cfg.module == "networks.oft":
        return oft_preset(cfg, classes)
    rules = rules_for(cfg.module)
    if rules is not None:
        return rules.preset(cfg, classes)
    if cfg.preset is None:
        if cfg.is_lycoris:
            return builtin_preset("full", classes)
        base = builtin_preset("kohya", classes)
        with_conv = bool(cfg.conv_dim) or cfg.conv_block_dims is not None
        return (
            replace(base, unet_classes=base.unet_classes + classes.conv_blocks, enable_conv=True) if with_conv else base
        )
    if cfg.preset in PRESETS:
        return builtin_preset(cfg.preset, classes)
    return _preset_from_toml(cfg.preset, classes)


def oft_preset(cfg: NetworkConfig, classes: TargetClasses | None = None) -> Preset:
    """sd-scripts' networks.oft targets (U-Net only): the attention projections (its ``CrossAttention``, diffusers'
    ``Attention``: the family's ``attention`` classes), or with ``enable_all_linear`` every Linear / 1x1 conv of the
    transformer blocks; ``enable_conv`` adds the ResNet and down/up-sampler blocks with their 3x3 convs."""
    classes = classes or default_classes()
    selected = classes.transformer if cfg.enable_all_linear else classes.attention
    if cfg.enable_conv:
        selected = selected + classes.conv_blocks
    return Preset(selected, (), (), (), enable_conv=cfg.enable_conv)


def _preset_from_toml(path: str, classes: TargetClasses) -> Preset:
    import toml

    data = toml.load(path)
    unsupported = [k for k in ("module_algo_map", "name_algo_map", "lora_prefix") if data.get(k)]
    if unsupported:
        raise ValueError(f"--network_args preset={path}: {', '.join(unsupported)} not supported yet")
    known = {"enable_conv", "unet_target_module", "unet_target_name", "text_encoder_target_module",
             "text_encoder_target_name", "exclude_name", "use_fnmatch", "module_algo_map", "name_algo_map"}  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--network_args preset={path}: unknown keys {unknown}; known: {sorted(known)}")
    full = builtin_preset("full", classes)

    def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(data[key]) if key in data else default

    return Preset(
        unet_classes=names("unet_target_module", full.unet_classes),
        unet_names=names("unet_target_name", full.unet_names),
        te_classes=names("text_encoder_target_module", full.te_classes),
        te_names=names("text_encoder_target_name", ()),
        enable_conv=bool(data.get("enable_conv", True)),
        exclude_names=names("exclude_name", ()),
        use_fnmatch=bool(data.get("use_fnmatch", False)),
    )


def active_roots(cfg: NetworkConfig | None, roots: Sequence[Root]) -> list[Root]:
    """The roots that get adapters: all, the UNet only or the text encoders only (``--network_train_*_only``)."""
    if cfg is None:
        return list(roots)
    return [
        r
        for r in (as_root(r) for r in roots)
        if not (cfg.train_unet_only and not r.prefix.startswith("lora_unet"))
        and not (cfg.train_text_encoder_only and r.prefix.startswith("lora_unet"))
    ]


# ---------------------------------------------------------------------------------------------- per-block ranks
def _lr_list(value, length: int, name: str) -> list[float]:
    if isinstance(value, str):
        kind, _, base = value.partition("+")
        offset = float(base) if base else 0.0
        steps = [i / (length - 1) for i in range(length)]
        curves = {
            "cosine": [math.sin(math.pi * s / 2) for s in reversed(steps)],
            "sine": [math.sin(math.pi * s / 2) for s in steps],
            "linear": steps,
            "reverse_linear": list(reversed(steps)),
            "zeros": [0.0] * length,
        }
        return [v + offset for v in curves[kind]]  # kind is one of LR_WEIGHT_PRESETS (checked by NetworkConfig)
    values = list(value)
    if len(values) != length:
        logger.warning("%s has %d values; %d are used (missing ones are 1.0)", name, len(values), length)
    return (values + [1.0] * length)[:length]


def block_lr_weights(cfg: NetworkConfig, layout: BlockLayout) -> list[float] | None:
    """One lr weight per UNet block from ``down/mid/up_lr_weight`` (sd-scripts' presets and padding rules)."""
    if cfg.down_lr_weight is None and cfg.mid_lr_weight is None and cfg.up_lr_weight is None:
        return None
    thr = cfg.block_lr_zero_threshold

    def part(value, length: int, name: str) -> list[float]:
        if value is None:
            return [1.0] * length
        return [w if w > thr else 0.0 for w in _lr_list(value, length, name)]

    return layout.lr_weights(
        part(cfg.down_lr_weight, layout.down, "down_lr_weight"),
        part(cfg.mid_lr_weight, layout.mid, "mid_lr_weight"),
        part(cfg.up_lr_weight, layout.up, "up_lr_weight"),
    )


def _block_tables(cfg: NetworkConfig, layout: BlockLayout, lr_weights, errors: list[str]) -> dict[str, list] | None:
    """sd-scripts' ``get_block_dims_and_alphas`` + ``remove_block_dims_and_alphas``: per-block (dim, alpha) lists."""
    if not cfg.uses_blocks:
        return None
    n = layout.num_blocks
    for name in ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas"):
        values = getattr(cfg, name)
        if values is not None and len(values) != n:
            errors.append(f"--network_args {name}: {len(values)} values given, this model's UNet has {n} blocks "
                          f"({block_layout_title(layout)} numbering)")  # fmt: skip
    if errors:
        return None
    conv_dim, conv_alpha = cfg.resolved_conv()
    tables = {
        "dims": list(cfg.block_dims or [cfg.dim] * n),
        "alphas": list(cfg.block_alphas or [cfg.alpha] * n),
        "conv_dims": list(cfg.conv_block_dims) if cfg.conv_block_dims else ([conv_dim] * n if conv_dim else None),
        "conv_alphas": list(cfg.conv_block_alphas or [conv_alpha if cfg.conv_dim else 1.0] * n),
    }
    for i, w in enumerate(lr_weights or []):
        if w == 0:
            tables["dims"][i] = 0
            if tables["conv_dims"] is not None:
                tables["conv_dims"][i] = 0
    return tables


def _rank_for(cfg: NetworkConfig, target: Target, tables, layout: BlockLayout) -> tuple[int, float, str]:
    """(rank, alpha, the argument that set them) for one target; rank 0 = no adapter."""
    if cfg.module == "networks.oft":  # one block count for every layer, 3x3 convs included (sd-scripts)
        return cfg.dim, cfg.alpha, "--network_dim"
    conv_dim, conv_alpha = cfg.resolved_conv()
    if target.kind == "linear":
        rank, alpha, arg = cfg.dim, cfg.alpha, "--network_dim"
    else:
        rank, alpha, arg = conv_dim, conv_alpha, "conv_dim"
    idx = layout.index(target.name) if target.is_unet else -1
    if tables is not None and idx >= 0:
        if target.kind == "linear":
            return tables["dims"][idx], tables["alphas"][idx], f"block_dims[{idx}]"
        if tables["conv_dims"] is None:
            return 0, 0.0, ""
        return tables["conv_dims"][idx], tables["conv_alphas"][idx], f"conv_block_dims[{idx}]"
    return rank, (alpha or float(rank)), arg


# ------------------------------------------------------------------------------------------------------ building
def new_adapter(
    cfg: NetworkConfig, weight: Tensor, rank: int, alpha: float, *, has_bias: bool = False
) -> AdapterWeights:
    """A fresh adapter of ``cfg.algo`` (+ DoRA) for a base ``weight`` (``has_bias``: the base layer has a bias, which
    algo=full trains too); ΔW = 0."""
    algo = ALGOS[cfg.algo]
    options = dict(
        use_tucker=cfg.use_tucker, use_scalar=cfg.use_scalar, factor=cfg.factor, decompose_both=cfg.decompose_both,
        full_matrix=cfg.full_matrix, unbalanced_factorization=cfg.unbalanced_factorization, rescaled=cfg.rescaled,
        block=cfg.dylora_block, train_on_input=cfg.train_on_input, has_bias=has_bias,
    )  # fmt: skip
    params = algo.init_params(tuple(weight.shape), rank, device=weight.device, dtype=torch.float32, **options)
    if algo.constraint_alpha:  # OFT: alpha is the constraint (no scale, no DoRA, no scalar: refused by the config)
        return AdapterWeights(algo, params, cfg.oft_alpha())
    if cfg.rs_lora:  # rank-stabilised: scale alpha/sqrt(r), stored as an ordinary alpha (LyCORIS does the same)
        alpha = alpha * math.sqrt(rank)
    if algo.rank(params) is None:  # LoKr with two full factors: scale 1; LyCORIS writes alpha = rank
        alpha = float(rank)
    magnitude = dora.init_magnitude(weight, "out" if cfg.wd_on_output else "in") if cfg.dora else None
    return AdapterWeights(algo, params, alpha, magnitude=magnitude, use_scalar=cfg.use_scalar)


def _wrap(cfg: NetworkConfig | None, target: Target, adapter) -> AdapterLayer | NormAdapterLayer:
    kw = {} if cfg is None else dict(module_dropout=cfg.module_dropout)
    if isinstance(adapter, NormWeights):
        return NormAdapterLayer(target.module, adapter, **kw)
    if cfg is not None:
        kw.update(dropout=cfg.dropout, rank_dropout=cfg.rank_dropout, rank_dropout_scale=cfg.rank_dropout_scale)
    if target.fused is not None:
        return FusedAdapterLayer(target.module, adapter, **kw)
    if adapter.algo.name == "dylora":
        return DyLoRALayer(target.module, adapter, style=cfg.dylora_style if cfg is not None else "kohya", **kw)
    return AdapterLayer(target.module, adapter, **kw)


def _install(roots: Sequence[Root], target: Target, layer: nn.Module) -> Slot:
    """Put ``layer`` in place of the target's module (a fused target: a :class:`FusedLeaf` in place of each leaf)."""
    root = roots[target.root][1]

    def place(path: str, module: nn.Module) -> tuple[nn.Module, str]:
        parent_path, _, attr = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        setattr(parent, attr, module)
        return parent, attr

    if target.fused is None:
        return Slot(layer, *place(target.path, layer), target)
    base = target.module
    leaves = tuple((*place(path, FusedLeaf(leaf, layer, j)), leaf) for j, (path, leaf) in
                   enumerate(zip(base.paths, base.leaves)))  # fmt: skip
    return Slot(layer, root, "", target, leaves)


def _note_ranks_above_width(wide: dict) -> None:
    """A rank above a layer's width is kept, as LyCORIS and sd-scripts do (their factors are simply wider than
    needed: the adapter is full-rank there); say so once per argument."""
    for (arg, rank), layers in wide.items():
        limit, name, shape = min(layers)
        logger.info(
            "%s %d is above the width of %d layer(s), e.g. %s (weight %s, full rank at %d); kept as LyCORIS does: "
            "those adapters can learn any change of their layer",
            arg,
            rank,
            len(layers),
            name,
            shape,
            limit,
        )


def _warn_empty_roots(roots: Sequence[Root], targets: Sequence[Target], preset: Preset) -> None:
    """A root where the preset selects nothing: most often a family whose ``target_classes`` were not passed (the SD
    UNet classes select nothing in a DiT)."""
    for index, root in enumerate(roots):
        if not any(t.root == index for t in targets):
            classes = preset.unet_classes if root.prefix.startswith("lora_unet") else preset.te_classes_of(root.prefix)
            if not classes:  # left out on purpose (FLUX's T5 without train_t5xxl, a preset without text encoders)
                continue
            logger.warning("%s (%s): no module is selected by the preset's classes %s; is it the family's "
                           "target_classes (inject / prepare_network take them)?", root.prefix,
                           type(root.module).__name__, ", ".join(classes) or "(none)")  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """One target of a plan: its (rank, alpha) (None: a norm adapter) and, for a ``split_qkv`` target, the rows of
    each part that gets its own LoRA (the family's ``AdapterRules.split_rows``)."""

    target: Target
    rank_alpha: tuple[int, float] | None
    split_rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class InjectionPlan:
    """What :func:`inject` builds: the roots that get adapters (``--network_train_*_only``), every target the preset
    and the module's rules select (model order; rank-0 ones included, for the verbose list), the targets to build
    (:class:`Planned`) and the per-block lr weights."""

    active: list[Root]
    targets: list[Target]
    planned: list[Planned]
    lr_weights: list[float] | None


def plan_targets(cfg: NetworkConfig, roots: Sequence[Root], classes: TargetClasses | None = None) -> InjectionPlan:
    """Which modules of ``roots`` get an adapter, at which rank and alpha, as ``cfg`` says: the preset's targets
    (``classes``: the family's ``target_classes``), a per-family module's rules (selection, block masks, ranks,
    split_qkv rows) or networks.lora's block dims. One ``ValueError`` listing every problem (block list lengths, block
    indices outside the model); a rank above a layer's width is kept (logged once), as LyCORIS does."""
    active = active_roots(cfg, [as_root(r) for r in roots])
    preset = load_preset(cfg, classes)
    conv_dim, _ = cfg.resolved_conv()
    rules = rules_for(cfg.module)
    conv = preset.enable_conv and (bool(conv_dim) or cfg.conv_block_dims is not None or cfg.module == "networks.oft"
                                   or (rules is not None and rules.wants_conv(cfg)))  # fmt: skip
    targets = find_targets(active, preset, conv=conv, train_norm=cfg.train_norm)
    errors: list[str] = []
    masks = None
    if rules is not None:
        targets = rules.select(cfg, targets)
        unet = next((r.module for r in active if r.prefix.startswith("lora_unet")), None)
        try:
            masks = rules.block_masks(cfg, rules.block_counts(targets, unet))
        except ValueError as e:
            errors.append(str(e))
    _warn_empty_roots(active, targets, preset)
    layout = block_layout([t.name for t in targets if t.is_unet])
    lr_weights = block_lr_weights(cfg, layout)
    tables = _block_tables(cfg, layout, lr_weights, errors)
    if errors:
        raise ConfigError(errors, "network for this model")
    planned, wide = [], {}
    for t in targets:
        if t.kind == "norm":
            planned.append(Planned(t, None))
            continue
        if rules is not None and masks is not None:
            rank, alpha, arg = rules.rank_for(cfg, t.name, masks)
            alpha = alpha or float(rank)
        else:
            rank, alpha, arg = _rank_for(cfg, t, tables, layout)
        shape = tuple(t.module.weight.shape)
        # LoKr switches to full factors by itself; an OFT dim is a block size / count, not a rank; full and (IA)³ have
        # no rank
        if rank and cfg.algo not in ("lokr", "diag-oft", "boft", "oft", "full", "ia3") and rank > max_rank(shape):
            wide.setdefault((arg, rank), []).append((max_rank(shape), t.name, shape))
        if rank:
            rows = rules.split_rows(cfg, t) if rules is not None and masks is not None else None
            planned.append(Planned(t, (rank, alpha), rows))
    _note_ranks_above_width(wide)
    return InjectionPlan(active, targets, planned, lr_weights)


def build_adapters(cfg: NetworkConfig, planned: Sequence[Planned]) -> list[tuple[Target, AdapterWeights | NormWeights]]:
    """A fresh adapter (ΔW = 0) of ``cfg``'s algorithm for every planned target: a norm adapter, or one at its rank
    (a ``split_qkv`` target: the block-diagonal LoRA of its parts). One ``ValueError`` naming the layers whose width
    the algorithm cannot take (networks.oft's block count, BOFT's power-of-two blocks)."""
    built, unsplit = [], {}
    for p in planned:
        t, weight = p.target, p.target.module.weight
        if p.rank_alpha is None:
            adapter = NormWeights(norm_algo.init_params(weight.shape[0], has_bias=t.module.bias is not None,
                                                        device=weight.device))  # fmt: skip
        else:
            rows = p.split_rows
            try:
                rank_alpha = p.rank_alpha if rows is None else split_spec(*p.rank_alpha, len(rows))
                adapter = new_adapter(cfg, weight, *rank_alpha, has_bias=t.module.bias is not None)
            except ValueError as e:
                unsplit.setdefault(str(e), []).append(f"{t.name} {tuple(weight.shape)}")
                continue
            if rows is not None:
                make_split(adapter, rows, p.rank_alpha[0])
        built.append((t, adapter))
    if unsplit:
        errors = [f"{len(where)} layer(s), e.g. {', '.join(where[:2])}: {why}" for why, where in unsplit.items()]
        raise ConfigError(errors, "network for this model", limit=5)
    return built


def inject(cfg: NetworkConfig, roots: Sequence[Root], classes: TargetClasses | None = None) -> AdapterNetwork:
    """Wrap every target module of ``roots`` with a fresh adapter as ``cfg`` says (:func:`plan_targets`, then
    :func:`build_adapters`); returns the network. ``classes``: the family's ``target_classes`` (None: the SD UNet
    families'). Raises one ``ValueError`` listing every problem."""
    roots = [as_root(r) for r in roots]
    plan = plan_targets(cfg, roots, classes)
    slots = [_install(plan.active, t, _wrap(cfg, t, adapter)) for t, adapter in build_adapters(cfg, plan.planned)]
    logger.info("adapters: %d text-encoder and %d UNet modules", sum(not s.target.is_unet for s in slots),
                sum(s.target.is_unet for s in slots))  # fmt: skip
    if cfg.module_args is not None and cfg.module_args.verbose:  # sd-scripts' per-family modules list every module
        for s in slots:
            logger.info("\t%-50s %s, %s", s.target.name, s.layer.adapter.rank, float(s.layer.adapter.alpha))
        built = {s.target.name for s in slots}
        skipped = [t.name for t in plan.targets if t.kind != "norm" and t.name not in built]
        if skipped:
            logger.warning("because dim (rank) is 0, %d modules are skipped: %s", len(skipped), ", ".join(skipped))
    return AdapterNetwork(slots, roots, cfg, plan.lr_weights)


def network_from_state_dict(
    state_dict: Mapping[str, Tensor], roots: Sequence[Root], cfg: NetworkConfig | None = None, source: str = "file"
) -> AdapterNetwork:
    """Rebuild a network (modules, algorithms, ranks, alphas, DoRA) from a kohya / LyCORIS state dict and inject it.

    Every module of the file must exist in the model (another family's file is a ``ValueError`` naming the
    prefixes); ``cfg`` (if given) supplies dropouts, LoRA+ ratios and ``--network_train_*_only``.
    """
    files.raise_if_peft(state_dict, source)
    roots = [as_root(r) for r in roots]
    active = active_roots(cfg, roots)
    index = files.module_index(active)
    all_index = files.module_index(roots)
    groups = files.group_by_module(state_dict)
    unknown = [n for n in groups if n not in all_index]
    if unknown or not groups:
        raise ValueError(files.explain_unmatched(unknown or ["(no modules)"], roots, source))
    errors, built = [], []
    for name, tensors in groups.items():
        target = index.get(name)
        if target is None:
            continue  # a part switched off by --network_train_*_only
        try:
            algo = files.algo_of(name, tensors, source)
            shape = tuple(target.module.weight.shape)
            tensors = files.fit_to_base(tensors, shape) if algo != "norm" else tensors
            files.check_shapes(name, algo, tensors, shape, source)
        except ValueError as e:
            errors.append(str(e))
            continue
        try:
            if algo == "norm":
                adapter = NormWeights({k: t.detach().clone().float().reshape(-1) for k, t in tensors.items()})
            elif cfg is not None and cfg.algo != algo and ALGOS[cfg.algo].file_format == algo:
                # DyLoRA / LoRA-FA training from a plain LoRA file (--dim_from_weights): build the network's algorithm
                adapter = AdapterWeights.from_file(tensors, cfg.algo, name, block=cfg.dylora_block)
            else:
                adapter = AdapterWeights.from_file(tensors, algo, name)
        except ValueError as e:
            errors.append(f"{source}: {e}")
            continue
        built.append((target, adapter))
    if errors:
        raise ConfigError(errors, "adapter file", limit=5)
    slots = [_install(active, t, _wrap(cfg, t, adapter.to(t.module.weight.device))) for t, adapter in built]
    layout = block_layout([t.name for t, _ in built if t.is_unet])
    block_lr = block_lr_weights(cfg, layout) if cfg is not None else None
    return AdapterNetwork(slots, roots, cfg, block_lr)


def network_from_file(path: str | os.PathLike, roots: Sequence[Root], cfg: NetworkConfig | None = None):
    """:func:`network_from_state_dict` for a file (safetensors or a safe pickle)."""
    from library.files.weights import load_state_dict

    state_dict, _ = load_state_dict(path)
    return network_from_state_dict(state_dict, roots, cfg, source=str(path))


def merge_files_into_base(paths: Sequence[str], multipliers: Sequence[float], roots: Sequence[Root]) -> None:
    """``--base_weights``: bake each adapter file (any algorithm) into the base weights with its multiplier
    (missing multipliers are 1.0, as in sd-scripts)."""
    for i, path in enumerate(paths):
        multiplier = multipliers[i] if i < len(multipliers) else 1.0
        network = network_from_file(path, roots)
        network.set_multiplier(multiplier)
        network.merge_into_base()
        logger.info("merged %s into the base model (multiplier %s)", path, multiplier)


def prepare_network(cfg: NetworkConfig, roots: Sequence[Root], classes: TargetClasses | None = None) -> AdapterNetwork:
    """What a training script does: merge ``--base_weights``, then build the network (from ``--network_weights``
    with ``--dim_from_weights``, else from the config and load ``--network_weights`` into it). ``classes``: the
    family's ``target_classes`` (None: the SD UNet families')."""
    if cfg.base_weights:
        merge_files_into_base(cfg.base_weights, cfg.base_weights_multiplier, roots)
    if cfg.dim_from_weights:
        return network_from_file(cfg.network_weights, roots, cfg)
    network = inject(cfg, roots, classes)
    if cfg.network_weights:
        network.load_file(cfg.network_weights, strict=False)
        if cfg.module_args is not None and cfg.module_args.split_qkv:
            check_loaded_splits(network, cfg.network_weights)
    return network
