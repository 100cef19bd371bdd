"""Every one of sd-scripts' fine_tune.py (167), sdxl_train.py (176) and train_db.py (169) flags (SD_SCRIPTS.md
section 1) is accepted by our script of the same name with sd-scripts' default, and is either read by the toolkit
or refused with "not supported yet" when used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_flags import _expected

import fine_tune
from library.config import ConfigError, parse_args
from library.model_trainable import ModelTrainingConfig

ROOT = Path(__file__).resolve().parents[1]
COUNTS = {"fine_tune": 167, "sdxl_train": 176, "train_db": 169}
FLAGS = {s: json.loads((ROOT / "tests" / "data" / f"sd_scripts_{s}_flags.json").read_text()) for s in COUNTS}


def _actions(script: str) -> dict:
    return {opt: a for a in fine_tune.build_parser(script)._actions for opt in a.option_strings}


def _source_text() -> str:
    files = [p for p in (ROOT / "library").rglob("*.py") if p.name != "args.py"]
    files += list((ROOT / "networks").rglob("*.py")) + [ROOT / "train_network.py", ROOT / "fine_tune.py"]
    return "\n".join(p.read_text() for p in files)


def _default_ok(expected, actual) -> bool:
    if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
        return float(actual) == float(expected)
    if expected is None:
        return actual in (None, False, [])
    return actual == expected or str(actual) == str(expected)


@pytest.mark.parametrize("script", COUNTS)
def test_flags_exist_with_sd_scripts_defaults_and_are_read_or_refused(script):
    from library.run_files import METADATA_NAMES

    flags, actions, source = FLAGS[script], _actions(script), _source_text()
    assert len(flags) == COUNTS[script]
    missing = sorted(set(flags) - set(actions))
    assert not missing, f"flags of sd-scripts' {script}.py missing here: {missing}"
    wrong = {f: (i["default"], actions[f].default) for f, i in flags.items()
             if not _default_ok(_expected(i["default"]), actions[f].default)}  # fmt: skip
    assert not wrong, f"defaults that differ from sd-scripts' {script}.py (flag: (sd-scripts, ours)): {wrong}"
    unread = []
    for flag in flags:
        action = actions[flag]
        read = re.search(rf"\b{action.dest}\b", source) is not None
        read = read or action.dest in {f"metadata_{n}" for n in METADATA_NAMES}
        if not (read or hasattr(action, "unsupported_reason")):
            unread.append(flag)
    assert not unread, f"flags accepted but neither read nor refused: {unread}"


REFUSED = sorted(
    (script, flag) for script in COUNTS for flag, a in _actions(script).items()
    if flag in FLAGS[script] and hasattr(a, "unsupported_reason")
)  # fmt: skip


@pytest.mark.parametrize("script, flag", REFUSED)
def test_refused_flags_say_not_supported_yet(script, flag):
    action = _actions(script)[flag]
    value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else "1"]
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(fine_tune.build_parser(script), [flag, *[str(v) for v in value]])


def test_the_deepspeed_flags_are_real_flags_here():
    assert not hasattr(_actions("sdxl_train")["--deepspeed"], "unsupported_reason")


def test_no_token_padding_is_read_in_train_db_only():
    """train_db.py's --no_token_padding is a real flag (read by ModelTrainingConfig); sd-scripts' fine_tune.py and
    sdxl_train.py have no such flag, and neither do we."""
    action = _actions("train_db")["--no_token_padding"]
    assert not hasattr(action, "unsupported_reason") and ("train_db", "--no_token_padding") not in REFUSED
    assert all("--no_token_padding" not in _actions(s) for s in ("fine_tune", "sdxl_train"))
    args = fine_tune.build_parser("train_db").parse_args(["--no_token_padding"])
    assert ModelTrainingConfig.from_args(args).no_token_padding
