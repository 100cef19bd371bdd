"""The ``--plan_memory`` flags every training script takes, and how a script's run hands over to the planner.

The planner itself is library/measure/plan.py (which registers :func:`plan_command` here when it is imported: the
entry scripts import it; this module imports nothing of the library, so the argument reader and ``main_guard`` can
use it). A script's argument reader calls :func:`planned_argv` and :func:`intercept`: outside a plan,
``--plan_memory`` raises :class:`PlanRequested`, which ``main_guard`` answers by running the registered planner
with the same run function; inside a plan, the run's flags are set for the plan (one step, a temporary output
folder, ...), and the plan's changes (library/measure/advice.py) are applied to the command line.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLANNERS: list[Callable[..., Any]] = []  # library.measure.plan.plan_command, once imported


def register_planner(planner: Callable[..., Any]) -> None:
    if planner not in PLANNERS:
        PLANNERS.append(planner)


def run_planner(run: Callable[[], Any]) -> Any:
    """Plan the command ``run()`` runs (``main_guard``'s answer to :class:`PlanRequested`)."""
    if not PLANNERS:
        raise ValueError("--plan_memory: this program cannot plan its memory; use tools/plan_memory.py SCRIPT ...")
    return PLANNERS[-1](run)


_active: list[PlanState] = []  # the plan being run (at most one)


def in_plan() -> bool:
    """Whether a ``--plan_memory`` plan is running the command now (its run reads weight files' headers only)."""
    return bool(_active)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory plan (library/measure/plan.py)")
    group.add_argument("--plan_memory", action="store_true",
                       help="do not train: run two steps, one sampling round and one save of this command on a simulated "
                            "device, reading the model files' headers only, and print the device and host memory "
                            "per phase (exit 0)")  # fmt: skip
    group.add_argument("--plan_memory_json", type=str, default=None, metavar="PATH",
                       help="with --plan_memory: also write the plan as JSON to PATH")  # fmt: skip
    group.add_argument("--vram", type=float, default=None, metavar="GB",
                       help="with --plan_memory: the card's memory in GB (GiB); says whether the command fits and, if "
                            "not, the cheapest changes that make it fit")  # fmt: skip
    group.add_argument(
        "--ram",
        type=float,
        default=None,
        metavar="GB",
        help="with --plan_memory: the system RAM in GB (GiB); says whether the host tensors fit",
    )


def plan_problems(args: argparse.Namespace) -> list[str]:
    """The plan's flags given without ``--plan_memory``."""
    if getattr(args, "plan_memory", False):
        return []
    return [f"--{name} is read with --plan_memory only; add --plan_memory or remove --{name}"
            for name in ("plan_memory_json", "vram", "ram") if getattr(args, name, None) is not None]  # fmt: skip


class PlanRequested(Exception):  # noqa: N818 - a request, not an error
    """Raised by the argument reader when ``--plan_memory`` is given outside a plan: the caller (``main_guard``,
    tools/plan_memory.py) runs :func:`plan_command` with the same run function."""


@dataclass
class PlanState:
    """The plan being run: its temporary folder and the flags the command gave."""

    folder: Path
    changes: list[tuple[str, list[str]]] = field(default_factory=list)  # flags set on top of the command (advice)
    argv_flags: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # the command line as the script read it


# the run's flags replaced inside a plan: (flag, value); a callable value is given the plan's folder
_OVERRIDES: tuple[tuple[str, Any], ...] = (
    ("output_dir", lambda folder: str(folder / "output")),
    ("logging_dir", None),
    ("log_with", None),
    ("max_train_steps", 2),  # the second step holds the optimizer state the first one made, with its backward
    ("max_train_epochs", None),
    ("save_every_n_steps", None),
    ("save_every_n_epochs", None),
    ("sample_every_n_epochs", None),
    ("sample_at_first", False),
    ("validate_every_n_epochs", None),
    ("huggingface_repo_id", None),
    ("save_state_to_huggingface", False),
    ("max_data_loader_n_workers", 0),
    ("persistent_data_loader_workers", False),
)


def planned_argv(argv: list[str] | None) -> list[str] | None:
    """The command line a script reads: inside a plan with changes (library/measure/advice.py), the command with them."""
    if not _active:
        return argv
    import sys

    state = _active[-1]
    words = list(sys.argv[1:] if argv is None else argv)
    state.argv = words
    return changed_argv(words, state.changes) if state.changes else words


def intercept(args: argparse.Namespace) -> None:
    """Called on every training script's parsed flags: outside a plan, ``--plan_memory`` raises
    :class:`PlanRequested`; inside one, the run's flags are set for the plan (module docstring)."""
    if not getattr(args, "plan_memory", False):
        return
    if getattr(args, "demo", False):  # the demo trains the tiny model on the host: there is no device to plan
        from library.cli.problems import ConfigError

        raise ConfigError(["--plan_memory with --demo: the demo trains its tiny model on the CPU, so there is no device "
                           "memory to plan; give --plan_memory your own command line (the demo's model and images "
                           "are in demo/models and demo/dataset)"])  # fmt: skip
    if not _active:
        raise PlanRequested()
    state = _active[-1]
    state.argv_flags = {k: getattr(args, k, None) for k in ("vram", "ram", "plan_memory_json")}
    for name, value in _OVERRIDES:
        if hasattr(args, name):
            setattr(args, name, value(state.folder) if callable(value) else value)
    on_disk = any(getattr(args, f, False) for f in ("cache_latents_to_disk", "cache_text_encoder_outputs_to_disk"))
    if on_disk or getattr(args, "cache_dir", None):  # disk caches are made anew in the plan's folder
        args.cache_dir = str(state.folder / "cache")
    if getattr(args, "sample_prompts", None):
        args.sample_every_n_steps = 2  # one sampling round, after the second step
    else:
        args.sample_every_n_steps = None
    args.plan_memory = False  # the run itself trains (on the simulated device)


@contextlib.contextmanager
def planning(folder: Path, changes: list[tuple[str, list[str]]] | None = None) -> Iterator[PlanState]:
    state = PlanState(folder, list(changes or []))
    _active.append(state)
    try:
        yield state
    finally:
        _active.remove(state)


def changed_argv(argv: list[str], changes: list[tuple[str, list[str]]]) -> list[str]:
    """``argv`` with each change's flag set to its values (an earlier occurrence and its values removed)."""
    words = list(argv)
    for flag, values in changes:
        kept, skip = [], False
        for w in words:
            if skip and not w.startswith("--"):
                continue
            skip = False
            if w == flag:
                skip = True
                continue
            if w.startswith(flag + "="):
                continue
            kept.append(w)
        words = [*kept, flag, *values]
    return words
