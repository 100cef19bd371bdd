"""Peak tensor memory on any device, CPU included: live tensor storages counted as they are made and freed.

``torch.cuda.max_memory_allocated`` exists only on CUDA; on CPU the process RSS also counts the interpreter, the
libraries and memory the allocator keeps. :class:`TensorMemory` counts what the tensors themselves hold:

    with TensorMemory() as mem:     # every tensor alive now (weights, caches) is counted first
        loss = step(batch); loss.backward(); optimizer.step()
    mem.peak_bytes["cpu"], mem.baseline_bytes["cpu"]

Every operator output goes through a ``TorchDispatchMode`` (autograd's backward ops included); each new storage
is counted once (views share it) and uncounted by a ``weakref.finalize`` on the storage when it is freed. Storages
made outside the dispatcher while the mode is on (``torch.load``, safetensors, numpy bridges) are counted when an
operator first sees them. On the ``meta`` device nothing is computed but every shape, dtype and lifetime is the
real one, so a step of a model too large or too slow to run here can be measured there (``device "meta"``).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _leaves(tree: Any, out: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _leaves(item, out)
    elif isinstance(tree, dict):
        for item in tree.values():
            _leaves(item, out)
    elif not isinstance(tree, _SCALARS):
        out.extend(t for t in tree_leaves(tree) if isinstance(t, torch.Tensor))  # any other pytree node


def tensors_in(*trees: Any) -> list[torch.Tensor]:
    """The tensors among an operator's arguments or outputs, in ``tree_leaves`` order (lists, tuples and dicts are
    walked here: the general pytree walk cost a third of a plan's dispatch time)."""
    out: list[torch.Tensor] = []
    for tree in trees:
        _leaves(tree, out)
    return out


def _storage_freed(mode: weakref.ref, key: int) -> None:
    """A counted storage was freed: uncount it in its mode, if the mode still lives (the finalizer holds the mode
    weakly: a storage that outlives a measurement, e.g. a library's cached tensor, must not keep the finished mode
    and everything it refers to alive)."""
    counter = mode()
    if counter is not None:
        counter._freed(key)


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of tensor storages per device type ("cpu", "cuda", ...), in this thread.

    ``baseline_bytes``: what was alive on entering (found through the garbage collector, which sees every tensor a
    Python object holds). ``peak_bytes``: the most alive at once since entering or since :meth:`reset_peak`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[str, int]] = {}  # storage (C++ object address) -> (device type, bytes)
        self.live_bytes: dict[str, int] = defaultdict(int)
        self.peak_bytes: dict[str, int] = defaultdict(int)
        self.baseline_bytes: dict[str, int] = {}
        self._weak = weakref.ref(self)

    def __enter__(self) -> TensorMemory:
        with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for tensor in tensors:
            self._track(tensor)
        self.baseline_bytes = dict(self.live_bytes)
        return super().__enter__()

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (e.g. at the start of each training step)."""
        self.peak_bytes = defaultdict(int, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """The one dispatch entry of this mode and its subclasses: the operator's tensors are collected once and
        handed to :meth:`_dispatch`, which subclasses extend (one mode, not a dispatch layer per class)."""
        kwargs = kwargs or {}
        return self._dispatch(func, args, kwargs, tensors_in(args, kwargs))

    def _dispatch(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        """Run ``func`` and count its arguments' storages (``tensors``, in order), then its outputs'."""
        out = self._run(func, args, kwargs, tensors)
        for tensor in tensors:
            self._track(tensor)
        for tensor in tensors_in(out):
            self._track(tensor)
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        return func(*args, **kwargs)

    def _track(self, tensor: torch.Tensor) -> None:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            return  # a subclass whose storage lives in its inner tensors
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse or functional wrappers
            return
        key = storage._cdata  # meta storages too: shapes and lifetimes are exact there, without any arithmetic
        if key in self._live or storage.nbytes() == 0:
            return
        device, size = storage.device.type, storage.nbytes()
        self._live[key] = (device, size)
        self.live_bytes[device] += size
        if self.live_bytes[device] > self.peak_bytes[device]:
            self.peak_bytes[device] = self.live_bytes[device]
        weakref.finalize(storage, _storage_freed, self._weak, key)

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes[entry[0]] -= entry[1]

    def report(self, device: str = "cpu") -> dict[str, float]:
        """Baseline, peak and peak minus baseline in MiB, for one device type."""
        mib = 2.0**20
        base = self.baseline_bytes.get(device, 0)
        peak = self.peak_bytes.get(device, 0)
        return {
            "baseline_mib": round(base / mib, 1),
            "peak_mib": round(peak / mib, 1),
            "above_baseline_mib": round((peak - base) / mib, 1),
        }
