"""The host process: glibc heap settings (freed memory returned to the system, or kept for reuse by small models)
and the CPU thread count a run on the CPU uses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

TINY_MODEL_PARAMS = 50_000_000  # tiny test/demo models have a few million; SD1's UNet alone has 860 million


MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value: blocks this large or larger get their own mapping
TRIM_THRESHOLD = 64 << 20  # the heap's top is given back only past 64 MiB: small blocks are not faulted in each step
HEAP_REUSE_THRESHOLD = 32 << 20  # glibc's ceiling for its moving threshold: blocks below it are reused from the heap

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h


def _mallopt(*settings: tuple[int, int]) -> bool:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in settings)  # 1 on success
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to set
        return False


def return_freed_memory(device: torch.device) -> bool:
    """On CPU with glibc: serve every allocation of 128 KiB or more from its own mapping, so that a freed activation
    goes back to the system at once. glibc's default raises this threshold (up to 32 MiB) each time such a block is
    freed and then keeps later blocks in its heap, where they stay resident: about 1.5 GiB of a real-size SD1.5
    step's peak RSS. The heap's top is trimmed only past 64 MiB, so the small blocks a step frees and takes again are
    not faulted in every step. The numbers computed do not change; the price is that the next step faults the large
    blocks in again (docs/training.md, "The price of the lower peak on CPU"), so only ``--lowram`` asks for it.
    Called before the model loads (the load peaks too); :func:`reuse_heap_for_small_models` undoes it for tiny
    models. ``MALLOC_MMAP_THRESHOLD_`` in the environment wins. Returns whether the setting was made."""
    if device.type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return _mallopt((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def reuse_heap_for_small_models(device: torch.device, model_params: int) -> bool:
    """After :func:`return_freed_memory`, for a tiny model (under ``TINY_MODEL_PARAMS``): serve blocks under 32 MiB
    from the heap again, as glibc's default does once it has warmed up. A tiny model's blocks are small, so returning
    them saves nothing, and mapping each one anew costs ~15 % of its step (measured on the tiny SD1 model). Returns
    whether the setting was made."""
    if device.type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ or model_params >= TINY_MODEL_PARAMS:
        return False
    return _mallopt((M_MMAP_THRESHOLD, HEAP_REUSE_THRESHOLD))


def choose_cpu_threads(device: torch.device, model_params: int, num_processes: int = 1) -> str:
    """Set torch's CPU thread count for training on the CPU and say why (one start-up line).

    ``OMP_NUM_THREADS`` (which ``accelerate launch --num_cpu_threads_per_process`` sets) is honoured as given.
    Otherwise a tiny model gets one thread: its matrices are too small to split, and extra threads only spin, up to
    ~300x slower on a busy machine (measured on the tiny test models); a real model gets the machine's cores shared by
    the processes. On a GPU nothing changes (the CPU only feeds data).
    """
    if device.type != "cpu":
        return f"CPU threads: {torch.get_num_threads()} (training on {device.type})"
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.strip().isdigit() and int(env) > 0:
        torch.set_num_threads(int(env))
        why = "from OMP_NUM_THREADS / accelerate launch --num_cpu_threads_per_process"
    elif model_params < TINY_MODEL_PARAMS:
        torch.set_num_threads(1)
        why = "a tiny model: more threads only wait on each other; set OMP_NUM_THREADS to change"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, num_processes)))
        why = (
            f"the machine's {os.cpu_count()} CPUs shared by {num_processes} process(es); set OMP_NUM_THREADS to change"
        )
    return f"CPU threads: {torch.get_num_threads()} ({why})"


# device types whose host copies are pinned (page-locked, for asynchronous copies): CUDA's, and the simulated device's
# while it stands for a CUDA card (library/measure/simulated_device.py counts the pinned bytes)
PINNING_DEVICES = {"cuda"}


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether the host copies made for ``device`` are pinned (block swap's weights, the loader's batches)."""
    return torch.device(device).type in PINNING_DEVICES


@contextlib.contextmanager
def pinning_on(device_type: str) -> Iterator[None]:
    """Inside, host copies made for ``device_type`` are pinned as for CUDA (the simulated device's)."""
    added = device_type not in PINNING_DEVICES
    PINNING_DEVICES.add(device_type)
    try:
        yield
    finally:
        if added:
            PINNING_DEVICES.discard(device_type)
