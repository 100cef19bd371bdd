"""What ``--resume`` checks and loads: the state folder, its settings, its counters, the budget left.

What ``--resume`` checks before any model loads: which state folder to read (a state folder, or an output folder
whose newest complete state is picked), whether its network and optimizer settings are the command line's, and
whether the step budget is already spent (then there is nothing to do and nothing is written).

A state folder's ``train_state.json`` holds the counters (see :func:`library.run.run_files.save_train_state`) and, since
the settings check exists, ``settings``: the values of :data:`SETTINGS` the state was trained with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from library.run.method import MethodConfig

STATE_FILE = "train_state.json"
REQUIRED_FILES = (STATE_FILE, "trained.safetensors", "optimizer.pt", "scheduler.pt")

# NetworkConfig field -> the flag (or network_args key) a user changes; each shapes the trained tensors.
SETTINGS = {
    "module": "--network_module",
    "algo": "--network_args algo",
    "dora": "--network_args dora_wd",
    "wd_on_output": "--network_args wd_on_output",
    "dim": "--network_dim",
    "alpha": "--network_alpha",
    "conv_dim": "--network_args conv_dim",
    "conv_alpha": "--network_args conv_alpha",
    "block_dims": "--network_args block_dims",
    "block_alphas": "--network_args block_alphas",
    "conv_block_dims": "--network_args conv_block_dims",
    "conv_block_alphas": "--network_args conv_block_alphas",
    "preset": "--network_args preset",
    "train_norm": "--network_args train_norm",
    "use_tucker": "--network_args use_tucker",
    "use_scalar": "--network_args use_scalar",
    "factor": "--network_args factor",
    "decompose_both": "--network_args decompose_both",
    "full_matrix": "--network_args full_matrix",
    "train_on_input": "--network_args train_on_input",
    "train_unet_only": "--network_train_unet_only",
    "train_text_encoder_only": "--network_train_text_encoder_only",
    "optimizer": "--optimizer_type",
}


def is_complete_state(folder: Path) -> bool:
    """A finished state folder (a ``.partial`` one is still being written or was cut short)."""
    return (
        folder.is_dir()
        and not folder.name.endswith(".partial")
        and all((folder / name).is_file() for name in REQUIRED_FILES)
    )


def find_state(path: str | os.PathLike) -> Path:
    """The state folder ``--resume path`` means: ``path`` itself when it is a state folder, else the newest
    complete state folder directly inside it (an output folder; newest by the time its state was written).
    Raises ``ValueError`` saying what was found."""
    path = Path(path)
    if path.name.endswith("-state.partial"):
        raise ValueError(f"--resume {path}: an unfinished state (its writing was cut short, so it may lack files or "
                         f"hold a mix of two steps); resume from a *-state folder, e.g. --resume {path.parent}, "
                         "which picks the newest complete one")  # fmt: skip
    if (path / STATE_FILE).is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such folder; give a state folder written by --save_state or the "
                         "output folder that holds them")  # fmt: skip
    states = [d for d in path.iterdir() if is_complete_state(d)]
    if not states:
        raise ValueError(f"--resume {path}: neither a state folder (no {STATE_FILE}) nor an output folder holding "
                         "one (no complete *-state folder in it); save states with --save_state")  # fmt: skip
    return max(states, key=lambda d: ((d / STATE_FILE).stat().st_mtime_ns, d.name))


def read_counters(folder: Path, *, training: bool = True) -> dict[str, Any]:
    """``train_state.json`` of a state folder; ``ValueError`` naming the file when it cannot be read (or, with
    ``training``, lacks a training run's counters)."""
    file = folder / STATE_FILE
    try:
        counters = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: the state file cannot be read ({e}); resume from another state folder") from e
    if not isinstance(counters, dict) or (
        training and not all(k in counters for k in ("epoch", "step", "batches_in_epoch"))
    ):
        raise ValueError(f"{file}: not a training state (no epoch/step counters); resume from another state folder")
    return counters


def settings_of(method: MethodConfig, optimizer_type: str) -> dict[str, Any]:
    """The settings recorded with a state (JSON values): the trained method's shape-giving fields
    (``method.resume_settings()``: an adapter run's network config, also under pivotal tuning; other methods have
    none of them) and the optimizer."""
    given = method.resume_settings()
    values = {name: given.get(name) for name in SETTINGS if name != "optimizer"}
    values["optimizer"] = optimizer_type.lower()
    return json.loads(json.dumps(values))  # tuples -> lists, as they come back from the file


def setting_problems(folder: Path, counters: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """One problem per setting that differs between the state and this command line."""
    saved = counters.get("settings")
    if not isinstance(saved, dict):
        return []  # a state written before settings were recorded: the tensor shapes are checked when it loads
    problems = []
    for name, value in settings.items():
        if name in saved and saved[name] != value:
            problems.append(
                f"--resume {folder}: the state was trained with {SETTINGS[name]} {_show(saved[name])} but this "
                f"command line gives {_show(value)}; resume with the same setting (or start a new run without "
                "--resume)"
            )
    return problems


def check_family(folder: Path | str, counters: dict[str, Any], family: str) -> None:
    """A state trained on another model family cannot resume (its tensors name other modules): ``ValueError`` naming
    both families. States written before the family was recorded are checked when their tensors load."""
    saved = counters.get("family")
    if saved is not None and saved != family:
        raise ValueError(f"--resume {folder}: the state was trained on a {saved} model, this run loads a {family} "
                         f"model; resume with the {saved} model it was trained on (or start a new run without "
                         "--resume)")  # fmt: skip


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "(not set)" if value is None else str(value)


def budget_left(counters: dict[str, Any], max_train_steps: int | None, max_train_epochs: int | None) -> str | None:
    """None when the state still has steps to train; else the sentence saying the budget is already spent
    (``--max_train_epochs`` counts finished epochs, as it wins over ``--max_train_steps``)."""
    if max_train_epochs:
        if counters["epoch"] < max_train_epochs:
            return None
        return f"the state is at epoch {counters['epoch']}, which reaches --max_train_epochs {max_train_epochs}"
    if max_train_steps is None or counters["step"] < max_train_steps:
        return None
    return f"the state is at step {counters['step']}, which reaches --max_train_steps {max_train_steps}"


def load_into(folder: Path, network: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]) -> None:
    """Load a state's trained weights, optimizer and scheduler; a state that does not fit this network or optimizer
    (e.g. written before settings were recorded, with other settings) raises one ``ValueError`` naming it."""
    steps = (
        ("trained.safetensors", network, state["trained"], "the network settings (--network_dim, --network_args, ...)"),
        ("optimizer.pt", optimizer, state["optimizer"], "--optimizer_type, --optimizer_args or the learning rates"),
        ("scheduler.pt", scheduler, state["scheduler"], "--lr_scheduler"),
    )
    for name, target, values, settings in steps:
        try:
            target.load_state_dict(values)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            detail = " ".join(str(e).split()) or type(e).__name__  # torch lists the keys on the following lines
            detail = detail if len(detail) <= 300 else detail[:300] + " ..."
            raise ValueError(f"--resume {folder}: {name} does not fit this run ({detail}); {settings} differ "
                             "from the run that wrote the state: resume with the same settings") from e  # fmt: skip
