"""Command line + ``--config_file`` TOML -> one validated Namespace; problems reported all at once (library.cli.problems).

sd-scripts semantics: the TOML holds flag names (without ``--``) as keys, optionally inside sections (sections are
flattened); values on the command line win over the file. ``--output_config`` writes the effective arguments to the
``--config_file`` path and exits, and reading that file back gives the same arguments.

This module also keeps the list of sd-scripts flags that are accepted for compatibility but not supported yet:
using one is an error that says so, never a silent no-op; and of those that have nothing to act on in a script:
using one is said in the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import toml

from library.cli.problems import ConfigError, did_you_mean

_CONFIG_DESTS = ("config_file", "output_config")
logger = logging.getLogger("sdtrain")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config file")
    group.add_argument("--config_file", type=str, default=None, help="TOML file of arguments (flag names as keys)")
    group.add_argument(
        "--output_config", action="store_true", help="write the effective arguments to --config_file and exit"
    )


def add_unsupported(group: Any, flag: str, reason: str = "", **kwargs: Any) -> None:
    """Add an sd-scripts flag that we accept for compatibility but refuse when it is actually used."""
    action = group.add_argument(flag, help=f"not supported yet{': ' + reason if reason else ''}", **kwargs)
    action.unsupported_reason = reason  # read by unsupported_problems


def unsupported_problems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    problems = []
    for action in parser._actions:
        reason = getattr(action, "unsupported_reason", None)
        if reason is not None and _is_set(getattr(args, action.dest, None), action.default):
            problems.append(
                f"{action.option_strings[0]} is not supported yet{' (' + reason + ')' if reason else ''}; "
                "remove it from the command line / config file"
            )
    return problems


def add_no_effect(group: Any, flag: str, reason: str, **kwargs: Any) -> None:
    """Add an sd-scripts flag that has nothing to act on in this script: accepted, said in the log when given (with
    ``reason``), and reset to its default, so the run's configuration is the same with or without it."""
    action = group.add_argument(flag, help=f"accepted for sd-scripts, no effect here: {reason}", **kwargs)
    action.no_effect_reason = reason  # read by reset_no_effect_flags


def reset_no_effect_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Say which given flags have no effect here (:func:`add_no_effect`) and set them back to their defaults."""
    for action in parser._actions:
        reason = getattr(action, "no_effect_reason", None)
        if reason is not None and _is_set(getattr(args, action.dest, None), action.default):
            logger.warning("%s has no effect here: %s; flag ignored", action.option_strings[0], reason)
            setattr(args, action.dest, action.default)


def _is_set(value: Any, default: Any) -> bool:
    """True when ``value`` is not the flag's default (``0`` counts as set even though ``0 == False``)."""
    if value is None or value is False:
        return False
    return not (type(value) is type(default) and value == default)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace | None:
    """Parse ``argv`` with ``--config_file`` support. Returns None after ``--output_config`` wrote the file."""
    from library.cli import plan_flags as plan

    argv = plan.planned_argv(list(argv) if argv is not None else None)  # inside a plan: with its changes
    first = parser.parse_args(argv)
    path = getattr(first, "config_file", None)
    if path and not first.output_config:
        parser.set_defaults(**read_config_file(parser, path))
        args = parser.parse_args(argv)
        parser.set_defaults(**{a.dest: a.default for a in parser._actions})  # leave the parser as it was
    else:
        args = first
    if getattr(args, "output_config", False):
        if not path:
            raise ConfigError(["--output_config needs --config_file (the path to write)"])
        write_config_file(parser, args, path)
        print(f"wrote the arguments to {path}")
        return None
    problems = unsupported_problems(parser, args) + plan.plan_problems(args)
    if problems:
        raise ConfigError(problems)
    reset_no_effect_flags(parser, args)
    plan.intercept(args)  # --plan_memory: PlanRequested, or the plan's settings inside a plan
    return args


def peek(argv: Sequence[str] | None, dest: str) -> Any:
    """The value of ``--<dest>`` on the command line ``argv`` (None: ``sys.argv``), else in its ``--config_file``
    TOML, else None, read before the script's parser exists (a tool whose flags depend on the model, e.g. its
    family's). Nothing else is checked here: the full parse does that."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(f"--{dest}", default=None)
    pre.add_argument("--config_file", default=None)
    known, _ = pre.parse_known_args(list(argv) if argv is not None else None)
    value = getattr(known, dest)
    path = Path(known.config_file) if known.config_file else None
    if value is None and path is not None and path.is_file():
        flat: dict[str, Any] = {}
        try:
            _flatten(toml.loads(path.read_text(encoding="utf-8")), path.name, flat, [])
        except (toml.TomlDecodeError, UnicodeDecodeError):
            return None  # the full parse reports it
        value = flat.get(dest)
    return value


def _flatten(table: dict, where: str, out: dict, problems: list[str]) -> None:
    for key, value in table.items():
        if isinstance(value, dict):
            _flatten(value, f"{where}[{key}]", out, problems)
        elif key in out:
            problems.append(f"{where}: {key} is set twice (sections are flattened); keep one")
        else:
            out[key] = value


def bom_hint(text: str) -> str:
    """Why a file that looks right does not parse: a byte-order mark that Windows editors put in front."""
    if text.startswith("\ufeff"):
        return (" (the file starts with a byte-order mark, BOM: the editor saved it as 'UTF-8 with BOM'; save it as "
                "plain UTF-8)")  # fmt: skip
    return ""


def read_config_file(parser: argparse.ArgumentParser, path: str | os.PathLike) -> dict[str, Any]:
    """Load a ``--config_file`` TOML into ``{dest: value}``, checking names and types against ``parser``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config_file {path}: no such file"])
    text = path.read_text(encoding="utf-8")
    if bom_hint(text):  # the toml package would read the mark as part of the first key
        raise ConfigError([f"{path}: not valid TOML{bom_hint(text)}"])
    try:
        table = toml.loads(text)
    except toml.TomlDecodeError as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from e
    flat: dict[str, Any] = {}
    problems: list[str] = []
    _flatten(table, path.name, flat, problems)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    values = {}
    for key, value in flat.items():
        if key in _CONFIG_DESTS:
            continue
        if key not in actions:
            problems.append(f"{path.name}: unknown argument {key!r}{did_you_mean(key, actions)}")
            continue
        try:
            values[key] = _convert(actions[key], value)
        except (TypeError, ValueError) as e:
            problems.append(f"{path.name}: {key}: {e}")
    if problems:
        raise ConfigError(problems)
    return values


def _convert(action: argparse.Action, value: Any) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    convert = action.type or (lambda v: v)
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        # a TOML string for a list flag holds several items, as on a command line: "a=1 b=2"
        items = value if isinstance(value, list) else shlex.split(value) if isinstance(value, str) else [value]
        return [_one(convert, v, action) for v in items]
    if isinstance(value, list):
        raise ValueError(f"expected one value, got a list {value!r}")
    return _one(convert, value, action)


def _one(convert: Any, value: Any, action: argparse.Action) -> Any:
    out = convert(value if isinstance(value, str) or convert is str else str(value))
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def write_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, path: str | os.PathLike) -> None:
    """Write every argument that differs from its default, grouped by argparse group, as TOML (atomic)."""
    from library.files.weights import atomic_path

    sections: dict[str, dict[str, Any]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.dest in (*_CONFIG_DESTS, "help"):
                continue
            value = getattr(args, action.dest, None)
            if value is None or value == action.default:
                continue
            name = group.title.replace(" ", "_").replace("-", "_")
            sections.setdefault(name, {})[action.dest] = value
    with atomic_path(path) as tmp:
        tmp.write_text(toml.dumps(sections), encoding="utf-8")


def missing_path_problems(args: argparse.Namespace, flags: Sequence[str], folders: bool = False) -> list[str]:
    """One problem per given path flag (``--clip_l`` ...) whose file (``folders``: or folder) does not exist (a flag
    ``args`` lacks is not given)."""
    problems = []
    for flag in flags:
        path = getattr(args, flag, None)
        if path is None or (Path(path).is_file() or (folders and Path(path).is_dir())):
            continue
        what = "no such file or folder" if folders else "no such file"
        other = ", or a diffusers folder holding it" if folders else ""
        problems.append(f"--{flag} {path}: {what} (give the .safetensors file of the {flag} weights{other})")
    return problems


def positive_count_problems(args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """One problem per given count flag below 1."""
    return [f"--{flag} must be a positive number, got {getattr(args, flag)}" for flag in flags
            if getattr(args, flag, None) is not None and getattr(args, flag) < 1]  # fmt: skip


def guidance_problems(flag: str, value: float | None) -> list[str]:
    """The one rule for a guidance strength (FLUX's embedded guidance ``--guidance_scale``, a prompt's ``--g``,
    ``--guidance`` of the inference scripts): a finite number >= 0 (None: not given)."""
    if value is None or 0 <= value < float("inf"):
        return []
    return [f"{flag} must be a finite number >= 0, got {value}"]


def from_namespace(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build the dataclass ``cls`` from the same-named attributes of ``args`` (missing ones keep their default)."""
    import dataclasses

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
