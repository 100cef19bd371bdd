"""The plan's numbers (a dict, the JSON of ``--plan_memory_json``) and its printed table."""

from __future__ import annotations

from typing import Any

from library.measure.calibration import PhaseFacts, from_measurements, reserved_bytes
from library.measure.phases import PHASES

MIB = 2.0**20
GIB = 2.0**30


def build(sim: Any, flags: dict[str, Any]) -> dict:
    """The plan of a finished planned run (``sim``: the plan's simulated device)."""
    device = sim.phases.table(scale=1.0)  # closes the last phase
    before = sim.baseline_bytes.get("meta", 0)  # device tensors alive before the run (none in a fresh process)
    cal = from_measurements()
    phases = {}
    for phase in PHASES:
        if phase not in device:
            continue
        counted = int(device[phase]) - before
        terms = reserved_bytes(counted, sim.facts.get(phase, PhaseFacts()), cal)
        host, pinned = sim.host_peak_bytes.get(phase, 0), sim.host_pinned_bytes.get(phase, 0)
        pageable = sim.host_pageable_bytes.get(phase, 0)
        phases[phase] = {
            "device_bytes": counted,
            "device_mib": round(counted / MIB, 1),
            "cuda_allocated_mib": round(terms["allocated"] / MIB, 1),
            "cuda_reserved_mib": round(terms["reserved"] / MIB, 1),
            "host_mib": round(host / MIB, 1),
            "host_bytes": host,
            # the most pinned (page-locked: block swap's weights, the loader's batch; never swapped out) and the most
            # pageable host bytes alive at once; host_mib is the most of both together (at most their sum)
            "host_pinned_bytes": pinned,
            "host_pinned_mib": round(pinned / MIB, 1),
            "host_pageable_mib": round(pageable / MIB, 1),
            "holders_mib": {k: round(v / MIB, 1) for k, v in sim.holders.get(phase, {}).items()},
            "calibration_mib": {k: round(v / MIB, 1) for k, v in terms.items() if k not in ("counted", "card")},
        }
    highest = max(phases.values(), key=lambda p: p["cuda_reserved_mib"])
    card_mib = highest["cuda_reserved_mib"] + cal.context_mib
    plan = {
        "phases": phases,
        "device_peak_mib": max(p["device_mib"] for p in phases.values()),
        "cuda_reserved_peak_mib": highest["cuda_reserved_mib"],
        "card_peak_mib": round(card_mib, 1),
        "host_peak_mib": max(p["host_mib"] for p in phases.values()),
        "host_pinned_peak_mib": max(p["host_pinned_mib"] for p in phases.values()),
        "context_mib": cal.context_mib,
        "device_reads_by_host": sim.host_reads,
    }
    if flags.get("vram") is not None:
        plan["vram_gib"] = flags["vram"]
        plan["fits_vram"] = card_mib <= flags["vram"] * 1024
    if flags.get("ram") is not None:
        plan["ram_gib"] = flags["ram"]
        plan["fits_ram"] = plan["host_peak_mib"] <= flags["ram"] * 1024
    return plan


def _size(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def _ram_verdict(plan: dict) -> str:
    verdict = "fit" if plan["fits_ram"] else "do NOT fit"
    line = f"--ram {plan['ram_gib']:g}: the host tensors {verdict} (the interpreter and libraries add ~2 GiB)"
    pinned = plan.get("host_pinned_peak_mib", 0)
    if pinned:
        share = pinned / (plan["ram_gib"] * 1024)
        crowded = ", which leaves little to the rest of the system" if share > 0.5 else ""
        line += (f"; {_size(pinned)} of them are pinned (page-locked: the system cannot swap them out, "
                 f"{share:.0%} of the RAM{crowded})")  # fmt: skip
    return line


def lines(plan: dict) -> list[str]:
    """The table: one row per phase, then what holds the device at each peak, then the verdicts."""
    out = ["", f"{'phase':<16}{'device MiB':>12}{'CUDA reserved':>15}{'host MiB':>11}{'pinned':>9}   "
               "what holds the device peak"]  # fmt: skip
    for phase, row in plan["phases"].items():
        holders = ", ".join(f"{k} {v:g}" for k, v in row["holders_mib"].items() if v) or "-"
        out.append(f"{phase:<16}{row['device_mib']:>12.1f}{row['cuda_reserved_mib']:>15.1f}{row['host_mib']:>11.1f}"
                   f"{row.get('host_pinned_mib', 0):>9.1f}   {holders}")  # fmt: skip
    out.append(f"peak on the card: {plan['card_peak_mib'] / 1024:.2f} GiB (reserved "
               f"{plan['cuda_reserved_peak_mib'] / 1024:.2f} + CUDA context {plan['context_mib'] / 1024:.2f}); host "
               f"tensors: {plan['host_peak_mib'] / 1024:.2f} GiB, pinned (page-locked) at most "
               f"{_size(plan.get('host_pinned_peak_mib', 0))}")  # fmt: skip
    if "fits_vram" in plan:
        verdict = "fits" if plan["fits_vram"] else "does NOT fit"
        out.append(f"--vram {plan['vram_gib']:g}: {verdict}")
    if "fits_ram" in plan:
        out.append(_ram_verdict(plan))
    return out
