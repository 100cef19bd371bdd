"""Warn before the model load exhausts the host's memory: a lower bound of what the load holds, from the weight
files' headers, against the memory the system has available.

A FLUX.1 LoRA fails on a 32 GB machine and works on a 64 GB one: the load holds every part (denoiser, text encoders,
autoencoder) on the host at once, and a host without room for them swaps for minutes or has the process killed by
the kernel's OOM killer with no word. ``--plan_memory --ram GB`` tells the whole run's host peak, but costs seconds
at real size; this check costs a header read per file (no tensor data is read: a file cut after its header gives the
same bound) and runs before every load.

The bound (:func:`load_bound`):

* the files: those the family names (its optional ``load_files(path, vae, options)``), else the model path (a single
  file, or every weight file of a diffusers folder, a ``.fp16`` / ``.bf16`` variant left out when the plain file is
  beside it), ``--vae``, and every option of the family's options object that names an existing weight file or a
  folder holding weight files (``--clip_l``, ``--t5xxl``, ``--ae``, ``--text_encoder``, ...; a family lists the
  options it reads only later, e.g. for sampling, in its ``options_read_later``);
* the bytes: every tensor's element count (dtype x shape from the safetensors header) at the size it is held in on
  the host while loading: the loaders cast each floating tensor to its part's dtype as it is read, and the float8
  storage of ``--fp8_base`` is made after the whole load, so floating tensors count at the smallest of the run's part
  dtypes (exact when every part loads in the mixed-precision dtype, a LoRA's usual case; a lower bound otherwise),
  other tensors as stored; a pickle checkpoint (``.ckpt`` / ``.bin``) counts its file size (unpickled whole);
* all of it at once: every loader keeps each part it has read until the load returns them together, so the largest
  simultaneous set is the sum (times the processes of this machine, ``LOCAL_WORLD_SIZE``: each keeps its copy).

The warning (once, before anything is read; console and, with trackers, ``memory/warning``) is given when the bound
plus :data:`OVERHEAD` (the interpreter, torch and the libraries a started run holds before its load) exceeds the
available memory (``MemAvailable``); it names the files and their GiB, the available memory and free swap, the likely
outcome and what helps. The run is never refused: with swap it may still finish. ``--lowram`` on a GPU loads each
weight straight onto the card, so the host holds no load and nothing is checked; ``--no_memory_watch`` turns the
check off, and a ``--plan_memory`` plan (which counts the whole run's host peak itself) skips it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.cli import plan_flags
from library.files.weights import PICKLE_SUFFIXES, SAFETENSORS_SUFFIXES
from library.run.memory_watch import GiB, HostMemory, host_memory

logger = logging.getLogger("sdtrain")
WEIGHTS = SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES
VARIANTS = (".fp16", ".bf16", ".fp32")
# RSS of a started run just before its load (interpreter, torch, diffusers, transformers, accelerate, the dataset's
# records): 543 MiB measured on Linux / torch 2.13 CPU (a train_network.py LoRA run; docs/training.md); a CUDA run adds
# its runtime's host side on top, so this keeps the whole check a lower bound
OVERHEAD = 544 * 2**20
ITEM_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip
FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True)
class FileBytes:
    path: Path
    bytes: int


def header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor entries (dtype, shape): its first 8 + N bytes only."""
    with open(path, "rb") as f:
        entries = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    entries.pop("__metadata__", None)
    return entries


def held_bytes(path: Path, float_size: int) -> int:
    """The bytes ``path``'s tensors take on the host while loading (floating tensors at ``float_size`` bytes per
    element, others as stored); a pickle checkpoint: its size."""
    if path.suffix.lower() not in SAFETENSORS_SUFFIXES:
        return path.stat().st_size
    total = 0
    for entry in header(path).values():
        numel = 1
        for n in entry["shape"]:
            numel *= n
        total += numel * (float_size if entry["dtype"] in FLOATING else ITEM_SIZE.get(entry["dtype"], 1))
    return total


def folder_weights(folder: Path) -> list[Path]:
    """The weight files a diffusers / transformers folder's loader reads: safetensors where a folder has them (else
    its pickles), a dtype variant (``model.fp16.safetensors``) only when the plain file is not beside it."""
    found: list[Path] = []
    for sub in sorted({p.parent for p in folder.rglob("*") if p.suffix.lower() in WEIGHTS}):
        files = sorted(p for p in sub.iterdir() if p.is_file() and p.suffix.lower() in WEIGHTS)
        safe = [p for p in files if p.suffix.lower() in SAFETENSORS_SUFFIXES]
        files = safe or files
        names = {p.name for p in files}
        for p in files:
            stem = Path(p.stem)
            if stem.suffix in VARIANTS and f"{stem.stem}{p.suffix}" in names:
                continue
            found.append(p)
    return found


def weight_files(paths: Iterable[str | Path | None]) -> list[Path]:
    """The weight files of ``paths`` (files and folders; None, missing paths and other files left out), once each."""
    out: list[Path] = []
    for p in paths:
        if not isinstance(p, (str, Path)) or not str(p):
            continue
        p = Path(p)
        files = folder_weights(p) if p.is_dir() else [p] if p.is_file() and p.suffix.lower() in WEIGHTS else []
        out.extend(f for f in files if f.resolve() not in {o.resolve() for o in out})
    return out


def files_read(family: Any, path: str | Path, vae: str | None, options: Any) -> list[Path]:
    """The weight files ``family``'s load reads (see the module docstring)."""
    named = getattr(family, "load_files", None)
    if named is not None:
        return weight_files(named(path, vae, options))
    later = set(getattr(family, "options_read_later", ()))
    fields = dataclasses.fields(options) if dataclasses.is_dataclass(options) else ()
    extra = [getattr(options, f.name) for f in fields if f.name not in later]
    return weight_files([path, vae, *[v for v in extra if isinstance(v, (str, Path))]])


def load_bound(files: Sequence[Path], dtypes: Iterable[torch.dtype]) -> list[FileBytes]:
    """Each file's held bytes, floating tensors at the smallest of ``dtypes`` (the run's part dtypes)."""
    float_size = min(torch.empty((), dtype=d).element_size() for d in dtypes)
    return [FileBytes(f, held_bytes(f, float_size)) for f in files]


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def warning(found: Sequence[FileBytes], host: HostMemory, swap_free: int | None, advice: str) -> str | None:
    """The warning when the load (plus :data:`OVERHEAD`) needs more than ``host.available``, else None."""
    need = sum(f.bytes for f in found)
    if need + OVERHEAD <= host.available:
        return None
    parts = ", ".join(f"{f.path.parent.name}/{f.path.name} {size(f.bytes)}" for f in found)
    swap = f"; {swap_free / GiB:.1f} GiB of swap free" if swap_free is not None else ""
    return (f"memory watch (before loading): loading the model holds at least {size(need)} on the host "
            f"({parts}), plus {size(OVERHEAD)} for the interpreter and libraries, but only "
            f"{host.available / GiB:.2f} of {host.total / GiB:.1f} GiB are available{swap}. The load will likely swap "
            f"(minutes, a slow run) or be killed by the system's out-of-memory killer. {advice}")  # fmt: skip


def advice(given: dict[str, Any], cuda: bool) -> str:
    """What lowers the load's host bytes in sdtrain (those already given left out)."""
    ways = []
    if cuda and not given.get("lowram"):
        ways.append("--lowram (each weight goes straight onto the GPU as it is read: the host never holds the model)")
    if str(given.get("mixed_precision", "no")) not in ("bf16", "fp16"):
        ways.append("--mixed_precision bf16 (frozen parts load in bf16, not fp32)")
    ways.append("closing other programs, or more swap")
    return (f"To need less host memory while loading: {'; '.join(ways)}. For the whole run's host peak: "
            f"--plan_memory --ram GB.")  # fmt: skip


def swap_free() -> int | None:
    """Free swap in bytes (psutil, else /proc/meminfo), None when unknown."""
    try:
        import psutil

        return psutil.swap_memory().free
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapFree:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def check_before_load(
    cfg: Any, accelerator: Any, dtypes: Iterable[torch.dtype], read_host: Callable[[], HostMemory | None] | None = None
) -> str | None:
    """Warn once in the console when the load will not fit the available host memory (see the module docstring);
    returns the warning (training sends it to the trackers with the first step: ``MemoryWatch.report``)."""
    cuda = getattr(accelerator.device, "type", None) == "cuda"
    skipped = plan_flags.in_plan() or not cfg.memory_watch.enabled or (cfg.run.lowram and cuda)
    if skipped or not accelerator.is_local_main_process:
        return None
    host = (read_host or host_memory)()
    if host is None:
        return None
    try:
        files = files_read(cfg.family, cfg.model.path, cfg.model.vae, cfg.options)
        found = load_bound(files, dtypes)
        copies = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # each process of this machine keeps its own copy
        found = [FileBytes(f.path, f.bytes * copies) for f in found]
    except (OSError, ValueError, KeyError) as e:  # an unreadable header: the load itself says what is wrong
        logger.debug("host memory check before loading skipped: %s", e)
        return None
    message = warning(found, host, swap_free(), advice(dict(cfg.args or {}), cuda))
    if message is None:
        return None
    logger.warning(message)
    return message
