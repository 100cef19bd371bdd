"""``--plan_memory --vram GB``: when the command does not fit the card, the cheapest changes that make it fit.

The changes are tried in the order users accept them, each on top of the ones before, and each is planned
(library/measure/plan.py: the command with the change, on the simulated device), until the card's peak fits:

1. cache the text-encoder outputs, 2. cache the latents, 3. gradient checkpointing, 4. float8 base weights,
5. ``--blocks_to_swap N`` with the smallest N that fits (doubling, then bisection), 6. offloaded checkpointing,
7. an 8-bit optimizer, 8. half the batch with twice the accumulation (the same effective batch).

A change the script does not take (its parser or its checks refuse it) or that is already in the command is
skipped, with the reason. Nothing here names a family: which flags a script reads is asked of the script itself.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from library.cli.plan_flags import changed_argv

GIB = 1024.0  # MiB


@dataclass(frozen=True)
class Step:
    label: str
    flag: str
    values: tuple[str, ...]
    cost: str


STEPS = (
    Step("cache the text-encoder outputs", "--cache_text_encoder_outputs", (),
         "none: steps get faster (the encoders leave the device); captions are fixed per image"),
    Step("cache the latents", "--cache_latents", (), "none: steps get faster; no random crop / flip per step"),
    Step("gradient checkpointing", "--gradient_checkpointing", (),
         "about 20-30 % slower steps (the forward runs again in the backward)"),
    Step("float8 base weights", "--fp8_base", (), "a few % slower steps (a cast per layer); slightly lower precision"),
    Step("block swap", "--blocks_to_swap", ("N",),
         "slower by the host-device copies of N blocks per step (hidden behind compute while N is small)"),
    Step("offloaded checkpointing", "--cpu_offload_checkpointing", (),
         "slower: the checkpointed activations travel to the host and back"),
    Step("8-bit optimizer", "--optimizer_type", ("AdamW8bit",), "none in time; the optimizer state in 8 bits"),
    Step("half the batch, twice the accumulation", "--train_batch_size", ("HALF",),
         "about the same time per image; the same effective batch"),
)  # fmt: skip


def _given(argv: list[str], flag: str) -> bool:
    return any(w == flag or w.startswith(flag + "=") for w in argv)


def _value(argv: list[str], flag: str, default: str) -> str:
    for i, w in enumerate(argv):
        if w == flag and i + 1 < len(argv):
            return argv[i + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return default


def advise(plan_with: Callable[[list[tuple[str, list[str]]]], dict], argv: list[str], fits: Callable[[dict], bool],
           out: Callable[[str], None]) -> list[dict]:  # fmt: skip
    """Try :data:`STEPS` on ``argv`` (``plan_with(changes)`` plans the command with ``changes``: (flag, values) pairs)
    until ``fits(plan)``; returns the steps taken, each with its plan's card peak."""
    changes: list[tuple[str, list[str]]] = []
    taken: list[dict] = []
    for step in STEPS:
        if step.flag == "--optimizer_type" and "8bit" in _value(argv, step.flag, "").lower():
            continue
        if step.values == ("HALF",):
            batch = int(_value(argv, step.flag, "1"))
            if batch < 2:
                continue
            accumulation = int(_value(argv, "--gradient_accumulation_steps", "1"))
            trial = [(step.flag, [str(batch // 2)]), ("--gradient_accumulation_steps", [str(accumulation * 2)])]
        elif step.values == ("N",):
            found = _smallest_swap(plan_with, changes, fits, out)
            if found is None:
                continue
            n, plan = found
            changes.append((step.flag, [str(n)]))
            taken.append(_record(step, [str(n)], plan))
            out(_line(taken[-1]))
            if fits(plan):
                return taken
            continue
        elif _given(argv, step.flag) and not (step.flag == "--optimizer_type"
                                               and _value(argv, step.flag, "").lower() == "adamw"):  # fmt: skip
            continue  # the user's choice stands; AdamW's own 8-bit form is the one optimizer offered instead
        else:
            trial = [(step.flag, list(step.values))]
        plan = _try(plan_with, changes + trial, out)
        if plan is None:
            continue
        changes += trial
        taken.append(_record(step, [w for _, v in trial for w in v], plan))
        out(_line(taken[-1]))
        if fits(plan):
            return taken
    return taken


def _try(plan_with: Callable, changes: list, out: Callable[[str], None]) -> dict | None:
    try:
        return plan_with(changes)
    except SystemExit:  # argparse: the script has no such flag
        return None
    except (ValueError, RuntimeError, NotImplementedError) as e:  # the script's checks refuse the combination
        out(f"  (skipped {' '.join(f for f, _ in changes[-1:])}: {str(e).splitlines()[-1][:160]})")
        return None


def _smallest_swap(plan_with: Callable, changes: list, fits: Callable[[dict], bool], out: Callable[[str], None]):
    """The smallest ``--blocks_to_swap`` that fits (N doubles until it fits or is refused, then bisection), or the
    largest accepted when none fits; None when the script swaps no blocks."""
    best_fit, best_any, low, n = None, None, 0, 1
    while best_fit is None:
        plan = _try(plan_with, [*changes, ("--blocks_to_swap", [str(n)])], lambda line: None)
        if plan is None:
            break
        best_any = (n, plan)
        if fits(plan):
            best_fit = (n, plan)
            break
        low, n = n, n * 2
    if best_fit is None:
        return best_any
    high = best_fit[0]
    while high - low > 1:
        mid = (low + high) // 2
        plan = _try(plan_with, [*changes, ("--blocks_to_swap", [str(mid)])], lambda line: None)
        if plan is not None and fits(plan):
            high, best_fit = mid, (mid, plan)
        else:
            low = mid
    return best_fit


def _record(step: Step, values: list[str], plan: dict) -> dict:
    return {"change": step.label, "flags": [step.flag, *values], "card_peak_mib": plan["card_peak_mib"],
            "host_peak_mib": plan["host_peak_mib"], "step_time_cost": step.cost}  # fmt: skip


def _line(taken: dict) -> str:
    flags = " ".join(taken["flags"])
    return f"  + {flags:<34} card peak {taken['card_peak_mib'] / GIB:6.2f} GiB   cost: {taken['step_time_cost']}"


def paste_line(script: str, argv: list[str], taken: list[dict[str, Any]]) -> str:
    """The command with the changes, without the plan's own flags: ready to paste."""
    changes = []
    for t in taken:
        flags = t["flags"]
        changes.append((flags[0], flags[1:]))
        if flags[0] == "--train_batch_size":
            accumulation = int(_value(argv, "--gradient_accumulation_steps", "1"))
            changes.append(("--gradient_accumulation_steps", [str(accumulation * 2)]))
    words = changed_argv(argv, changes)
    for flag in ("--plan_memory", "--plan_memory_json", "--vram", "--ram"):
        words = changed_argv(words, [(flag, [])])
        words = words[: len(words) - 1] if words and words[-1] == flag else words
    return "python " + shlex.join([script, *words])
