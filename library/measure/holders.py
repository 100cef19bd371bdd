"""What holds the device at a phase's peak: weights per part, trained parameters, their gradients, optimizer state,
and the rest (activations, temporaries, gradients already freed), for ``--plan_memory``'s table.

:class:`PeakHolders` is mixed into the simulated device: whenever a phase's device bytes pass the last snapshot by
1 % it keeps the set of storages alive (so a snapshot is within 1 % of the phase's peak), and at the phase's end it
names each storage of the snapshot by what owns it: the loaded parts (``Parts``) as they were at the snapshot,
the run's optimizers (their state, their parameters: what trains, and their ``.grad``). A storage
freed before the phase ends (other than a part's weight) counts as activations and temporaries.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from library.measure.phases import PHASES

GROWTH = 1.01  # a new snapshot when the device holds 1 % more than the last one
REST = "activations and temporaries"


def _keys(tensors: Any) -> set[int]:
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_meta:
            out.add(t.untyped_storage()._cdata)
    return out


def _tensor_holders(module: torch.nn.Module | None) -> list[weakref.ref]:
    """``module`` and its submodules that hold parameters or buffers, weakly (the plan keeps nothing alive): their
    tensors are read anew at each snapshot, following a weight that is moved or replaced (``.to()``, a float8 cast)
    without walking the module tree again."""
    if module is None:
        return []
    return [weakref.ref(m) for m in module.modules() if m._parameters or m._buffers]


def _held_keys(holders: list[weakref.ref]) -> set[int]:
    modules = [m for m in (ref() for ref in holders) if m is not None]
    return _keys(t for m in modules for d in (m._parameters, m._buffers) for t in d.values())


class PeakHolders:
    """Snapshots of the device's storages near each phase's peak, and their owners (module docstring)."""

    def __init__(self) -> None:
        self._parts: Any = None  # the run's loaded Parts, set by the plan when the model is loaded
        self._part_dicts: list[tuple[str, list[weakref.ref]]] | None = None  # their modules (walked once)
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # the run's optimizers (the plan tells them)
        self._snap: dict[int, int] = {}
        self._snap_parts: dict[int, str] = {}
        self.before: set[int] = set()  # storages alive before the run (not the run's; none in a fresh process)
        self._snap_bytes = 0
        self.holders: dict[str, dict[str, int]] = {}  # phase -> owner -> bytes
        self._best: dict[str, int] = {}

    @property
    def parts(self) -> Any:
        return self._parts

    @parts.setter
    def parts(self, parts: Any) -> None:
        self._parts, self._part_dicts = parts, None

    def snapshot(self, live: dict[int, tuple[str, int]], device: str, total: int) -> None:
        if total > self._snap_bytes * GROWTH or not self._snap:
            self._snap = {k: size for k, (where, size) in live.items() if where == device and k not in self.before}
            self._snap_bytes = total
            # a part on the device now may be back on the host at the end; an empty snapshot names nothing (close()
            # skips it), so the walk is left out: a phase with nothing on the device (the host work of a caching
            # phase) would otherwise walk the parts at every host tensor made
            self._snap_parts = self._part_owners() if self._snap else {}

    def restart(self, live: dict[int, tuple[str, int]], device: str, total: int) -> None:
        self._snap, self._snap_bytes = {}, 0
        self._part_dicts = None  # a phase may have added modules (an adapter, a swap wrapper): walk the tree again
        self.snapshot(live, device, total)

    def close(self, phase: str, peak: int) -> bool:
        """The phase ends (or its peak is read): name the snapshot's storages when this is the phase's highest
        (returns whether it was)."""
        if peak < self._best.get(phase, -1) or not self._snap:
            return False
        self._best[phase] = peak
        owners = self._owners()
        named: dict[str, int] = {}
        for key, size in self._snap.items():
            owner = owners.get(key, REST)
            named[owner] = named.get(owner, 0) + size
        named[REST] = named.get(REST, 0) + max(0, peak - self._snap_bytes)  # within 1 % of the peak
        self.holders[phase] = {k: v for k, v in sorted(named.items(), key=lambda kv: -kv[1]) if v}
        return True

    def _owners(self) -> dict[int, str]:
        owners: dict[int, str] = {}
        for opt in list(self.optimizers):
            for state in opt.state.values():
                for key in _keys(state.values() if isinstance(state, dict) else []):
                    owners[key] = "optimizer state"
            trained = [p for group in opt.param_groups for p in group["params"]]
            for key in _keys(p.grad for p in trained if p.grad is not None):
                owners[key] = "gradients"
            for key in _keys(trained):
                owners[key] = "trained parameters"
        for key, label in self._snap_parts.items():
            owners.setdefault(key, label)
        return owners

    def _part_owners(self) -> dict[int, str]:
        owners: dict[int, str] = {}
        parts = self._parts
        if parts is None:
            return owners
        if self._part_dicts is None:
            named = [("denoiser weights", parts.denoiser), ("VAE weights", parts.vae)]
            named += [("text encoder weights", te) for te in parts.text_encoders]
            self._part_dicts = [(label, _tensor_holders(module)) for label, module in named]
        for label, dicts in self._part_dicts:
            for key in _held_keys(dicts):
                owners.setdefault(key, label)
        return owners

    def table(self) -> dict[str, dict[str, float]]:
        mib = 2.0**20
        return {p: {k: round(v / mib, 1) for k, v in self.holders[p].items()} for p in PHASES if p in self.holders}
