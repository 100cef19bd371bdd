"""The phases of a training run, for measuring device memory phase by phase (benchmarks and the simulated device).

A run goes load -> latent caching -> text caching -> step; sampling rounds and saves happen inside the step phase
and return to it. :func:`instrumented` wraps the functions that start each phase (library/run/run_setup.py and the
Trainer's ``sample`` / ``save_model`` / ``save_state``) so that a :class:`PhasePeaks` sees every change; it reads
and resets a peak through two callables, so the same bookkeeping serves ``torch.cuda.max_memory_allocated`` on a GPU
and the meta-device byte count of library/measure/simulated_device.py.

Nothing in a normal run imports this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

PHASES = ("load", "latent caching", "text caching", "step", "sampling", "save")


class PhasePeaks:
    """Peak bytes per phase: ``read_peak()`` gives the peak since the last ``reset_peak()``."""

    def __init__(self, read_peak: Callable[[], int], reset_peak: Callable[[], None]) -> None:
        self.read_peak, self.reset_peak = read_peak, reset_peak
        self.phase = "setup"  # reading the configuration, before the model loads: not a phase of the table (its
        # checks may build the released architecture's skeleton on meta, which is no device memory)
        self.peaks: dict[str, int] = {}
        self.listeners: list[Callable[[str], None]] = []  # told the new phase at every change

    def _close(self) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.read_peak())

    def switch(self, phase: str) -> None:
        """End the current phase (its peak is kept) and start ``phase`` from what is alive now."""
        self._close()
        self.phase = phase
        self.reset_peak()
        for listener in self.listeners:
            listener(phase)

    @contextlib.contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """``phase`` for the block, then back to the phase it interrupted."""
        previous = self.phase
        self.switch(phase)
        try:
            yield
        finally:
            self.switch(previous)

    def table(self, scale: float = 2.0**20) -> dict[str, float]:
        """Peak per phase in MiB (or ``scale`` units), in run order."""
        self._close()
        return {p: round(self.peaks[p] / scale, 1) for p in PHASES if p in self.peaks}


def _wrap(owner: Any, name: str, phase: str, peaks: PhasePeaks, undo: list, stays: bool) -> None:
    original = getattr(owner, name, None)
    if original is None:  # an older layout of the run (benchmarks run them too)
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if stays:
            peaks.switch(phase)
            return original(*args, **kwargs)
        with peaks.within(phase):
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    undo.append((owner, name, original))


@contextlib.contextmanager
def instrumented(peaks: PhasePeaks) -> Iterator[PhasePeaks]:
    """Training runs started inside the block report their phases to ``peaks`` (in-process runs only)."""
    from library.run import setup as run_setup
    from library.run.trainer import Trainer

    undo: list[tuple[Any, str, Any]] = []
    _wrap(run_setup, "load_model", "load", peaks, undo, stays=True)
    _wrap(run_setup, "fill_latent_cache", "latent caching", peaks, undo, stays=False)
    _wrap(run_setup, "fill_text_cache", "text caching", peaks, undo, stays=False)
    if not hasattr(run_setup, "fill_latent_cache"):  # before the caches were split: one caching phase
        _wrap(run_setup, "fill_caches", "latent caching", peaks, undo, stays=False)
    _wrap(run_setup, "place_for_training", "step", peaks, undo, stays=True)
    if not hasattr(run_setup, "place_for_training"):
        _wrap(run_setup, "release_unused_parts", "step", peaks, undo, stays=True)
    _wrap(Trainer, "sample", "sampling", peaks, undo, stays=False)
    _wrap(Trainer, "save_model", "save", peaks, undo, stays=False)
    _wrap(Trainer, "save_state", "save", peaks, undo, stays=False)
    try:
        yield peaks
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def cuda_phase_peaks(also: dict[str, dict[str, int]] | None = None) -> PhasePeaks:
    """``torch.cuda.max_memory_allocated`` per phase (synchronized at every change). ``also``, when given, receives
    per phase ``max_memory_reserved`` (the caching allocator's peak: what the card must hold) and ``device_used``
    (total minus free as the driver reports it when the phase ends: reserved plus the CUDA context, cuBLAS
    workspaces and other processes), in bytes: what the planner's calibration is set from."""
    import torch

    def reset() -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def read() -> int:
        if also is not None:
            free, total = torch.cuda.mem_get_info()
            phase = also.setdefault(peaks.phase, {})
            phase["reserved"] = max(phase.get("reserved", 0), torch.cuda.max_memory_reserved())
            phase["device_used"] = max(phase.get("device_used", 0), total - free)
        return torch.cuda.max_memory_allocated()

    peaks = PhasePeaks(read, reset)
    return peaks
