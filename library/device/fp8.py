"""``--fp8_base``: frozen Linear / Conv2d weights stored in float8 (e4m3fn), computed in the mixed-precision dtype.

Each stored layer keeps its weight as a float8 parameter. For the length of one forward call a forward pre-hook puts
a *new* tensor in its place, the weight cast to the compute dtype, and the forward hook puts the float8 parameter
back. What autograd saves for backward is therefore that compute-dtype copy, never float8: cuDNN's convolution
backward refuses a weight whose dtype differs from the gradient's. (diffusers' layer-wise casting changes the dtype
of the parameter itself in place, so the weight a convolution saved turns back into float8 after the forward;
CPU kernels accept that, CUDA's do not.) Under ``--gradient_checkpointing`` the recomputed forward makes its own
copy in the same way.

A copy does not wait for backward in memory: when autograd saves it (or a view of it) the layer's saved-tensor hook
keeps a note instead (the float8 parameter, the dtype and the view's geometry) and backward casts it again, which
gives the same tensor bit for bit. So the device holds the float8 weights, not a second copy per layer (with
sd-scripts' autocast a layer on the gradient's path keeps its cast weight until backward: more than bf16 weights
alone, without gradient checkpointing). Inside a gradient-checkpointed block, torch's own saved-tensor hooks are in
charge and the copy is made again at the recompute, so the note is not needed there.
Biases and norm layers stay in the compute dtype (small, and sensitive to rounding). Embeddings are never stored in
float8 (token embeddings are trained by textual inversion and pivotal tuning, and lookups have no float8 kernel).

sd-scripts casts the whole model with ``.to(torch.float8_e4m3fn)`` and relies on autocast; this is the same storage
with an explicit compute dtype, so it runs the same without autocast (CPU) and under fp16 as under bf16.

``--fp8_scaled`` (musubi-tuner's and sd-scripts' HunyuanImage flag, here for every family): each weight is stored
divided by its scale ``max |W| / 448`` (e4m3fn's largest value), so the whole float8 range is used whatever the
weight's magnitude (plain casting flushes small weights to zero and saturates none), and the copy is multiplied back
by the scale (a float32 number kept with the layer's hooks) when it is made.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
STORED = (nn.Linear, nn.Conv2d)


def is_fp8(tensor: Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


class _Recast(NamedTuple):
    """What autograd keeps of a saved compute-dtype weight (or a view of it): enough to make it again."""

    stored: Tensor
    dtype: torch.dtype
    scale: float | None
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _cast(stored: Tensor, dtype: torch.dtype, scale: float | None) -> Tensor:
    """The compute-dtype weight of a float8 one (times its ``--fp8_scaled`` scale): a new tensor."""
    weight = stored.to(dtype)
    return weight if scale is None else weight * scale


def _unpack(saved: object) -> object:
    if isinstance(saved, _Recast):
        return _cast(saved.stored, saved.dtype, saved.scale).as_strided(saved.size, saved.stride, saved.offset)
    return saved


def _others_hook_saved_tensors() -> bool:
    """Whether saved-tensor hooks are active already (torch.utils.checkpoint's, or a caller's): ours stand aside.
    Hooks that only note weights (library/run/block_swap.py, whose pack function says ``weight_notes``) are not in the
    way: ours go inside them for the layer's call, and note the compute-dtype copy they would not recognise."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    hooks = top(False)
    return hooks is not None and not getattr(hooks[0], "weight_notes", False)


class _Fp8Weight:
    """The hooks of one layer: swap the float8 parameter for a compute-dtype copy during its forward."""

    def __init__(self, compute_dtype: torch.dtype, scale: float | None = None) -> None:
        self.compute_dtype = compute_dtype
        self.scale = scale  # --fp8_scaled: the stored weight is W / scale
        self.stored: nn.Parameter | None = None
        self.saving: torch.autograd.graph.saved_tensors_hooks | None = None

    def before(self, module: nn.Module, args: tuple) -> None:
        self.stored = stored = module._parameters["weight"]  # the float8 parameter (wherever .to() has moved it)
        copy = _cast(stored, self.compute_dtype, self.scale)  # a new tensor: what autograd may save
        module._parameters["weight"] = copy
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or _others_hook_saved_tensors():
            return
        key, dtype, scale = copy.untyped_storage()._cdata, self.compute_dtype, self.scale

        def pack(tensor: Tensor) -> object:
            if tensor.untyped_storage()._cdata != key:
                return tensor
            return _Recast(stored, dtype, scale, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

        self.saving = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self.saving.__enter__()

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        module._parameters["weight"] = self.stored
        self.stored = None  # no reference between calls: a later .to() may replace the parameter object


def store_in_fp8(
    model: nn.Module, compute_dtype: torch.dtype, skip: tuple[str, ...] = ("norm",), scaled: bool = False
) -> int:
    """Store the weights of ``model``'s frozen Linear / Conv2d layers in float8; returns how many were stored.
    ``scaled`` (``--fp8_scaled``): each weight divided by its scale ``max |W| / 448`` first (module docstring).

    Layers whose path contains one of ``skip`` (an entry ending in "$": whose path is that entry) stay as they are
    (diffusers' rule for UNets: "norm"), as do layers
    with a trainable weight and layers stored already, and the modules a transformers model keeps in full precision
    (its ``_keep_in_fp32_modules``, matched by the last path component: T5's ``wo``, whose parent casts its input
    to ``wo.weight.dtype`` before calling it). Cast where the model is (on the CPU before the move to the device,
    so the device never holds the half-precision copy); the weights move with ``model.to(device)``.
    """
    count = 0
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        if not isinstance(module, STORED) or any(_skips(s, name) for s in skip) or hasattr(module, "_sdtrain_fp8"):
            continue
        if name.rsplit(".", 1)[-1] in keep:
            continue
        weight = module.weight
        if weight.requires_grad or not weight.is_floating_point():
            continue
        scale = None
        with torch.no_grad():
            if scaled:
                scale = max(weight.data.abs().amax().float().item(), 1e-12) / FP8_MAX
                weight.data = (weight.data.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            else:
                weight.data = weight.data.to(FP8)
        if module.bias is not None:
            module.bias.data = module.bias.data.to(compute_dtype)
        hooks = _Fp8Weight(compute_dtype, scale)
        module._sdtrain_fp8 = hooks
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after, always_call=True)
        count += 1
    return count


def _skips(entry: str, name: str) -> bool:
    return name == entry[:-1] if entry.endswith("$") else entry in name


def stored_in_fp8(module: nn.Module) -> bool:
    return hasattr(module, "_sdtrain_fp8")


def compute_weight(module: nn.Module, dtype: torch.dtype | None = None) -> Tensor:
    """``module.weight`` as its forward computes with it: float8 storage cast to the compute dtype (or ``dtype``)."""
    weight = module.weight
    if is_fp8(weight):
        hooks = getattr(module, "_sdtrain_fp8", None)
        if hooks is None:
            return weight.to(dtype or torch.bfloat16)
        return _cast(weight, dtype or hooks.compute_dtype, hooks.scale)
    return weight
