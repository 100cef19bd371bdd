"""Fused adapter targets: one adapter over several Linear leaves that take the same input.

FLUX / SD3 files name one kohya module over several diffusers Linears (``Root.fused``, see
``library.families.base.Fused``): ``double_blocks.0.img_attn.qkv`` = ``to_q | to_k | to_v``,
``single_blocks.0.linear1`` = ``to_q | to_k | to_v | proj_mlp``, ``final_layer.adaLN_modulation.1`` =
``norm_out.linear`` with its two halves swapped. The design follows OneTrainer's ``FusedModule``:

* :class:`FusedBase` is the synthetic Linear the file's layout has: its weight W is the segments' rows stacked,
  (Σ rows, in), built when asked (``weight``), never stored; the leaves stay where they are in the model.
* :class:`FusedAdapterLayer` is an :class:`~networks.layers.AdapterLayer` over that base: one adapter whose ΔW is
  over the stacked W (DoRA's norm, LoKr's Kronecker product, OFT's rotation and every ``needs_base`` algorithm see
  the stacked weight), so every algorithm is exact; it is not installed in the model itself.
* Each leaf is replaced by a :class:`FusedLeaf` that runs the leaf and adds its rows of the adapter's output:

      y_leaf = leaf(x) + m · Δ(x)[rows of the leaf]

  The leaves of one module take the same input tensor (diffusers calls ``to_q``, ``to_k``, ``to_v`` on one
  ``hidden_states``), so what they share is computed by the first leaf and taken by the others (cached on the input
  tensor's identity, dropped once every leaf has taken it; a leaf given another tensor computes its own, which is
  still exact, only slower): LoRA (and LoRA-FA; no DoRA) the rank-r activation ``h = x @ downᵀ`` (with its dropouts),
  each leaf then ``h @ (α/r · up[rows])ᵀ``, so ΔW is never built and the down-projection runs once; every other
  algorithm (LoHa, LoKr, DoRA, full, (IA)³, GLoRA, OFT / BOFT) builds the fused ΔW (from the stacked W where it
  needs it) **once per forward of the module** and each leaf applies its rows: the cost of one module of the fused
  shape, plus building the stacked W (a copy of the leaves' rows) for DoRA and ``needs_base`` algorithms.
* Dropouts therefore act as on the file's fused Linear: ``network_dropout`` on h and LoRA's ``rank_dropout`` mask are
  drawn once for all leaves, ``module_dropout`` skips the whole module; ΔW-row rank dropout draws one row mask.
  DyLoRA training is refused (a DyLoRA *file* is a plain LoRA file and loads as one).
* Merge writes ΔW's rows into each leaf's weight (``unmerge`` restores them exactly); extract diffs stacked weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from library.device.fp8 import compute_weight
from library.families.base import Fused

from .layers import AdapterLayer, AdapterWeights

_config_log = logging.getLogger("networks.config")  # the network flags' messages come from one logger


class FusedBase(nn.Module):
    """The stacked weight of a fused module: ``weight`` = cat(leaf.weight[start:stop] for each segment), (Σ rows,
    in), in the leaves' compute dtype (float8 storage cast as the leaf's forward would), built on each access.

    ``leaves``: the distinct Linear leaves (not registered as submodules: they belong to the model); ``paths`` their
    module paths in the root; ``segments``: (leaf index, start, stop, fused row offset) in fused order;
    ``leaf_pieces[j]``: the fused row ranges that make leaf j's rows, in the leaf's row order."""

    is_fused = True

    def __init__(self, name: str, leaves: Sequence[nn.Linear], paths: Sequence[str], segments) -> None:
        super().__init__()
        self.name = name
        self._leaves = list(leaves)
        self.paths = tuple(paths)
        self.segments = tuple(segments)
        self.in_features = leaves[0].in_features
        self.out_features = sum(stop - start for _, start, stop, _ in self.segments)
        self.leaf_pieces: list[list[slice]] = []
        for j in range(len(self._leaves)):
            mine = sorted((start, off, stop - start) for k, start, stop, off in self.segments if k == j)
            self.leaf_pieces.append([slice(off, off + n) for _, off, n in mine])

    @property
    def leaves(self) -> list[nn.Linear]:
        return self._leaves

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def weight(self) -> Tensor:
        return torch.cat([compute_weight(self._leaves[j])[a:b] for j, a, b, _ in self.segments])

    @property
    def bias(self) -> Tensor | None:
        """The stacked bias, or None unless every leaf has one."""
        if any(leaf.bias is None for leaf in self._leaves):
            return None
        return torch.cat([self._leaves[j].bias[a:b] for j, a, b, _ in self.segments])

    def rows_of(self, j: int, t: Tensor) -> Tensor:
        """Leaf j's rows (in the leaf's order) of a tensor over the fused rows (first axis)."""
        pieces = self.leaf_pieces[j]
        return t[pieces[0]] if len(pieces) == 1 else torch.cat([t[p] for p in pieces])

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.name}: {' | '.join(self.paths)} -> ({self.out_features}, {self.in_features})"


def build_fused(prefix: str, root: nn.Module, entry: Fused) -> FusedBase:
    """The :class:`FusedBase` of one ``Root.fused`` entry. ``ValueError`` naming the root and module when a segment's
    path is not a Linear of ``root``, its rows are out of range, the leaves' input widths differ, or a leaf's rows are
    not covered exactly once by the segments."""
    where = f"{prefix}: fused module {entry.name}"
    if not entry.segments:
        raise ValueError(f"{where} has no segments")
    leaves: list[nn.Linear] = []
    paths: list[str] = []
    segments = []
    offset = 0
    for seg in entry.segments:
        try:
            module = root.get_submodule(seg.path)
        except AttributeError:
            raise ValueError(f"{where}: segment {seg.path!r} is not a module of the model") from None
        module = getattr(module, "base_layer", module) if isinstance(module, FusedLeaf | AdapterLayer) else module
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{where}: segment {seg.path!r} is a {type(module).__name__}; fused modules are made of "
                             "Linear leaves")  # fmt: skip
        out = module.out_features
        stop = out if seg.stop is None else seg.stop
        if not 0 <= seg.start < stop <= out:
            raise ValueError(f"{where}: segment {seg.path!r} rows [{seg.start}:{seg.stop}] are outside its {out} rows")
        if seg.path not in paths:
            paths.append(seg.path)
            leaves.append(module)
        segments.append((paths.index(seg.path), seg.start, stop, offset))
        offset += stop - seg.start
    widths = {leaf.in_features for leaf in leaves}
    if len(widths) > 1:
        raise ValueError(f"{where}: its leaves take inputs of different widths {sorted(widths)} "
                         f"({', '.join(paths)}); fused leaves share one input")  # fmt: skip
    for j, leaf in enumerate(leaves):
        covered = sorted((a, b) for k, a, b, _ in segments if k == j)
        ends = [0] + [b for _, b in covered]
        if [a for a, _ in covered] != ends[:-1] or ends[-1] != leaf.out_features:
            raise ValueError(f"{where}: the segments of {paths[j]} cover rows {covered} of its {leaf.out_features}; "
                             "each row of a leaf must be in exactly one segment")  # fmt: skip
    return FusedBase(entry.name, leaves, paths, segments)


class FusedAdapterLayer(AdapterLayer):
    """One adapter over a :class:`FusedBase` (see the module docstring). Not part of the model: its
    :class:`FusedLeaf` wrappers call :meth:`leaf_delta`. ``delta()`` / ``algo_delta()`` are over the stacked weight."""

    def __init__(self, base_layer: FusedBase, adapter: AdapterWeights, **kwargs) -> None:
        if adapter.algo.name == "dylora":
            raise ValueError(f"{base_layer.name}: DyLoRA is not supported on a fused module (its leaves "
                             f"{', '.join(base_layer.paths)} would train different rank blocks in one step); use "
                             "algo=lora, or train DyLoRA on a model without fused modules")  # fmt: skip
        super().__init__(base_layer, adapter, **kwargs)
        self._leaf_backups: list[tuple[Tensor, Tensor | None]] | None = None
        self._cache: list | None = None  # [input, (grad mode, training), leaves still to take it, shared value]

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return self.base_layer.shape

    def forward(self, x: Tensor) -> Tensor:
        """The fused module's output ``W x + b + m·Δ(x)`` (what the file's layout computes; for tests and tools)."""
        out = self.base_layer(x)
        deltas = [self.leaf_delta(j, x, self.training) for j in range(len(self.base_layer.leaves))]
        if any(d is None for d in deltas):
            return out
        full = torch.empty_like(out)
        for j, d in enumerate(deltas):
            start = 0
            for piece in self.base_layer.leaf_pieces[j]:
                n = piece.stop - piece.start
                full[..., piece] = d[..., start : start + n].to(out.dtype)
                start += n
        return out + full

    def _shared(self, x: Tensor, training: bool):
        """What the leaves of one call share, computed by the first leaf that sees ``x`` and reused by the others
        (they take the same input tensor): None (module dropout skips the module), ``("lora", h)`` (the rank-r
        activation after dropouts, rank-dropout rescaling included) or ``("dense", ΔW, rank-dropout row mask)``.
        Dropped once every leaf has taken it; a leaf given another tensor computes its own (still exact)."""
        key = (torch.is_grad_enabled(), training)
        cache = self._cache
        if cache is not None and cache[0] is x and cache[1] == key:
            cache[2] -= 1
            if cache[2] <= 0:
                self._cache = None
            return cache[3]
        value = self._compute_shared(x, training)
        others = len(self.base_layer.leaves) - 1
        self._cache = [x, key, others, value] if others > 0 else None
        return value

    def _compute_shared(self, x: Tensor, training: bool):
        if training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return None
        adapter = self.adapter
        if adapter.algo.project_down is not None and adapter.magnitude is None and adapter.factors() is not None:
            down = adapter.factors()[1]
            h = F.linear(x, down if down.dtype == x.dtype else down.to(x.dtype))
            if training and self.dropout:
                h = F.dropout(h, p=self.dropout)
            if training and self.rank_dropout:
                mask = (torch.rand((h.shape[0], h.shape[-1]), device=h.device) > self.rank_dropout).to(h.dtype)
                h = h * mask.reshape(h.shape[0], *([1] * (h.dim() - 2)), -1) / (1.0 - self.rank_dropout)
            return ("lora", h)
        return ("dense", *self._train_delta(training))

    def leaf_delta(self, j: int, x: Tensor, training: bool) -> Tensor | None:
        """m·Δ(x) for leaf j's rows (None: nothing to add: merged, off, or skipped by module dropout). ``training``:
        whether dropouts act (the leaf's and this layer's training flags: ``model.eval()`` or
        ``network.set_training(False)`` switch them off)."""
        if self._backup is not None or self.multiplier == 0:
            return None
        shared = self._shared(x, training)
        if shared is None:
            return None
        adapter, base = self.adapter, self.base_layer
        if shared[0] == "lora":
            h = shared[1]
            rows = base.rows_of(j, adapter.factors()[0])  # scale · up (use_scalar folded in), this leaf's rows
            out = F.linear(h, rows if rows.dtype == h.dtype else rows.to(h.dtype))
            return out if self.multiplier == 1.0 else out * self.multiplier
        _, weight, keep = shared
        delta = F.linear(x, base.rows_of(j, weight).to(x.dtype))
        bias = adapter.delta_bias()
        if bias is not None:
            bias = bias if keep is None else bias * keep
            delta = delta + base.rows_of(j, bias).to(delta.dtype)
        if training and self.dropout:
            delta = F.dropout(delta, p=self.dropout)
        return delta if adapter.algo.multiplier_inside else delta * self.multiplier

    @torch.no_grad()
    def merge(self, keep_backup: bool = True) -> None:
        """Add ΔW's rows (at the current multiplier) into each leaf's weight (and bias); ``unmerge()`` restores."""
        if self.merged:
            return
        base = self.base_layer
        delta, delta_b = self.delta(), self.delta_bias()
        if delta_b is not None and base.bias is None:
            raise ValueError(f"{base.name}: the adapter changes a bias its leaves do not all have")
        if keep_backup:  # the stacked W for ΔW while merged, each leaf's stored tensors for unmerge
            stacked = base.weight.detach().clone()
            backups = [(leaf.weight.detach().clone(), None if leaf.bias is None else leaf.bias.detach().clone())
                       for leaf in base.leaves]  # fmt: skip
        for j, a, b, off in base.segments:
            w = base.leaves[j].weight
            rows = delta[off : off + b - a]
            w[a:b] = (w[a:b].float() + rows.float()).to(w.dtype)
            if delta_b is not None:
                bias = base.leaves[j].bias
                bias[a:b] = (bias[a:b].float() + delta_b[off : off + b - a].float()).to(bias.dtype)
        if keep_backup:
            self._backup, self._leaf_backups = stacked, backups

    @torch.no_grad()
    def unmerge(self) -> None:
        if self._backup is None:
            return
        for leaf, (weight, bias) in zip(self.base_layer.leaves, self._leaf_backups):
            leaf.weight.copy_(weight)
            if bias is not None:
                leaf.bias.copy_(bias)
        self._backup, self._leaf_backups = None, None


class FusedLeaf(nn.Module):
    """Stands in the model for leaf ``index`` of a fused module: ``base_layer(x)`` plus its rows of the shared
    adapter's output. The :class:`FusedAdapterLayer` is held, not registered (it is shared by the leaves; its
    adapter belongs to the :class:`~networks.network.AdapterNetwork`)."""

    def __init__(self, base_layer: nn.Linear, fused: FusedAdapterLayer, index: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self._fused = (fused,)
        self.index = index

    @property
    def fused(self) -> FusedAdapterLayer:
        return self._fused[0]

    @property
    def adapter(self) -> AdapterWeights:
        return self._fused[0].adapter

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        fused = self._fused[0]
        delta = fused.leaf_delta(self.index, x, self.training and fused.training)
        return out if delta is None else out + (delta if delta.dtype == out.dtype else delta.to(out.dtype))

    def extra_repr(self) -> str:
        return f"leaf {self.index} of {self._fused[0].base_layer.name}"


def adapter_layer(base: nn.Module, adapter: AdapterWeights, **kwargs) -> AdapterLayer:
    """The adapter layer for a base module: :class:`FusedAdapterLayer` for a :class:`FusedBase`, else
    :class:`AdapterLayer`."""
    cls = FusedAdapterLayer if isinstance(base, FusedBase) else AdapterLayer
    return cls(base, adapter, **kwargs)


# -------------------------------------------------------------------------------------------------- split_qkv
def block_diagonal_mask(rows: Sequence[int], rank: int) -> Tensor:
    """(Σ rows, k·r) bool: part i's rows × its rank columns."""
    mask = torch.zeros(sum(rows), rank * len(rows), dtype=torch.bool)
    start = 0
    for i, n in enumerate(rows):
        mask[start : start + n, i * rank : (i + 1) * rank] = True
        start += n
    return mask


def make_split(adapter: AdapterWeights, rows: Sequence[int], rank: int) -> None:
    """Make a fresh rank-k·r LoRA the k separate LoRAs of ``split_qkv`` (a family's ``AdapterRules.split_rows`` gives
    the parts' ``rows``): zero ``lora_up`` outside its diagonal blocks and mask its gradient there (so every
    optimizer, weight decay included, keeps them 0)."""
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
        _config_log.warning("%s: %d split_qkv module(s) hold a lora_up that is not block-diagonal (not a split_qkv "
                            "file), e.g. %s; loaded as they are (the file's ΔW), their off-diagonal blocks stay fixed "
                            "while training", source, len(odd), ", ".join(odd[:3]))  # fmt: skip
    return odd
