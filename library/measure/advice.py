"""``--plan_memory --vram GB``: when the command does not fit the card, the cheapest changes that make it fit.

The changes are tried in this order, each on top of the ones taken before, and each is planned (library/measure/
plan.py: the command with the change, on the simulated device) until every phase fits the card:

1. cache the text-encoder outputs, 2. cache the latents (both make steps faster), 3. an 8-bit optimizer (no
step-time cost known), 4. the family's own flags for its caching phases, in the family's order (its
``caching_memory_flags``, library/families/base.py ``CachingMemoryFlag``: e.g. a text encoder stored in float8;
no step-time cost, the encoding less exact; one the planner cannot plan is only named when its phase stays over),
5. gradient checkpointing, 6. float8 base weights, 7. ``--blocks_to_swap N`` with the smallest N that fits,
8. offloaded checkpointing, 9. half the batch with twice the accumulation.

This is the order users accept them in, except that the 8-bit optimizer, which costs no step time that we know of,
comes before the changes that do: sd-scripts' own VRAM table for its 12 B DiT takes 8-bit AdamW before swapping more
blocks (its 12 GB row: ``--blocks_to_swap 16`` and 8-bit AdamW), and each block swapped more costs its copies.
Each change's cost in step time (:data:`STEPS`) says where its number comes from, or that it is not known.

A change is tried only when a phase over the card is one it lowers (``Step.lowers``: no swapped block lowers the
text encoders' caching phase), and taken only when it lowers that phase's peak. A change the script does not take
(its parser or its checks refuse it) or that is already in the command is skipped. Once the command fits, each
change taken before the last is tried away again (latest first) and dropped when the command still fits without it,
so no change is recommended that the fit does not need. Nothing here names a family: which flags a script reads is
asked of the script itself, and the family's own caching flags come with the command's plan
(``plan["caching_memory_flags"]``: library/measure/plan.py reads them from the loaded family).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from library.cli.plan_flags import changed_argv

GIB = 1024.0  # MiB
PCIE_GB_S = 25.0  # a PCIe 4.0 x16 link's pinned host-to-device copy rate (31.5 GB/s raw), for the swap's copies
RUNNING = frozenset({"step", "sampling", "save"})  # the phases with the trained model on the device


@dataclass(frozen=True)
class Step:
    label: str
    flag: str
    values: tuple[str, ...]
    lowers: frozenset[str]  # the phases the change can lower
    slowdown: float | None  # the step time it adds, a fraction (0: none known), None: not known
    cost: str  # in words, with where the number comes from


STEPS = (
    Step("cache the text-encoder outputs", "--cache_text_encoder_outputs", (), RUNNING, 0.0,
         "none: steps get faster (the encoders leave the device); captions are fixed per image"),
    Step("cache the latents", "--cache_latents", (), RUNNING, 0.0,
         "none: steps get faster; no random crop / flip per step"),
    Step("8-bit optimizer", "--optimizer_type", ("AdamW8bit",), RUNNING, 0.0,
         "none known in step time (bitsandbytes' fused 8-bit step; not measured here); the optimizer state in 8 bits"),
    Step("gradient checkpointing", "--gradient_checkpointing", (), frozenset({"step"}), 0.33,
         "up to ~33 % slower steps (the forward runs again in the backward; a backward costs about two forwards)"),
    Step("float8 base weights", "--fp8_base", (), RUNNING | {"text caching"}, None,
         "not measured: a cast of each frozen weight per forward; slightly lower precision of the frozen weights"),
    Step("block swap", "--blocks_to_swap", ("N",), RUNNING, None,
         "the copies of the swapped blocks' weights (not measured on a GPU here)"),
    Step("offloaded checkpointing", "--cpu_offload_checkpointing", (), frozenset({"step"}), 0.15,
         "about 15 % slower steps (sd-scripts' docs, 'Key VRAM Reduction Options'); the checkpoints travel to the host and back"),
    Step("half the batch, twice the accumulation", "--train_batch_size", ("HALF",), frozenset({"step"}), None,
         "not measured: twice the forward / backward calls for the same images per optimizer step"),
)  # fmt: skip


FAMILY_AT = 3  # the family's caching flags go after the changes without a step-time cost, before the costly ones


def steps_for(plan: dict) -> tuple[Step, ...]:
    """:data:`STEPS` with the family's own caching flags of ``plan`` (``caching_memory_flags``) in their place."""
    own = tuple(Step(f["label"], f["flags"][0], tuple(f["flags"][1:]), frozenset({f["phase"]}), f["step_slowdown"],
                     f["cost"]) for f in plan.get("caching_memory_flags", ()) if f.get("planned", True))  # fmt: skip
    return STEPS[:FAMILY_AT] + own + STEPS[FAMILY_AT:]


def unplanned(plan: dict, over: list[str], argv: list[str]) -> str:
    """The family's caching flags the planner cannot plan for the phases ``over`` the card (not in ``argv``), in
    words for the line that says nothing fits ("" when none)."""
    flags = [f for f in plan.get("caching_memory_flags", ()) if not f.get("planned", True) and f["phase"] in over
             and not _given(argv, f["flags"][0])]  # fmt: skip
    return "".join(f"; {f['phase']}: {' '.join(f['flags'])} ({f['label']}) lowers it, not planned here: {f['cost']}"
                   for f in flags)  # fmt: skip


def _given(argv: list[str], flag: str) -> bool:
    return any(w == flag or w.startswith(flag + "=") for w in argv)


def _value(argv: list[str], flag: str, default: str) -> str:
    """The flag's value in ``argv`` (the last one given, as argparse reads it)."""
    value = default
    for i, w in enumerate(argv):
        if w == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif w.startswith(flag + "="):
            value = w.split("=", 1)[1]
    return value


def card_peaks(plan: dict) -> dict[str, float]:
    """MiB per phase on a CUDA card: what the phase reserves plus the CUDA context (``card_peak_mib`` is the most)."""
    return {p: row["cuda_reserved_mib"] + plan["context_mib"] for p, row in plan["phases"].items()}


def device_peaks(plan: dict) -> dict[str, float]:
    """MiB of device tensors per phase (the simulated count)."""
    return {p: row["device_mib"] for p, row in plan["phases"].items()}


def advise(plan_with: Callable[[list[tuple[str, list[str]]]], dict], argv: list[str], limit_mib: float,
           out: Callable[[str], None], base: dict | None = None,
           peaks: Callable[[dict], dict[str, float]] = card_peaks) -> list[dict]:  # fmt: skip
    """Try :data:`STEPS` on ``argv`` until every phase's ``peaks`` is at most ``limit_mib`` (``plan_with(changes)``
    plans the command with ``changes``: (flag, values) pairs; ``base``: the command's own plan, planned when not
    given). Returns the changes taken, each with its plan's card peak, the phase that held it and its cost."""
    current = base if base is not None else plan_with([])
    changes: list[tuple[str, list[str]]] = []
    taken: list[dict] = []
    for step in steps_for(current):
        over = {p for p, mib in peaks(current).items() if mib > limit_mib}
        if not over:
            break
        trial = _trial(step, argv)
        if trial is None:
            continue
        if not over & step.lowers:
            out(f"  (skipped {step.flag}: it lowers {', '.join(sorted(step.lowers))}, not {', '.join(sorted(over))})")
            continue
        if step.values == ("N",):
            given = int(_value(argv, step.flag, "0"))
            found = _smallest_swap(plan_with, changes, given, current,
                                   lambda p, ph=step.lowers: max(v for k, v in peaks(p).items() if k in ph) - limit_mib)  # fmt: skip
            if found is None:
                continue
            trial, plan = [(step.flag, [str(found[0])])], found[1]
        else:
            plan = _try(plan_with, changes + trial, out)
            if plan is None:
                continue
        lowered = over & step.lowers
        if max(peaks(plan).get(p, 0.0) for p in lowered) >= max(peaks(current)[p] for p in lowered):
            out(f"  (skipped {' '.join(w for f, v in trial for w in (f, *v))}: it lowers nothing here)")
            continue
        changes += trial
        taken.append(_record(step, trial, plan, current, peaks))
        taken[-1]["over"] = sorted(p for p, mib in peaks(plan).items() if mib > limit_mib)
        out(_line(taken[-1]))
        current = plan
    if taken and _fits(peaks(current), None, limit_mib):
        _prune(plan_with, taken, limit_mib, peaks, out)
    return taken


def _trial(step: Step, argv: list[str]) -> list[tuple[str, list[str]]] | None:
    """The flags ``step`` sets on ``argv`` (the swap's N is searched: []), or None when it is not offered: the command
    has the flag already (the user's choice stands; AdamW's own 8-bit form is the one optimizer offered instead), or
    its batch is 1."""
    if step.values == ("N",):
        return []
    if step.values == ("HALF",):
        batch = int(_value(argv, step.flag, "1"))
        accumulation = int(_value(argv, "--gradient_accumulation_steps", "1"))
        return None if batch < 2 else [(step.flag, [str(batch // 2)]),
                                       ("--gradient_accumulation_steps", [str(accumulation * 2)])]  # fmt: skip
    if step.flag == "--optimizer_type":  # AdamW: the default unless --use_8bit_adam (sd-scripts' AdamW8bit)
        adamw = _value(argv, step.flag, "adamw").lower() == "adamw" and not _given(argv, "--use_8bit_adam")
        return [(step.flag, list(step.values))] if adamw else None
    return None if _given(argv, step.flag) else [(step.flag, list(step.values))]


def _fits(peaks: dict[str, float], phases: frozenset[str] | None, limit_mib: float) -> bool:
    return all(mib <= limit_mib for p, mib in peaks.items() if phases is None or p in phases)


def _try(plan_with: Callable, changes: list, out: Callable[[str], None]) -> dict | None:
    try:
        return plan_with(changes)
    except SystemExit:  # argparse: the script has no such flag
        return None
    except (ValueError, RuntimeError, NotImplementedError) as e:  # the script's checks refuse the combination
        out(f"  (skipped {' '.join(f for f, _ in changes[-1:])}: {str(e).splitlines()[-1][:160]})")
        return None


def _smallest_swap(plan_with: Callable, changes: list, given: int, current: dict, excess: Callable[[dict], float]):
    """The smallest ``--blocks_to_swap`` above the command's own N (``given``) that fits, or the largest accepted
    when none fits; None when the script swaps no blocks. ``excess(plan)``: MiB over the card (<= 0: fits). Each
    guess is the N that the MiB saved per block so far predicts (the last two plans), kept strictly between the
    largest N known not to fit and the smallest known to fit (or refused), so the search ends at adjacent N."""
    low, low_x, slope = given, excess(current), 0.0
    fit, fit_x, cap, best_any, n = None, 0.0, None, None, given + 1
    while True:
        plan = _try(plan_with, [*changes, ("--blocks_to_swap", [str(n)])], lambda line: None)
        if plan is None:  # refused: past the script's limit
            cap = n
        elif excess(plan) <= 0:
            fit, fit_x, best_any = (n, plan), excess(plan), (n, plan)
        else:
            x = excess(plan)
            slope, low, low_x, best_any = (low_x - x) / (n - low), n, x, (n, plan)
        upper = fit[0] if fit else cap
        if upper is not None and upper - low <= 1:
            return fit or best_any
        if fit:  # between the last N over and the first that fits: the straight line through both
            slope = (low_x - fit_x) / (fit[0] - low)
        guess = low + math.ceil(low_x / slope) if slope > 0 else low + max(low - given, 1)
        if upper is not None:
            guess = min(guess, upper - 1) if fit or plan is not None else (low + upper) // 2
        n = max(guess, low + 1)


def _prune(plan_with: Callable, taken: list[dict], limit_mib: float, peaks: Callable, out: Callable) -> None:
    """Drop each change before the last (latest first) that the command fits without."""
    for i in range(len(taken) - 2, -1, -1):
        rest = [c for j, t in enumerate(taken) if j != i for c in t["changes"]]
        plan = _try(plan_with, rest, lambda line: None)
        if plan is not None and _fits(peaks(plan), None, limit_mib):
            out(f"  - {' '.join(taken[i]['flags'])}: not needed once the later changes are in (card peak "
                f"{plan['card_peak_mib'] / GIB:.2f} GiB without it)")  # fmt: skip
            del taken[i]
            taken[-1]["card_peak_mib"], taken[-1]["peak_phase"] = plan["card_peak_mib"], _peak_phase(plan, peaks)


def _peak_phase(plan: dict, peaks: Callable) -> str:
    by_phase = peaks(plan)
    return max(by_phase, key=by_phase.get)


def _record(step: Step, trial: list, plan: dict, before: dict, peaks: Callable) -> dict:
    record = {"change": step.label, "flags": [w for f, v in trial for w in (f, *v)], "changes": trial,
              "card_peak_mib": plan["card_peak_mib"], "peak_phase": _peak_phase(plan, peaks),
              "host_peak_mib": plan["host_peak_mib"], "slowdown": step.slowdown, "step_time_cost": step.cost}  # fmt: skip
    if step.flag == "--blocks_to_swap":
        record["step_time_cost"], record["copy_s"] = _swap_cost(trial[0][1][0], plan, before)
    return record


def _swap_cost(n: str, plan: dict, before: dict) -> tuple[str, float]:
    """The swap's cost: the host bytes it pins more than before (the swapped weights' host copies), each copied to
    the device twice per step (for its forward and for its backward)."""

    def pinned(p: dict) -> float:
        return p["phases"].get("step", {}).get("host_pinned_mib", 0.0)

    extra = max(pinned(plan) - pinned(before), 0.0) / GIB
    seconds = 2 * extra * 2**30 / (PCIE_GB_S * 1e9)
    words = (f"{n} blocks swapped: {extra:.2f} GiB more of swapped weights, copied to the device twice per step "
             f"(+{2 * extra:.2f} GiB: {seconds:.2f} s at {PCIE_GB_S:g} GB/s, PCIe 4.0 x16), hidden while a block's "
             "copy is shorter than the previous block's compute; not measured on a GPU here")  # fmt: skip
    return words, round(seconds, 3)


def _line(taken: dict) -> str:
    flags = " ".join(taken["flags"])
    return (f"  + {flags:<34} card peak {taken['card_peak_mib'] / GIB:6.2f} GiB ({taken['peak_phase']})   "
            f"cost: {taken['step_time_cost']}")  # fmt: skip


def total_cost(taken: list[dict[str, Any]]) -> str:
    """The step-time cost of all the changes together, in words: the known slowdowns summed, the swap's added copies
    as their upper bound (none of them hidden behind compute), and the changes whose cost is not known."""
    known = sum(t["slowdown"] for t in taken if t["slowdown"])
    copies = sum(t.get("copy_s", 0.0) for t in taken)
    unknown = [" ".join(t["flags"]) for t in taken if t["slowdown"] is None and "copy_s" not in t]
    words = [f"+{known:.0%} step time"] if known else []
    words += [f"at most +{copies:.2f} s per step for the added block copies"] if copies else []
    words += [f"not measured: {'; '.join(unknown)}"] if unknown else []
    return ", ".join(words) or "no step-time cost known"


def paste_line(script: str, argv: list[str], taken: list[dict[str, Any]]) -> str:
    """The command with the changes, without the plan's own flags: ready to paste."""
    words = changed_argv(argv, [c for t in taken for c in t["changes"]])
    for flag in ("--plan_memory", "--plan_memory_json", "--vram", "--ram"):
        words = changed_argv(words, [(flag, [])])
        words = words[: len(words) - 1] if words and words[-1] == flag else words
    return "python " + shlex.join([script, *words])
