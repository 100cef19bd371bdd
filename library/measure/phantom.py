"""Host tensors without values, and weight files read from their headers only (for ``--plan_memory``).

A *phantom* is a host tensor made by ``torch.empty``: it has the real shape, dtype, strides and byte count, but its
pages are never written, so it costs no resident memory however large it is. :class:`PhantomDevice` (the simulated
device of library/measure/simulated_device.py, plus phantoms) keeps them that way: an operator that reads a phantom
on the host is not computed; its outputs are new phantoms of the shapes the operator gives on ``meta`` (a dtype cast,
a float8 store, a key conversion's ``cat`` all cost bytes, never values). Views of a phantom are ordinary views;
``copy_`` from a phantom leaves the destination a phantom; a value the host reads from one (``.item()``) is 0; its
pinned copy (``pin_memory()``) is a phantom.
Copies of 1 MiB or more from the simulated device back to the host come back as phantoms too (a real run would hold
them resident: they are counted, never written); smaller ones are zeros, as on the simulated device (a loss the
host reads must be a number).

:func:`header_only_reads` makes every safetensors read of the run (``safetensors.safe_open`` wherever it was
imported, ``library.files.weights`` readers) build phantoms from the file's header: shapes and dtypes, no tensor
data, so a 24 GB checkpoint plans in seconds and a file cut short after its header plans like the whole file.
Pickle checkpoints (``.ckpt``) are read as usual (their tensors are inside the pickle).
"""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from library.measure import simulated_device as sim_device

_aten = torch.ops.aten
LARGE = 2**20  # device tensors of this size or more come back to the host as phantoms; smaller ones as zeros
_phantoms: dict[int, bool] = {}  # storage (C++ object address) -> True while it lives
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = storage._cdata
    if key not in _phantoms:
        _phantoms[key] = True
        weakref.finalize(storage, _phantoms.pop, key, None)
    return tensor


def phantom(shape: Any, dtype: torch.dtype, stride: Any = None) -> torch.Tensor:
    """A host tensor of ``shape`` / ``dtype`` (and ``stride``) whose values are never written or read."""
    if stride is None:
        return _mark(torch.empty(tuple(shape), dtype=dtype))
    return _mark(torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype))


def is_phantom(tensor: torch.Tensor) -> bool:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        return tensor.device.type == "cpu" and tensor.untyped_storage()._cdata in _phantoms
    except (RuntimeError, NotImplementedError):
        return False


def _unmark(tensor: torch.Tensor) -> None:
    _phantoms.pop(tensor.untyped_storage()._cdata, None)


def _writes(func: Any) -> list[int]:
    """Positions of the arguments ``func`` writes into (``add_``'s self, ``out=`` tensors are keyword-only)."""
    return [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


class PhantomDevice(sim_device.SimulatedDevice):
    """The simulated device with phantom host tensors (see the module docstring)."""

    def _dispatch(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if func in sim_device.PIN_OPS:
            return self._pin_op(func, args)
        on_device = any(t.is_meta for t in tensors)
        target = sim_device._target_device(args, kwargs)
        if (
            func is _aten._to_copy.default
            and on_device
            and args[0].nbytes >= LARGE
            and target not in (None, sim_device.DEVICE.type)
        ):
            self._host_read()  # a large device tensor back to the host: counted, never written
            source = args[0]
            out = phantom(source.shape, kwargs.get("dtype") or source.dtype)
            self._track(out)
            return out
        to_device = target == sim_device.DEVICE.type
        if on_device or to_device or func.is_view or not any(is_phantom(t) for t in tensors):
            if func is _aten.copy_.default and not on_device and is_phantom(args[0]):
                _unmark(args[0])  # written with real values
            return super()._dispatch(func, args, kwargs, tensors)
        if self.strict and func not in sim_device._COPIES:
            self._check_devices(func, tensors)
        if self.strict and func in sim_device._HEAVY and not self.host_compute_allowed:
            raise sim_device.DeviceMismatch(
                f"{func} computed on the host during the {self.phase!r} phase: a module that should be on the "
                f"accelerator was left on the CPU (shapes {[tuple(t.shape) for t in tensors]})"
            )
        return self._without_values(func, args, kwargs)

    def _pinned_copy(self, source: torch.Tensor) -> torch.Tensor:
        if is_phantom(source):  # the page-locked copy of a phantom: its bytes counted, never written
            return phantom(source.shape, source.dtype, source.stride())
        return super()._pinned_copy(source)

    def _without_values(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is sim_device._LOCAL_SCALAR:
            self._host_read()
            return True if args[0].dtype == torch.bool else 0
        if func is _aten.copy_.default:
            return _mark(args[0])
        written = _writes(func)
        if func is _aten.nonzero.default:  # data-dependent: "the first element", as the simulated device answers
            out = phantom((1, args[0].dim()), torch.long)
            self._track(out)
            return out.zero_()
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        if meta_kwargs.get("device") is not None:  # a cast on the host (``.to(device="cpu", dtype=...)``)
            meta_kwargs["device"] = torch.device("meta")
        try:
            out = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError):  # no meta kernel: computed on the (unwritten) host values
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._track(_mark(t))
            return out
        if written:  # in place (add_, mul_, ...) or out=: the written tensors are the outputs
            for i in written:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    _mark(args[i])
            return args[written[0]] if len(written) == 1 else tuple(args[i] for i in written)

        def host(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            made = phantom(t.shape, t.dtype, t.stride())
            self._track(made)
            return made

        return tree_map(host, out)


def _to_meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


# ------------------------------------------------------------------------------------------------ header reads
def read_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str]]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets) and metadata: its first 8 + N bytes only."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata


class _Slice:
    """``safe_open(...).get_slice(key)``: shape and dtype from the header; indexing gives a phantom."""

    def __init__(self, entry: dict) -> None:
        self.entry = entry

    def get_shape(self) -> list[int]:
        return list(self.entry["shape"])

    def get_dtype(self) -> str:
        return self.entry["dtype"]

    def __getitem__(self, index: Any) -> torch.Tensor:
        meta = torch.empty(self.entry["shape"], dtype=DTYPES[self.entry["dtype"]], device="meta")[index]
        return phantom(meta.shape, meta.dtype)


class HeaderOnlyOpen:
    """What ``safetensors.safe_open`` gives, from the header only: ``keys``, ``metadata``, ``get_tensor`` and
    ``get_slice`` give phantoms (on ``device`` when it is not the host)."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", **_: Any) -> None:
        self.entries, self._metadata = read_header(filename)
        self.device = device

    def __enter__(self) -> HeaderOnlyOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self.entries)

    def offset_keys(self) -> list[str]:
        return sorted(self.entries, key=lambda k: self.entries[k]["data_offsets"][0])

    def metadata(self) -> dict[str, str] | None:
        return dict(self._metadata) or None

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.entries[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        out = phantom(entry["shape"], DTYPES[entry["dtype"]])
        return out if str(self.device) in ("cpu", "None") else out.to(self.device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {k: self.get_tensor(k) for k in self.offset_keys()}


def _whole_file(path: Path, device: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with HeaderOnlyOpen(path, device=device) as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _reader_item(reader: Any, key: str) -> torch.Tensor:
    entry = reader.entries[key]
    return phantom(entry["shape"], DTYPES[entry["dtype"]])


def _save_header_only(state: dict, path: Any, metadata: dict | None = None, dtype: Any = None, **_: Any) -> Path:
    """``library.files.weights.save_state_dict`` that converts every tensor as the real one does (the host bytes are
    counted) and writes the safetensors header only, whatever the suffix: the file's layout without its data."""
    from library.files.weights import _SAFETENSORS_DTYPES, _for_file, atomic_path

    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for key in sorted(state):
        t = _for_file(state[key], dtype)
        size = t.numel() * t.element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        del t
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with atomic_path(path) as tmp:
        tmp.write_bytes(len(text).to_bytes(8, "little") + text)
    return Path(path)


def _save_file_header_only(tensors: dict, filename: Any, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` writing the header only (no bytes for the tensors)."""
    _save_header_only(tensors, filename, metadata)


@contextlib.contextmanager
def header_only_writes() -> Iterator[None]:
    """Inside, weight files written through ``library.files.weights.save_state_dict`` or
    ``safetensors.torch.save_file`` hold their header only (the plan's save; and the real-size layouts of
    benchmarks/plan_real_size.py, written without a weight value)."""
    import safetensors.torch

    from library.files import weights

    swaps = {"save_state_dict": (weights.save_state_dict, _save_header_only),
             "save_file": (safetensors.torch.save_file, _save_file_header_only)}  # fmt: skip
    undo = []
    for module in list(sys.modules.values()):
        for name, (original, replacement) in swaps.items():
            if getattr(module, name, None) is original:
                undo.append((module, name, original))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in reversed(undo):
            setattr(module, name, original)


@contextlib.contextmanager
def header_only_reads() -> Iterator[None]:
    """Inside, safetensors files are read from their headers only (see the module docstring)."""
    import safetensors

    from library.files import weights

    original = safetensors.safe_open
    undo: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module in list(sys.modules.values()):  # every module that imported safe_open by name
        if getattr(module, "safe_open", None) is original:
            swap(module, "safe_open", HeaderOnlyOpen)
    swap(weights, "_read_whole_safetensors", _whole_file)
    swap(weights.SafetensorsReader, "__getitem__", _reader_item)
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
