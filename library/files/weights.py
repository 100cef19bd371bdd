"""Reading and writing weight files: safetensors and pickle checkpoints, always safely and atomically.

* Reads: ``.safetensors`` (with its ``__metadata__``), ``.ckpt`` / ``.pt`` / ``.pth`` / ``.bin`` pickles loaded with
  ``torch.load(weights_only=True)`` so a malicious pickle cannot run code.
* Writes: to a temporary file in the target folder, then ``os.replace`` — a crash never leaves a half-written file
  under the final name, and the previous file stays intact until the new one is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_NO_MMAP: ContextVar[bool] = ContextVar("sdtrain_no_mmap", default=False)
_STREAMED: ContextVar[bool] = ContextVar("sdtrain_streamed_saves", default=False)
# safetensors' dtype names (its format spec)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@contextlib.contextmanager
def without_mmap(enabled: bool = True) -> Iterator[None]:
    """``--disable_mmap_load_safetensors``: inside, safetensors files are read into memory whole and then parsed,
    instead of memory-mapped (faster on some network file systems and WSL mounts, as in sd-scripts)."""
    token = _NO_MMAP.set(enabled)
    try:
        yield
    finally:
        _NO_MMAP.reset(token)


def mmap_disabled() -> bool:
    """True inside :func:`without_mmap`."""
    return _NO_MMAP.get()


def _read_whole_safetensors(path: Path, device: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors.torch import load

    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    tensors = load(data)
    return {k: v.to(device) for k, v in tensors.items()}, dict(header.get("__metadata__") or {})


class SaveError(OSError):
    """A file could not be written (disk full, I/O error, no permission). The message names the file and says that
    the files written before it are intact: every write is atomic, so no earlier file was touched."""


def _os_error_inside(error: BaseException) -> OSError | None:
    """The operating-system error that safetensors' own ``SafetensorError`` (not an ``OSError``) carries in its text,
    e.g. 0.8's ``Error while serializing: I/O error: No space left on device (os error 28)`` or older releases'
    ``IoError(Os { code: 28, ... })``; ``None`` for other errors."""
    from safetensors import SafetensorError

    if not isinstance(error, SafetensorError):
        return None
    text = str(error)
    code = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", text)
    if code:
        number = int(code.group(1) or code.group(2))
        return OSError(number, os.strerror(number))
    if "I/O error" in text or "IoError" in text:
        return OSError(errno.EIO, text.split("I/O error: ")[-1].strip() or os.strerror(errno.EIO))
    return None


def save_error(path: str | os.PathLike, error: BaseException) -> SaveError:
    """The :class:`SaveError` for ``error`` while writing ``path`` (an existing SaveError is kept as it is)."""
    if isinstance(error, SaveError):
        return error
    error = _os_error_inside(error) or error
    reason = getattr(error, "strerror", None) or (str(error).strip().splitlines() or [""])[0]
    out = SaveError(f"{path} could not be written ({reason or type(error).__name__}); the files saved before it "
                    "are intact, and nothing was left half-written under its name")  # fmt: skip
    out.path = Path(path)
    return out


def is_state_file(error: SaveError) -> bool:
    """Whether the failed write was part of a resumable state folder (``*-state``)."""
    path = getattr(error, "path", None)
    return path is not None and any(part.endswith(("-state", "-state.partial")) for part in path.parts)


def is_write_failure(error: BaseException) -> bool:
    """OSError (ENOSPC, EIO, EACCES, ...), or what torch.save / safetensors raise when the disk fails under them."""
    if isinstance(error, OSError):
        return True
    text = str(error)
    torch_write = isinstance(error, RuntimeError) and any(
        m in text for m in ("PytorchStreamWriter failed", "file write failed", "unexpected pos")
    )
    return torch_write or _os_error_inside(error) is not None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed onto ``path``, on error it is removed.
    A failed write (disk full, I/O error) raises :class:`SaveError` naming ``path``."""
    path = Path(path)
    tmp_path = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        yield tmp_path
        if tmp_path.exists():  # mkstemp makes the file 0600; give it the permissions a plain open() would
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
    except Exception as e:
        if is_write_failure(e):
            raise save_error(path, e) from e
        raise
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def load_state_dict(path: str | os.PathLike, device: str = "cpu") -> tuple[dict[str, Tensor], dict[str, str]]:
    """Load a weight file. Returns ``(state_dict, metadata)``.

    A pickle checkpoint whose top level is ``{"state_dict": {...}}`` (the usual ``.ckpt`` layout) is unwrapped; its
    other top-level entries that are strings or numbers (``epoch``, ``global_step``, metadata written by
    :func:`save_state_dict`) become the metadata, as strings. Plain pickled dicts have no metadata.
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file and what to do.
    """
    path = Path(path)
    if not path.is_file():
        hint = " (it is a folder; pass a weight file)" if path.is_dir() else ""
        raise FileNotFoundError(f"{path}: no such file{hint}")
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        from safetensors import safe_open

        try:
            if mmap_disabled():
                return _read_whole_safetensors(path, device)
            with safe_open(str(path), framework="pt", device=device) as f:
                metadata = dict(f.metadata() or {})
                return {k: f.get_tensor(k) for k in f.keys()}, metadata
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{path}: not a valid safetensors file ({e})") from e
    if suffix in PICKLE_SUFFIXES:
        return _load_pickle(path, device)
    raise ValueError(
        f"{path}: unsupported weight file type {suffix!r}; expected .safetensors or a pickle checkpoint "
        f"({', '.join(PICKLE_SUFFIXES)})"
    )


class SafetensorsReader(Mapping):
    """A safetensors file as a read-only mapping that reads a tensor when it is asked for, with ordinary reads (no
    memory map, whose touched pages would stay resident until the whole file is closed). Loading a model into
    another dtype then holds one source tensor at a time, never a second copy of the model."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries, self.start = header, 8 + size

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.entries[key]["shape"])

    def __getitem__(self, key: str) -> Tensor:
        entry = self.entries[key]
        begin, end = entry["data_offsets"]
        dtype = self.DTYPES[entry["dtype"]]
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        data = bytearray(end - begin)
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            f.readinto(data)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _load_pickle(path: Path, device: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        obj = torch.load(str(path), map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: this pickle checkpoint contains objects other than tensors and plain data, and loading it "
            "could run arbitrary code, so it was refused (torch.load weights_only=True). If you trust the file, "
            "convert it once to safetensors in a separate, isolated environment, e.g. "
            "`python -c \"import torch, safetensors.torch as st; sd = torch.load('in.ckpt', weights_only=False); "
            "sd = sd.get('state_dict', sd); st.save_file({k: v.contiguous() for k, v in sd.items() "
            "if isinstance(v, torch.Tensor)}, 'out.safetensors')\"`, then use the .safetensors file."
        ) from e
    except Exception as e:
        raise ValueError(f"{path}: could not read the checkpoint ({type(e).__name__}: {e})") from e
    metadata: dict[str, str] = {}
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        metadata = {str(k): str(v) for k, v in obj.items() if isinstance(v, str | int | float) and k != "state_dict"}
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    return {k: v for k, v in obj.items() if isinstance(v, Tensor)}, metadata


@contextlib.contextmanager
def streamed_saves(enabled: bool = True) -> Iterator[None]:
    """Inside: :func:`save_state_dict` writes ``.safetensors`` files tensor by tensor (``--mem_eff_save``)."""
    token = _STREAMED.set(enabled)
    try:
        yield
    finally:
        _STREAMED.reset(token)


def _for_file(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu").contiguous()


def write_safetensors_streamed(
    state: Mapping[str, Tensor], path: Path, metadata: Mapping[str, str] | None, dtype: torch.dtype | None
) -> None:
    """A safetensors file (its format: an 8-byte little-endian header length, the JSON header of every tensor's dtype,
    shape and byte range, then the bytes) written one tensor at a time: at most one converted tensor is in memory
    besides ``state`` (whose values may be computed on access, e.g. the BFL view of a diffusers transformer). The
    values are taken twice (shapes for the header, then the bytes). Tensors are laid out in key order."""
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for key in sorted(state):
        t = _for_file(state[key], dtype)
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        del t
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (as safetensors writes)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for key in sorted(state):
            t = _for_file(state[key], dtype)
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            del t


def save_state_dict(
    state_dict: dict[str, Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
    wrap_ckpt: bool = True,
) -> Path:
    """Write ``state_dict`` atomically as safetensors (with ``metadata``) or as a pickle (``.ckpt``/``.pt``).

    ``dtype`` converts floating-point tensors (e.g. ``torch.float16`` for ``--save_precision fp16``). Pickle files
    hold ``{"state_dict": ..., **metadata}`` for ``.ckpt`` (the layout every SD tool reads for full models; metadata
    values are plain strings next to the state dict) and the plain dict of tensors for ``.pt`` (metadata is dropped
    there). Inside :func:`streamed_saves` a ``.safetensors`` file is written tensor by tensor
    (:func:`write_safetensors_streamed`). ``wrap_ckpt=False`` writes the plain dict for ``.ckpt`` too: adapter files (sd-scripts, diffusers, A1111
    and ComfyUI read LoRA pickles as a plain dict of tensors).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES and _STREAMED.get():  # --mem_eff_save
        with atomic_path(path) as tmp:
            write_safetensors_streamed(state_dict, tmp, metadata, dtype)
        return path
    tensors = {k: _for_file(v, dtype) for k, v in state_dict.items()}
    with atomic_path(path) as tmp:
        if suffix in SAFETENSORS_SUFFIXES:
            from safetensors.torch import save_file

            meta = {str(k): str(v) for k, v in (metadata or {}).items()}
            save_file(tensors, str(tmp), metadata=meta or None)
        elif suffix in PICKLE_SUFFIXES:
            meta = {str(k): str(v) for k, v in (metadata or {}).items() if k != "state_dict"}
            wrapped = suffix == ".ckpt" and wrap_ckpt
            torch.save({"state_dict": tensors, **meta} if wrapped else tensors, str(tmp))
        else:
            raise ValueError(f"{path}: cannot save as {suffix!r}; use .safetensors, .ckpt or .pt")
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file without reading its tensors (``{}`` for other files)."""
    path = Path(path)
    if path.suffix.lower() not in SAFETENSORS_SUFFIXES:
        return {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
