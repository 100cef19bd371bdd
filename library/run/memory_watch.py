"""A run that notices when memory runs out: step times, device headroom and host memory, watched during training.

When a card is full, Windows' driver does not fail: it spills device memory into shared system memory ("CUDA -
Sysmem Fallback Policy") and the run goes on 10-100x slower (SDXL at 39 s/it on a 5090 at 31.2 of 31.5 GB). A host
short of RAM swaps, with the same effect. Nothing stops either; users see only a slow progress bar. So after each
optimizer step :class:`MemoryWatch` reads

* the step's time (from the end of the previous step's saves / samples / validation to the optimizer step: those
  rounds are slow by design and not counted);
* on CUDA, the card's free memory and the allocator's reserved bytes (``torch.cuda.mem_get_info``,
  ``memory_reserved``: a driver query, no synchronisation);
* every ``host_every`` steps, the host's available memory and swap in use (psutil, else ``/proc/meminfo``); also
  before and after the caches are filled (``library/run/setup.py``: :meth:`MemoryWatch.check_host`),

and warns **once per cause** (console and, with --logging_dir / --log_with, the trackers: a text entry
``memory/warning`` and the scalars ``memory/step_time_s``, ``memory/device_reserved_gib``, ``memory/device_free_gib``,
``memory/host_available_gib``):

* steps ``slowdown`` x slower than the running median of the steps before, ``consecutive`` steps in a row, after
  ``warmup`` steps (compilation, allocator growth, the first data reads);
* the card at its limit: free memory below ``margin`` (of the total; at least 256 MiB) or reserved within it;
* the host short of memory: available below ``host_low`` of the total (at least 1 GiB), or swap grown by 1 GiB.

Each warning names the likely cause and the flags that need less memory, leaving out those already given. Without
CUDA the only costs are a clock read per step and a host read every ``host_every`` steps. ``--no_memory_watch``
turns it off. Readers and the clock are injected (tests: a fake clock, a simulated full card).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("sdtrain")
GiB = 1024**3
CLOCK: Callable[[], float] = time.perf_counter  # the watch's clock (tests replace it)
PLAN = "run with --plan_memory --vram GB (--ram GB) for the exact figures"


def add_memory_watch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory watch")
    g.add_argument("--no_memory_watch", action="store_true",
                   help="do not watch step times and memory during training (no warnings when the card spills into "
                        "system memory or the host swaps, no memory/* scalars)")  # fmt: skip


@dataclass(frozen=True)
class WatchConfig:
    """The watch's switch (``--no_memory_watch``) and thresholds (see the module docstring)."""

    enabled: bool = True
    warmup: int = 5  # steps never judged
    baseline: int = 5  # normal steps needed before a step is judged
    window: int = 50  # the running median's window (normal steps)
    slowdown: float = 3.0
    consecutive: int = 4
    margin: float = 0.02  # of the card's total
    host_low: float = 0.05  # of the host's total
    host_every: int = 10

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WatchConfig:
        return cls(enabled=not getattr(args, "no_memory_watch", False))


@dataclass(frozen=True)
class DeviceMemory:
    reserved: int  # bytes the allocator holds
    free: int  # bytes free on the card (every process)
    total: int


@dataclass(frozen=True)
class HostMemory:
    available: int
    total: int
    swap_used: int


def cuda_memory(device: Any) -> Callable[[], DeviceMemory] | None:
    """A reader of ``device``'s memory when it is a CUDA device, else None (nothing to read)."""
    import torch

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None

    def read() -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(torch.cuda.memory_reserved(device), free, total)

    return read


def host_memory() -> HostMemory | None:
    """The host's available memory and swap in use (psutil, else Linux's /proc/meminfo; None when neither)."""
    try:
        import psutil
    except ImportError:
        return _proc_meminfo()
    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return HostMemory(vm.available, vm.total, swap.used)


def _proc_meminfo(path: Path = Path("/proc/meminfo")) -> HostMemory | None:
    try:
        fields = {
            k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in path.read_text().splitlines())
        }
    except (OSError, ValueError):
        return None
    swap = fields.get("SwapTotal", 0) - fields.get("SwapFree", 0)
    return HostMemory(fields.get("MemAvailable", fields.get("MemFree", 0)), fields.get("MemTotal", 0), swap)


class MemoryWatch:
    """See the module docstring. ``given``: the flags of the run (``TrainConfig.args``), left out of the advice;
    ``swappable``: the script takes ``--blocks_to_swap``."""

    def __init__(
        self,
        cfg: WatchConfig = WatchConfig(),
        *,
        clock: Callable[[], float] | None = None,
        device: Callable[[], DeviceMemory] | None = None,
        host: Callable[[], HostMemory | None] | None = host_memory,
        given: Mapping[str, Any] | None = None,
        swappable: bool = False,
    ) -> None:
        self.cfg, self.clock, self.read_device, self.read_host = cfg, clock or CLOCK, device, host
        self.given, self.swappable = dict(given or {}), swappable
        self.normal: deque[float] = deque(maxlen=cfg.window)
        self.steps = self.slow_in_a_row = 0
        self.warned: list[str] = []  # the causes warned about (each once)
        self.device: DeviceMemory | None = None
        self.host: HostMemory | None = None
        self.first_swap: int | None = None
        self.pending: list[str] = []  # warnings given before the trackers started (:meth:`report`)
        self.started = self.clock()

    def report(self, message: str | None) -> None:
        """A warning already shown in the console before training (e.g. library/run/load_memory.py's, before the
        load): sent to the trackers with the first step's values."""
        if message:
            self.pending.append(message)

    def restart(self) -> None:
        """Time from now on: what ran since the last step (saves, samples, validation) is not step time."""
        self.started = self.clock()

    def step_done(self, step: int) -> dict[str, float | str]:
        """After optimizer step ``step``: read, judge, warn; returns the tracker values (with ``memory/warning`` when
        a warning was given now)."""
        now = self.clock()
        seconds, self.started = now - self.started, now
        self.steps += 1
        values: dict[str, float | str] = {"memory/step_time_s": seconds}
        if self.read_device is not None:
            self.device = self.read_device()
            values["memory/device_reserved_gib"] = self.device.reserved / GiB
            values["memory/device_free_gib"] = self.device.free / GiB
        if self.read_host is not None and (self.steps - 1) % self.cfg.host_every == 0:
            self.host = self.read_host()
            if self.host is not None:
                self.first_swap = self.host.swap_used if self.first_swap is None else self.first_swap
                values["memory/host_available_gib"] = self.host.available / GiB
        messages = [m for m in (self._slow(step, seconds), self._card_full(step), self._host_low(step)) if m]
        for message in messages:
            logger.warning(message)
        messages, self.pending = self.pending + messages, []
        if messages:
            values["memory/warning"] = "\n\n".join(messages)
        return values

    # ------------------------------------------------------------------------------------------------ the causes
    def _once(self, cause: str) -> bool:
        if cause in self.warned:
            return False
        self.warned.append(cause)
        return True

    def _slow(self, step: int, seconds: float) -> str | None:
        if self.steps <= self.cfg.warmup:
            return None
        if len(self.normal) < self.cfg.baseline or seconds <= self.cfg.slowdown * statistics.median(self.normal):
            self.normal.append(seconds)
            self.slow_in_a_row = 0
            return None
        self.slow_in_a_row += 1
        if self.slow_in_a_row < self.cfg.consecutive or not self._once("slow"):
            return None
        median = statistics.median(self.normal)
        head = (f"memory watch: steps became {seconds / median:.0f}x slower at step {step} ({seconds:.2f} s/step, "
                f"{self.slow_in_a_row} steps in a row; {median:.2f} s before).")  # fmt: skip
        if self._card_is_full():  # the cause is told here: not again apart
            self._once("device")
            return f"{head} {self._card_text()} {self.device_advice()}"
        if self._host_is_short():
            self._once("host")
            return f"{head} {self._host_text()} {self.host_advice()}"
        return (f"{head} Likely causes: the GPU driver spilling device memory into shared system memory (Windows' "
                f"'CUDA - Sysmem Fallback Policy'; 10-100x slower), or the host swapping; or another program using "
                f"the GPU or CPU. {self.device_advice()}")  # fmt: skip

    def _card_is_full(self) -> bool:
        d = self.device
        if d is None:
            return False
        margin = max(256 * 1024**2, int(self.cfg.margin * d.total))
        return d.free < margin or d.reserved >= d.total - margin

    def _card_text(self) -> str:
        d = self.device
        return (f"The card is at its limit ({d.reserved / GiB:.1f} GiB reserved by this run, {d.free / GiB:.2f} of "
                f"{d.total / GiB:.1f} GiB free): on Windows the driver then spills device memory into shared system "
                f"memory (sysmem fallback) and steps run 10-100x slower; elsewhere the next larger allocation fails "
                f"with out of memory.")  # fmt: skip

    def _card_full(self, step: int) -> str | None:
        if not self._card_is_full() or not self._once("device"):
            return None
        return f"memory watch (step {step}): {self._card_text()} {self.device_advice()}"

    def _host_is_short(self) -> bool:
        h = self.host
        if h is None:
            return False
        swapped = self.first_swap is not None and h.swap_used - self.first_swap > GiB
        return h.available < max(GiB, int(self.cfg.host_low * h.total)) or swapped

    def _host_text(self) -> str:
        h = self.host
        grown = (h.swap_used - self.first_swap) / GiB if self.first_swap is not None else 0.0
        swap = f", swap in use grew by {grown:.1f} GiB since the run started" if grown >= 0.1 else ""
        return (f"The host is short of memory ({h.available / GiB:.1f} of {h.total / GiB:.1f} GiB available{swap}): "
                f"it swaps, and steps slow down or the system kills the run.")  # fmt: skip

    def _host_low(self, step: int | str) -> str | None:
        if not self._host_is_short() or not self._once("host"):
            return None
        return (
            f"memory watch ({'step ' if isinstance(step, int) else ''}{step}): {self._host_text()} {self.host_advice()}"
        )

    def check_host(self, when: str) -> str | None:
        """Outside the steps (``when``: e.g. "before caching"): read the host and warn if it is short (once, as in
        the steps); returns the warning."""
        if self.read_host is None:
            return None
        self.host = self.read_host()
        if self.host is None:
            return None
        self.first_swap = self.host.swap_used if self.first_swap is None else self.first_swap
        message = self._host_low(when)
        if message:
            logger.warning(message)
        return message

    # ------------------------------------------------------------------------------------------------ the advice
    def device_advice(self) -> str:
        """The flags that need less device memory, cheapest first, those already given left out."""
        flags = [("cache_latents", "--cache_latents"), ("cache_text_encoder_outputs", "--cache_text_encoder_outputs"),
                 ("gradient_checkpointing", "--gradient_checkpointing"), ("fp8_base", "--fp8_base")]  # fmt: skip
        ways = [text for name, text in flags if not self.given.get(name)]
        if self.swappable and not self.given.get("blocks_to_swap"):
            ways.append("--blocks_to_swap N")
        if "8bit" not in str(self.given.get("optimizer_type", "")).lower():
            ways.append("an 8-bit optimizer (--optimizer_type AdamW8bit)")
        if int(self.given.get("train_batch_size", 1) or 1) > 1:
            ways.append("a smaller --train_batch_size")
        options = ", ".join(ways) if ways else "a smaller --resolution or network dim"
        return f"To need less device memory: {options}; {PLAN}."

    def host_advice(self) -> str:
        """The flags that need less host memory, those already given left out."""
        ways = []
        if self.given.get("cache_latents") and not self.given.get("cache_latents_to_disk"):
            ways.append("--cache_latents_to_disk")
        if self.given.get("cache_text_encoder_outputs") and not self.given.get("cache_text_encoder_outputs_to_disk"):
            ways.append("--cache_text_encoder_outputs_to_disk")
        ways.append("fewer --max_data_loader_n_workers")
        if self.given.get("persistent_data_loader_workers"):
            ways.append("no --persistent_data_loader_workers")
        return f"To need less host memory: {', '.join(ways)}; close other programs; {PLAN}."


class Unwatched:
    """``--no_memory_watch``: no reads, no timing, no values."""

    def restart(self) -> None:
        pass

    def report(self, message: str | None) -> None:
        pass

    def step_done(self, step: int) -> dict[str, float | str]:
        return {}

    def check_host(self, when: str) -> None:
        return None


def for_run(cfg: Any, device: Any) -> MemoryWatch | Unwatched:
    """The watch of a training run (``cfg``: its ``TrainConfig``; ``device``: the accelerator's); :class:`Unwatched`
    with ``--no_memory_watch``."""
    watch_cfg = getattr(cfg, "memory_watch", WatchConfig())
    if not watch_cfg.enabled:
        return Unwatched()
    swappable = bool(getattr(cfg.family.spec, "block_swap", False)) if cfg.family is not None else False
    return MemoryWatch(watch_cfg, device=cuda_memory(device), given=cfg.args, swappable=swappable)
