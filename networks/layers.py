"""Adapter layers: a wrapper that holds a frozen base Linear / Conv2d (or norm) and the adapter's tensors.

The wrapper replaces the base module in its parent (peft-style ``base_layer``; the base module's ``forward`` is never
patched) and computes

    y = base(x) + multiplier · Δ(x)

* LoRA without DoRA uses the factorised path ``Δ(x) = scale · up(down(x))`` (no ΔW built), with sd-scripts'
  dropouts on the rank-r activation: ``network_dropout`` (neurons), ``rank_dropout`` (whole rank channels per
  sample, rescaled by 1/(1-p)).
* Every other case builds ΔW = ``algo.delta_weight(...)`` once per call and applies it with the base layer's own op
  (``F.linear`` / ``F.conv2d`` with the base stride/padding). ``rank_dropout`` then masks output rows of ΔW
  (LyCORIS; rescaled by the kept fraction only with ``rank_dropout_scale``) and ``network_dropout`` acts on Δ(x).
* DoRA: Δ(x) = op(x, W' - W) with W' = ``dora_weight(W, ΔW, magnitude)``, i.e. the weight is interpolated
  W + m·(W' - W) (ComfyUI's strength rule; at m = 1 this is exactly LyCORIS' and PEFT's DoRA).
* OFT / BOFT (``multiplier_inside``): ΔW = W'(m) − W is built at the layer's multiplier m (the rotation moved toward
  I, LyCORIS' rule) and added as it is, Δ(x) = op(x, ΔW); the base weight W is passed to the algorithm.
* ``module_dropout`` skips the adapter for the whole step with probability p. All dropouts act in training only.

``merge()`` / ``unmerge()`` write the same ΔW into the base weight (and restore it exactly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from library.device.fp8 import compute_weight

from .algos import ALGOS, dora, dylora
from .algos import lora as lora_algo
from .algos import norm as norm_algo
from .algos.base import Algorithm

ADAPTABLE = (nn.Linear, nn.Conv2d)
NORMS = (nn.GroupNorm, nn.LayerNorm)


def weight_kind(module: nn.Module) -> str | None:
    """``"linear"`` (Linear or 1x1 conv: the "network_dim" layers), ``"conv"`` (k > 1), ``"norm"`` or None (a grouped
    convolution too: its ΔW would need the groups, as sd-scripts' ``networks.lora`` skips it)."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return "linear" if tuple(module.kernel_size) == (1, 1) else "conv"
    if isinstance(module, NORMS) and getattr(module, "weight", None) is not None:
        return "norm"
    return None


def max_rank(shape: tuple[int, ...]) -> int:
    """The largest meaningful rank for a weight of ``shape``: min(out, in·kh·kw)."""
    return min(shape[0], math.prod(shape[1:]))


class AdapterWeights(nn.Module):
    """The trainable tensors of one adapted module: the algorithm's parameters, ``alpha`` and the DoRA magnitude.

    ``params`` hold the file shapes (see ``networks.algos``); ``alpha`` is a buffer (written per module);
    ``magnitude`` (DoRA) has shape (out, 1[, 1, 1]) or, for old files, (1, in[, 1, 1]); ``scalar`` (LyCORIS
    ``use_scalar``) multiplies ΔW and is folded into the file tensors on save.
    """

    def __init__(
        self,
        algo: Algorithm,
        params: Mapping[str, Tensor],
        alpha: float,
        *,
        magnitude: Tensor | None = None,
        use_scalar: bool = False,
    ) -> None:
        super().__init__()
        self.algo = algo
        frozen = algo.frozen_params  # LoRA-FA's lora_down: kept at its init, no gradient
        # fixed settings stored as tensors ((IA)³'s on_input): on the CPU, not trained, not moved by .to()
        self.constants = {k: v.detach().cpu() for k, v in params.items() if k in algo.constants}
        self.params = nn.ParameterDict({k: nn.Parameter(v, requires_grad=algo.logical_name(k) not in frozen)
                                        for k, v in params.items() if k not in algo.constants})  # fmt: skip
        device = next(iter(self.params.values())).device
        self.register_buffer("alpha", torch.tensor(float(alpha), device=device))
        self.magnitude = nn.Parameter(magnitude) if magnitude is not None else None
        self.scalar = nn.Parameter(torch.zeros((), device=device)) if use_scalar else None

    @property
    def rank(self) -> int | None:
        return self.algo.rank(self.params)

    def tensors(self) -> Mapping[str, Tensor]:
        """What the algorithm's functions read: the trainable parameters and the constants."""
        return self.params if not self.constants else {**self.params, **self.constants}

    def scale(self) -> Tensor | float:
        """alpha / r (a 0-dim tensor, no host sync), or 1 when the format fixes it (LoKr with full factors)."""
        r = self.rank
        return self.alpha / r if r else 1.0

    def delta_weight(self, shape: tuple[int, ...], base: Tensor | None = None, multiplier: float = 1.0) -> Tensor:
        """ΔW in ``shape`` at multiplier 1 (without DoRA): the algorithm's formula times ``scalar``. ``base`` is the
        base weight W, required by ``needs_base`` algorithms (ΔW depends on W). ``multiplier`` is passed to
        ``multiplier_inside`` algorithms only (ΔW at that multiplier); the others ignore it (callers scale)."""
        if self.algo.needs_base and base is None:
            raise ValueError(f"{self.algo.name}: ΔW depends on the base weight; pass base=W")
        kw = {"multiplier": multiplier} if self.algo.multiplier_inside else {}
        delta = self.algo.delta_weight(self.tensors(), self.scale(), shape, base=base, alpha=self.alpha, **kw)
        return delta * self.scalar if self.scalar is not None else delta

    def delta_bias(self) -> Tensor | None:
        """The bias change at multiplier 1 (LyCORIS full / diff ``diff_b``), or None."""
        if self.algo.delta_bias is None:
            return None
        delta = self.algo.delta_bias(self.tensors(), self.scale())
        return delta * self.scalar if delta is not None and self.scalar is not None else delta

    def factors(self) -> tuple[Tensor, Tensor] | None:
        """(up (out, r), down (r, in·kh·kw)) with ``delta_weight`` = up @ down (reshaped), for algorithms that are a
        plain low-rank product (LoRA without tucker); None otherwise. DoRA's magnitude is not part of it."""
        if self.algo.factors is None:
            return None
        scale = self.scale()
        return self.algo.factors(self.params, scale * self.scalar if self.scalar is not None else scale)

    def file_tensors(self) -> dict[str, Tensor]:
        """Tensor suffix -> tensor, as written in kohya/LyCORIS files (``scalar`` folded in, ``alpha`` 0-dim)."""
        if self.algo.to_file is not None:  # stored per block in memory (DyLoRA), one tensor per key in files
            out = {k: v.detach() for k, v in self.algo.to_file(self.params).items()}
        else:
            out = {self.algo.file_keys[k]: v.detach() for k, v in self.params.items()}
        if self.scalar is not None:
            for key in (k for k in self.algo.scalar_params if k in self.params):
                out[self.algo.file_keys[key]] = (self.params[key] * self.scalar).detach()
        out.update({self.algo.file_keys[k]: v for k, v in self.constants.items()})
        if self.algo.has_alpha:
            out["alpha"] = self.alpha.detach()
        if self.magnitude is not None:
            out["dora_scale"] = self.magnitude.detach()
        return out

    @classmethod
    def from_file(cls, tensors: Mapping[str, Tensor], algo_name: str, name: str, **options) -> AdapterWeights:
        """Rebuild from one module's file tensors (suffix -> tensor); ``name`` is used in error messages;
        ``options`` go to the algorithm's ``from_file`` (DyLoRA: ``block``)."""
        algo = ALGOS[algo_name]
        params, unknown = {}, []
        for suffix, t in tensors.items():
            param = algo.param_for_suffix(suffix)
            if param is not None:
                params[param] = t.detach().clone() if param in algo.constants else t.detach().clone().float()
            elif suffix not in ("alpha", "dora_scale"):
                unknown.append(suffix)
        if unknown:
            raise ValueError(f"{name}: tensors {sorted(unknown)} do not belong to a {algo_name} module")
        if algo.from_file is not None:
            try:
                params = algo.from_file({algo.file_keys[k]: v for k, v in params.items()}, **options)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        rank = algo.rank(params)
        alpha = float(tensors["alpha"]) if "alpha" in tensors else float(rank or 1)
        magnitude = tensors.get("dora_scale")
        if magnitude is not None and algo.multiplier_inside:
            raise ValueError(
                f"{name}: a DoRA magnitude (dora_scale) on a {algo_name} module is not supported "
                "(LyCORIS has no DoRA for OFT either); remove the tensor or use another file"
            )
        return cls(algo, params, alpha, magnitude=None if magnitude is None else magnitude.detach().clone().float())


class AdapterLayer(nn.Module):
    """A frozen ``base_layer`` (Linear / Conv2d) plus one adapter; see the module docstring for the forward pass."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter: AdapterWeights,
        *,
        dropout: float | None = None,
        rank_dropout: float | None = None,
        module_dropout: float | None = None,
        rank_dropout_scale: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, ADAPTABLE) and not getattr(base_layer, "is_fused", False):
            raise TypeError(f"AdapterLayer wraps nn.Linear or nn.Conv2d, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.adapter = adapter
        self.multiplier = 1.0
        self.dropout = dropout or None
        self.rank_dropout = rank_dropout or None
        self.module_dropout = module_dropout or None
        self.rank_dropout_scale = rank_dropout_scale
        self._backup: Tensor | None = None  # original base weight while merged
        self._bias_backup: Tensor | None = None  # original bias while merged (algorithms with a bias change)
        b = base_layer  # the conv arguments of the adapter's own ops (None: Linear), fixed with the base layer
        self._conv_args = None if not isinstance(b, nn.Conv2d) else {"stride": b.stride, "padding": b.padding,
                                                                      "dilation": b.dilation}  # fmt: skip

    @property
    def merged(self) -> bool:
        return self._backup is not None

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return tuple(self.base_layer.weight.shape)

    def _conv(self) -> dict | None:
        return self._conv_args

    def _op(self, x: Tensor, weight: Tensor) -> Tensor:
        conv = self._conv()
        return F.linear(x, weight) if conv is None else F.conv2d(x, weight, None, **conv)

    def _base_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """W as the adapter sees it: the weight before merging, float8 storage (--fp8_base) cast to ``dtype``."""
        if self._backup is not None:
            return self._backup if dtype is None else self._backup.to(dtype)
        return compute_weight(self.base_layer, dtype)

    def algo_delta(self, multiplier: float = 1.0) -> Tensor:
        """ΔW of the algorithm at multiplier 1, before DoRA (the base weight passed where the algorithm needs it);
        for ``multiplier_inside`` algorithms (OFT) ΔW at ``multiplier``."""
        adapter = self.adapter
        if adapter.algo.needs_base:
            dtype = next(iter(adapter.params.values())).dtype
            return adapter.delta_weight(self.weight_shape, base=self._base_weight(dtype), multiplier=multiplier)
        return adapter.delta_weight(self.weight_shape, multiplier=multiplier)

    def delta(self, multiplier: float | None = None) -> Tensor:
        """W_adapted - W at ``multiplier`` (default: the layer's), including DoRA: what merge adds to the weight."""
        m = self.multiplier if multiplier is None else multiplier
        if self.adapter.algo.multiplier_inside:  # W'(m) − W directly (not linear in m); m = 0 is off, as in forward
            if m == 0:
                return torch.zeros(self.weight_shape, device=self.base_layer.weight.device)
            return self.algo_delta(m)
        delta = self.algo_delta()
        if self.adapter.magnitude is not None:
            weight = self._backup if self._backup is not None else compute_weight(self.base_layer, delta.dtype)
            delta = dora.dora_weight(weight, delta, self.adapter.magnitude) - weight.to(delta.dtype)
        return delta * m

    def delta_bias(self, multiplier: float | None = None) -> Tensor | None:
        """The bias change at ``multiplier`` (default: the layer's), or None when the algorithm changes no bias."""
        delta = self.adapter.delta_bias()
        return None if delta is None else delta * (self.multiplier if multiplier is None else multiplier)

    def _train_delta(self, training: bool | None = None) -> tuple[Tensor, Tensor | None]:
        """(ΔW as the forward pass uses it, the rank-dropout mask of its output rows or None); ``training``: whether
        rank dropout acts (None: the layer's flag)."""
        delta, keep = self.algo_delta(self.multiplier), None  # the multiplier reaches multiplier_inside algorithms only
        if (self.training if training is None else training) and self.rank_dropout:
            keep = (torch.rand(delta.shape[0], device=delta.device) > self.rank_dropout).to(delta.dtype)
            if self.rank_dropout_scale:
                keep = keep / keep.mean().clamp_min(1e-6)
            delta = delta * keep.reshape(-1, *[1] * (delta.dim() - 1))
        if self.adapter.magnitude is not None:
            weight = compute_weight(self.base_layer, delta.dtype)  # float8 storage (--fp8_base): cast
            delta = dora.dora_weight(weight, delta, self.adapter.magnitude) - weight.to(delta.dtype)
        return delta, keep

    def _lora_forward(self, x: Tensor, adapter: AdapterWeights) -> Tensor:
        # one step runs this for every adapted module (~1,000 for SDXL): attribute look-ups are kept few, and no op
        # that changes nothing (x 1.0, a cast to the same dtype) is dispatched; the result is bitwise the same
        algo, params = adapter.algo, adapter.params
        h = algo.project_down(x, params, self._conv_args)
        if self.training and self.dropout:
            h = F.dropout(h, p=self.dropout)
        scale = adapter.scale()
        if self.training and self.rank_dropout:
            mask = torch.rand((h.shape[0], h.shape[1] if h.dim() == 4 else h.shape[-1]), device=h.device)
            mask = (mask > self.rank_dropout).to(h.dtype)
            mask = mask.reshape(h.shape[0], *([1] * (h.dim() - 2)), -1) if h.dim() != 4 else mask[..., None, None]
            h = h * mask
            scale = scale / (1.0 - self.rank_dropout)
        out = algo.project_up(h, params)
        if adapter.scalar is not None:
            scale = scale * adapter.scalar
        return out * (scale if self.multiplier == 1.0 else scale * self.multiplier)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if self._backup is not None or self.multiplier == 0:  # merged, or switched off
            return out
        if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return out
        adapter = self.adapter
        if adapter.algo.project_down is not None and adapter.magnitude is None:
            delta = self._lora_forward(x, adapter)
            return out + (delta if delta.dtype == out.dtype else delta.to(out.dtype))
        weight, keep = self._train_delta()
        delta = self._op(x, weight.to(x.dtype))
        bias = adapter.delta_bias()
        if bias is not None:  # (out,) onto the channel axis: last for Linear, 1 for Conv2d (N, C, H, W)
            bias = bias if keep is None else bias * keep  # rank dropout drops the output unit's bias change too
            delta = delta + (bias[:, None, None] if self._conv_args is not None else bias).to(delta.dtype)
        if self.training and self.dropout:
            delta = F.dropout(delta, p=self.dropout)
        if adapter.algo.multiplier_inside:  # ΔW was built at the multiplier already
            return out + delta.to(out.dtype)
        return out + (delta * self.multiplier).to(out.dtype)

    @torch.no_grad()
    def merge(self, keep_backup: bool = True) -> None:
        """Add the adapter (at the current multiplier) into the base weight; ``unmerge()`` restores it exactly."""
        if self.merged:
            return
        weight, bias = self.base_layer.weight, self.base_layer.bias
        delta, delta_b = self.delta(), self.delta_bias()
        if delta_b is not None and bias is None:
            raise ValueError(f"{self.adapter.algo.name}: the adapter changes a bias the base layer does not have")
        backup = weight.detach().clone()
        weight.copy_((weight.float() + delta.float()).to(weight.dtype))
        if delta_b is not None:
            self._bias_backup = bias.detach().clone()
            bias.copy_((bias.float() + delta_b.float()).to(bias.dtype))
        if keep_backup:
            self._backup = backup

    @torch.no_grad()
    def unmerge(self) -> None:
        if self._backup is not None:
            self.base_layer.weight.copy_(self._backup)
            self._backup = None
            if self._bias_backup is not None:
                self.base_layer.bias.copy_(self._bias_backup)
                self._bias_backup = None


class DyLoRALayer(AdapterLayer):
    """An :class:`AdapterLayer` whose training forward trains one random rank block per call (``algos/dylora.py``).

    ``style`` is ``"kohya"`` (sd-scripts networks.dylora) or ``"lycoris"`` (LyCORIS algo=dylora); the block is drawn
    from torch's CPU RNG (saved by ``--save_state``, replayed by gradient checkpointing's recompute). Outside training,
    and when merged, the layer is the plain LoRA its file holds. ``last_block`` records the last draw.
    """

    def __init__(self, base_layer: nn.Module, adapter: AdapterWeights, *, style: str = "kohya", **kwargs) -> None:
        super().__init__(base_layer, adapter, **kwargs)
        if style not in dylora.STYLES:
            raise ValueError(f"DyLoRA style {style!r}: expected one of {', '.join(dylora.STYLES)}")
        self.style = style
        self.last_block: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self._backup is not None or self.multiplier == 0:
            return super().forward(x)
        out = self.base_layer(x)
        if self.module_dropout and torch.rand(()) < self.module_dropout:
            return out
        adapter = self.adapter
        params = adapter.params
        j = dylora.draw_block(self.style, adapter.rank, dylora.block_size(params))
        self.last_block = j
        down, up, scale = dylora.step_factors(params, j, self.style, adapter.alpha)
        h = lora_algo.project_down(x, {"lora_down": down}, self._conv_args)
        delta = lora_algo.project_up(h, {"lora_up": up}) * (scale * self.multiplier)
        return out + delta.to(out.dtype)


class NormWeights(nn.Module):
    """``w_norm`` / ``b_norm`` of one norm layer (LyCORIS ``train_norm``); no alpha."""

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterDict({k: nn.Parameter(v) for k, v in params.items()})

    def file_tensors(self) -> dict[str, Tensor]:
        return {norm_algo.FILE_KEYS[k]: v.detach() for k, v in self.params.items()}


class NormAdapterLayer(nn.Module):
    """A frozen GroupNorm / LayerNorm whose affine terms get ``multiplier · (w_norm, b_norm)`` added."""

    def __init__(self, base_layer: nn.Module, adapter: NormWeights, *, module_dropout: float | None = None):
        super().__init__()
        if not isinstance(base_layer, NORMS):
            raise TypeError(f"NormAdapterLayer wraps GroupNorm or LayerNorm, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.adapter = adapter
        self.multiplier = 1.0
        self.module_dropout = module_dropout or None
        self._backup: tuple[Tensor, Tensor | None] | None = None

    @property
    def merged(self) -> bool:
        return self._backup is not None

    def forward(self, x: Tensor) -> Tensor:
        b = self.base_layer
        skip = self.training and self.module_dropout and torch.rand(()) < self.module_dropout
        if self.merged or skip:
            return b(x)
        weight, bias = norm_algo.affine(b.weight, b.bias, dict(self.adapter.params), self.multiplier)
        if isinstance(b, nn.GroupNorm):
            return F.group_norm(x, b.num_groups, weight, bias, b.eps)
        return F.layer_norm(x, b.normalized_shape, weight, bias, b.eps)

    @torch.no_grad()
    def merge(self, keep_backup: bool = True) -> None:
        if self.merged:
            return
        b = self.base_layer
        backup = (b.weight.detach().clone(), None if b.bias is None else b.bias.detach().clone())
        weight, bias = norm_algo.affine(b.weight, b.bias, dict(self.adapter.params), self.multiplier)
        b.weight.copy_(weight)
        if bias is not None:
            b.bias.copy_(bias)
        if keep_backup:
            self._backup = backup

    @torch.no_grad()
    def unmerge(self) -> None:
        if self._backup is not None:
            self.base_layer.weight.copy_(self._backup[0])
            if self._backup[1] is not None:
                self.base_layer.bias.copy_(self._backup[1])
            self._backup = None
