"""A stand-in for the GPU on a machine without one: the ``meta`` device as the accelerator's device.

A training run under :func:`simulated_device` runs unchanged (load -> latent caching -> text caching -> steps ->
sampling -> save), except that ``accelerator.device`` is ``meta``: everything the run puts on the device has real
shapes, dtypes and lifetimes but no values, so a real-size SDXL step at 1024 px costs no memory and no time here.
On top of that the mode enforces what CUDA enforces and counts what the device would hold:

* an operator whose tensors are on different devices fails, as on CUDA (0-dim CPU scalars and copies between
  devices are allowed, as there). Meta kernels alone do not check this (``conv2d`` of a meta input with CPU
  weights quietly gives a meta output);
* heavy compute (matmul, convolution, attention) on host tensors while a device phase runs fails: a module left on
  the CPU would compute there (tens of seconds per SDXL sample), which no error on a real GPU reveals either;
* device-resident bytes (the storages on ``meta``) are counted per phase: ``load``, ``latent caching``,
  ``text caching``, ``step``, ``sampling``, ``save`` (:attr:`SimulatedDevice.phase_peak_bytes`);
* values the host reads from the device (``.item()``, ``.cpu()``, ``.tolist()``) come back as zeros (True for a
  boolean), so the code around them runs: losses read 0, samples are black, saved tensors are zeros; ``nonzero``
  answers "the first element" (samplers look their timestep up with it);
* host memory is pinned as on CUDA (library/device/host.py ``pins_host_memory`` answers True for the simulated
  device: block swap's host copies, the loader's batches): ``pin_memory()`` gives a host copy and ``is_pinned()``
  knows it, without a CUDA build. The pinned (page-locked) host bytes are counted apart from the pageable ones:
  per phase the most of each alive at once (:attr:`SimulatedDevice.host_pinned_bytes`, ``host_pageable_bytes``;
  their sum can exceed the host peak, :attr:`SimulatedDevice.host_peak_bytes`, when the two peak at different times).

Operators whose inputs are all on the device are computed once per input signature; later calls get new empty
tensors of the outputs' shapes, strides and dtypes (library/measure/meta_outputs.py: on meta nothing is computed,
and most of a planned step repeats the same operators on the same shapes).

With ``--mixed_precision fp16`` the accelerator gets a GradScaler on the simulated device, as accelerate makes one
on CUDA (it makes none on the CPU), so the fp16 paths (``--full_fp16``) run as on a GPU.

Used by tests/test_simulated_device.py and benchmarks/bench_device_memory.py (the device-memory table of
docs/training.md). Nothing in a normal run imports this module.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from library.measure.meta_outputs import MetaOutputs
from library.measure.phases import PhasePeaks, instrumented
from library.measure.tensor_memory import TensorMemory

DEVICE = torch.device("meta")
# the phases that compute on the host by design (reading the configuration, building the model, writing files)
HOST_PHASES = ("setup", "load", "save")

_aten = torch.ops.aten
# operators that move data between devices (CUDA allows mixed devices for them)
_COPIES = {
    _aten._to_copy.default,
    _aten.copy_.default,
    _aten._copy_from.default,
    _aten._copy_from_and_resize.default,
    _aten.lift_fresh.default,
    _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor,
    _aten.detach.default,
    _aten.alias.default,
}
# the operators that make a module's forward expensive: on host tensors during a device phase they mean a module
# was left on the CPU
_HEAVY = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
}
# the outputs of operators on the simulated device by input signature, shared by every run of the process
_META_OUTPUTS = MetaOutputs()
# host reads of device values: answered with zeros
_LOCAL_SCALAR = _aten._local_scalar_dense.default
# pinning host memory (a page-locked copy) and asking whether a tensor is pinned: answered here, as CUDA would
PIN_OPS = (_aten._pin_memory.default, _aten.is_pinned.default)


class DeviceMismatch(RuntimeError):
    """What CUDA raises when an operator gets tensors on different devices, raised here for the meta device."""


class SimulatedDevice(TensorMemory):
    """The dispatch mode of :func:`simulated_device` (counts bytes per device type as :class:`TensorMemory`).

    ``strict=False`` keeps the byte count and drops the two checks (to measure a run that would fail them)."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.phases = PhasePeaks(self._read_peak, self.reset_peak)
        self.host_peak_bytes: dict[str, int] = {}  # phase -> the most host tensor bytes alive at once in it
        self.host_pinned_bytes: dict[str, int] = {}  # phase -> the most pinned host bytes alive at once in it
        self.host_pageable_bytes: dict[str, int] = {}  # phase -> the most pageable host bytes alive at once in it
        self._pinned: dict[int, int] = {}  # pinned host storage (C++ object address) -> bytes, while it lives
        self.pinned_live = 0
        self._pinned_peak = self._pageable_peak = 0  # since the last reset_peak (the pageable one once pinning)
        self._pinning = False  # True once something was pinned (before that every host byte is pageable)
        self.phases.listeners.append(self._entered)
        self.host_compute_allowed = True  # loading and file writing compute on the host by design
        self.quiet = False  # True while a part is released (its meta copies are no device memory)
        self.host_reads = 0  # values the host read from the device (each one a device sync on a GPU)
        self.host_reads_by_phase: dict[str, int] = defaultdict(int)

    def __enter__(self) -> SimulatedDevice:
        """As :class:`TensorMemory`, except that tensors alive before the run (kept by an earlier run's caches in this
        process, e.g. diffusers' lru-cached RoPE tables, or what an earlier plan's objects still hold) are no memory
        of this run, on the device or on the host: a GPU run starts in a new process. They stay uncounted for their
        whole life, so a run measured after others in one process counts what it counts alone."""
        super().__enter__()
        # a copy made in one C call: storages that die meanwhile (their finalizers pop ``_live``) cannot change the
        # dictionary under the loop
        for key, (device, size) in self._live.copy().items():
            if device in (DEVICE.type, "cpu") and key in self._live:
                self._live[key] = (device, 0)
                self.live_bytes[device] -= size
        for device in (DEVICE.type, "cpu"):
            self.peak_bytes[device] = self.live_bytes[device]
        self.baseline_bytes = dict(self.live_bytes)
        return self

    @property
    def phase(self) -> str:
        return self.phases.phase

    def _read_peak(self) -> int:
        """The device peak of the phase that ends (its host peak is kept in :attr:`host_peak_bytes`)."""
        phase = self.phases.phase
        pageable = self._pageable_peak if self._pinning else self.peak_bytes["cpu"]
        for peaks, value in ((self.host_peak_bytes, self.peak_bytes["cpu"]), (self.host_pinned_bytes,
                             self._pinned_peak), (self.host_pageable_bytes, pageable)):  # fmt: skip
            peaks[phase] = max(peaks.get(phase, 0), value)
        return self.peak_bytes[DEVICE.type]

    def reset_peak(self) -> None:
        super().reset_peak()
        self._pinned_peak = self.pinned_live
        self._pageable_peak = self.live_bytes["cpu"] - self.pinned_live

    def _entered(self, phase: str) -> None:
        self.host_compute_allowed = phase in HOST_PHASES

    def phase_table(self) -> dict[str, float]:
        """Peak device-resident MiB per phase, in run order."""
        return self.phases.table()

    # ------------------------------------------------------------------------------------------------ dispatch
    def _dispatch(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if func in PIN_OPS:
            return self._pin_op(func, args)
        on_device = any(t.is_meta for t in tensors)
        if func is _LOCAL_SCALAR and on_device:
            self._host_read()
            return True if args[0].dtype == torch.bool else 0
        if func is _aten.nonzero.default and on_device:  # a data-dependent shape: the host waits for it on a GPU
            self._host_read()
            return torch.zeros((1, args[0].dim()), dtype=torch.long, device=DEVICE)
        target = _target_device(args, kwargs)
        if func is _aten._to_copy.default and on_device and target not in (None, DEVICE.type):
            self._host_read()
            source = args[0]
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype, device=target)
        if self.strict and func not in _COPIES:
            self._check_devices(func, tensors)
        if self.strict and func in _HEAVY and not on_device and not self.host_compute_allowed:
            raise DeviceMismatch(
                f"{func} computed on the host during the {self.phase!r} phase: a module that should be on the "
                f"accelerator was left on the CPU (shapes {[tuple(t.shape) for t in tensors]})"
            )
        if on_device and func in _META_FALLBACKS:
            return _META_FALLBACKS[func](*args, **kwargs)
        return super()._dispatch(func, args, kwargs, tensors)

    def _run(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if tensors and all(t.is_meta for t in tensors):  # nothing computed: outputs by input signature
            return _META_OUTPUTS(func, args, kwargs, tensors)
        return func(*args, **kwargs)

    def forget(self, module: torch.nn.Module) -> None:
        """Stop counting a module's tensors: a part freed with ``module.to("meta")`` (library/run/run_setup.py
        ``release_unused_parts``) holds no memory on a real run, though meta is the simulated device here."""
        for tensor in (*module.parameters(), *module.buffers()):
            entry = self._live.pop(tensor.untyped_storage()._cdata, None)
            if entry is not None:
                self.live_bytes[entry[0]] -= entry[1]

    def _pin_op(self, func: Any, args: tuple) -> Any:
        """``is_pinned`` / ``_pin_memory`` of a host tensor, as on CUDA: a pinned copy, counted apart."""
        source = args[0]
        if func is _aten.is_pinned.default:
            return source.untyped_storage()._cdata in self._pinned
        if source.device.type != "cpu":
            raise RuntimeError(f"cannot pin a tensor on {source.device.type}: only host tensors can be pinned")
        out = self._pinned_copy(source)
        storage = out.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if not self._pinning:  # every host byte so far was pageable
            self._pageable_peak = max(self._pageable_peak, self.peak_bytes["cpu"])
            self._pinning = True
        self._pinned[key] = size
        self.pinned_live += size
        self._pinned_peak = max(self._pinned_peak, self.pinned_live)
        weakref.finalize(storage, _unpinned, self._weak, key)
        self._track(out)
        return out

    def _pinned_copy(self, source: torch.Tensor) -> torch.Tensor:
        """The page-locked copy ``pin_memory()`` gives (here an ordinary host copy; phantoms give phantoms)."""
        out = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype)
        return out.copy_(source)

    def _unpinned(self, key: int) -> None:
        size = self._pinned.pop(key, None)
        if size is not None:
            self.pinned_live -= size

    def _track(self, tensor: torch.Tensor) -> None:
        if not self.quiet:
            super()._track(tensor)
            if self._pinning and self.live_bytes["cpu"] - self.pinned_live > self._pageable_peak:
                self._pageable_peak = self.live_bytes["cpu"] - self.pinned_live

    def _host_read(self) -> None:
        self.host_reads += 1
        self.host_reads_by_phase[self.phase] += 1

    def _check_devices(self, func: Any, tensors: list[torch.Tensor]) -> None:
        if all(t.is_meta for t in tensors):  # most of a planned run's operators: nothing to compare
            return
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise DeviceMismatch(
                f"Expected all tensors to be on the same device, but found at least two devices, {sorted(devices)} "
                f"({func}, in the {self.phase!r} phase; shapes {[(t.device.type, tuple(t.shape)) for t in tensors]})"
            )


def _unpinned(mode: weakref.ref, key: int) -> None:
    device = mode()
    if device is not None:
        device._unpinned(key)


def _target_device(args: tuple, kwargs: dict) -> str | None:
    device = kwargs.get("device")
    return torch.device(device).type if device is not None else None


def _unscale_and_check(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_`` on meta: the gradients are scaled in place, nothing is found."""
    for g in grads:
        g.mul_(inv_scale)


def _update_scale(scale: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return scale


# operators without a meta kernel that the run's device side calls (GradScaler's)
_META_FALLBACKS = {
    _aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale_and_check,
    _aten._amp_update_scale_.default: _update_scale,
}


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Inside, attention on the simulated device is counted as the fused kernel a GPU runs (on meta, torch's SDPA
    takes its math path and would hold the whole attention matrix): the flash kernel's meta function gives the
    output and its softmax statistics only. A call with ``enable_gqa=False`` (diffusers' attention dispatch passes it
    always) is the same call; so is grouped-query attention (``enable_gqa=True``) without a mask, which CUDA's flash
    kernel runs with the fewer key / value heads as they are (transformers passes ``enable_gqa`` only then: with a mask
    it repeats the key / value heads itself); with a mask it keeps torch's own path, as CUDA's fused kernels refuse
    it."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):  # noqa: ANN001
        if query.device.type != DEVICE.type or (kwargs.get("enable_gqa") and attn_mask is not None):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)  # fmt: skip
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def make_simulated(accelerator: Any) -> Any:
    """Turn an ``accelerate.Accelerator`` made for the CPU into one whose device is meta; with fp16 mixed precision
    give it the GradScaler accelerate gives CUDA runs."""
    cls = type(accelerator)
    members = {
        "device": property(lambda self: DEVICE),
        # CUDA's autocast acts on CUDA tensors only; accelerate's would be the CPU's here, and CPU autocast acts on
        # the host tensors a GPU run leaves alone (meta tensors it ignores either way)
        "autocast": lambda self, *args, **kwargs: contextlib.nullcontext(),
    }
    accelerator.__class__ = type("SimulatedAccelerator", (cls,), members)
    if accelerator.mixed_precision == "fp16" and accelerator.scaler is None:
        accelerator.scaler = torch.amp.GradScaler(DEVICE.type)
        accelerator.native_amp = True
    return accelerator


@contextlib.contextmanager
def simulated_device(strict: bool = True, mode: type[SimulatedDevice] | None = None) -> Iterator[SimulatedDevice]:
    """Run training scripts in-process with the meta device as the accelerator (see the module docstring).

    Yields the :class:`SimulatedDevice` whose ``phase_table()`` gives the device-resident peak per phase; ``mode``:
    a subclass to use instead (library/measure/phantom.py's, for plans).
    """
    from library.device import host
    from library.run import setup as run_setup

    sim = (mode or SimulatedDevice)(strict)
    make_accelerator, load_model, release = run_setup.make_accelerator, run_setup.load_model, run_setup._release

    def simulated_accelerator(*args: Any, **kwargs: Any) -> Any:
        return make_simulated(make_accelerator(*args, **kwargs))

    def loaded(*args: Any, **kwargs: Any) -> Any:
        parts = load_model(*args, **kwargs)
        gc.collect()  # loaders build their skeletons on meta too: the phase holds what stays on the device
        sim.reset_peak()
        return parts

    def released(module: Any, *args: Any) -> Any:
        peak = sim.peak_bytes[DEVICE.type]  # the meta tensors a freed host part becomes are no device memory
        sim.quiet = True  # module.to("meta") frees memory on a GPU; here meta is the device: not counted
        try:
            out = release(module, *args)
        finally:
            sim.quiet = False
        sim.forget(module)
        sim.peak_bytes[DEVICE.type] = max(peak, sim.live_bytes[DEVICE.type])
        return out

    run_setup.make_accelerator, run_setup.load_model, run_setup._release = simulated_accelerator, loaded, released
    from torch.fx.experimental import _config as fx_config

    # boolean-mask indexing on the device (a text mask) asks nonzero's meta kernel for a shape: every element
    # counts, the largest the selection can be
    try:
        with instrumented(sim.phases), sim, fx_config.patch(meta_nonzero_assume_all_nonzero=True), \
                host.pinning_on(DEVICE.type):  # fmt: skip
            yield sim
    finally:
        run_setup.make_accelerator, run_setup.load_model = make_accelerator, load_model
        run_setup._release = release
