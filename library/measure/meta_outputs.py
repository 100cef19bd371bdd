"""The outputs of an operator on the simulated (``meta``) device, remembered by the operator and its inputs' metadata.

On ``meta`` an operator computes nothing: its output is a new empty tensor whose shape, strides and dtype follow
from the inputs' shapes, strides, dtypes and the other arguments alone. Many of torch's meta kernels are Python
(the ``torch._refs`` / ``torch._decomp`` implementations of elementwise ops, norms, ``addmm``, attention), a
millisecond each, and a planned step calls the same operator on the same shapes again and again (every block of a
transformer, forward, recomputation and backward). :class:`MetaOutputs` runs the kernel once per operator and input
signature, checks that its outputs are plain new tensors (no view, no alias of an input or of each other, a storage
of exactly the bytes its shape and strides need), and from then on answers with new empty tensors of the same
shapes, strides and dtypes: the tensors, their storages' sizes and their lifetimes are the ones the kernel gives.
Operators that write into or return views of their arguments, and those whose output shape depends on values, are
always run.
"""

from __future__ import annotations

from typing import Any

import torch

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNCACHED = "uncached"  # the recipe of a signature whose outputs are not plain new tensors
_LIMIT = 200_000  # signatures kept (a real-size plan has a few thousand)


def _eligible(func: Any) -> bool:
    """A functional operator (nothing written, no output aliasing an argument) with value-independent shapes."""
    schema = func._schema
    if any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        return False
    tags = set(func.tags)
    return not tags & {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.storage_offset(), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value), *(_key(v) for v in value))
    if isinstance(value, _SCALARS):
        return (type(value), value)  # 1, 1.0 and True promote differently
    raise TypeError  # an argument this cache does not describe: run the kernel


def _recipe(out: Any, args_storages: set[int]) -> Any:
    """How to make ``out`` again (per output: shape, strides, dtype), or _UNCACHED when it is not plain new tensors."""
    flat = out if isinstance(out, (tuple, list)) else (out,)
    seen = set(args_storages)
    specs = []
    for t in flat:
        if t is None:
            specs.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_meta or t._is_view() or t.storage_offset() != 0:
            return _UNCACHED
        if t.is_conj() or t.is_neg() or t.layout != torch.strided:
            return _UNCACHED
        storage = t.untyped_storage()
        if storage._cdata in seen:
            return _UNCACHED
        seen.add(storage._cdata)
        spec = (t.shape, t.stride(), t.dtype)
        if _make_one(spec).untyped_storage().nbytes() != storage.nbytes():
            return _UNCACHED
        specs.append(spec)
    kind = type(out) if isinstance(out, (tuple, list)) else None
    if kind not in (None, tuple, list):
        return _UNCACHED
    return kind, tuple(specs)


def _make_one(spec: Any) -> torch.Tensor | None:
    if spec is None:
        return None
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


class MetaOutputs:
    """Operator outputs on ``meta`` by input signature (module docstring). Call it as the operator:
    ``outputs(func, args, kwargs, tensors)``, with ``tensors`` the arguments' tensors, every one on ``meta``."""

    def __init__(self) -> None:
        self.recipes: dict[Any, Any] = {}
        self.eligible: dict[Any, bool] = {}
        self.hits = 0
        self.runs = 0

    def __call__(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        eligible = self.eligible.get(func)
        if eligible is None:
            eligible = self.eligible[func] = _eligible(func)
        if not eligible:
            return func(*args, **kwargs)
        try:
            key = (func, torch.get_default_dtype(), _key(args), _key(tuple(kwargs.items())))
        except TypeError:
            return func(*args, **kwargs)
        recipe = self.recipes.get(key)
        if recipe is None:
            self.runs += 1
            out = func(*args, **kwargs)
            if len(self.recipes) >= _LIMIT:
                self.recipes.clear()
            storages = {t.untyped_storage()._cdata for t in tensors}
            self.recipes[key] = _recipe(out, storages)
            return out
        if recipe is _UNCACHED:
            return func(*args, **kwargs)
        self.hits += 1
        kind, specs = recipe
        if kind is None:
            return _make_one(specs[0])
        return kind(_make_one(spec) for spec in specs)
