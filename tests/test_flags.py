"""Every one of sd-scripts' 193 train_network.py flags (SD_SCRIPTS.md section 1) is accepted with sd-scripts' default,
and is either read by the toolkit or refused with "not supported yet" when used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import train_network
from library.config import ConfigError, parse_args

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_train_network_flags.json").read_text())
# Defaults we change on purpose (documented in docs/): flag -> reason
DIFFERENT_DEFAULTS = {
    "--save_model_as": "safetensors like sd-scripts' train_network; our choices add diffusers formats for fine-tunes",
}


def _parser():
    return train_network.build_parser()


def _actions():
    return {opt: a for a in _parser()._actions for opt in a.option_strings}


def _expected(text: str):
    text = text.strip()
    if text in ("None", ""):
        return None
    if text in ("False", "True"):
        return text == "True"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip('"')


def test_all_193_flags_exist():
    assert len(FLAGS) == 193
    missing = sorted(set(FLAGS) - set(_actions()))
    assert not missing, f"flags of sd-scripts' train_network.py missing here: {missing}"


def test_defaults_match_sd_scripts():
    actions = _actions()
    wrong = {}
    for flag, info in FLAGS.items():
        if flag in DIFFERENT_DEFAULTS:
            continue
        expected, actual = _expected(info["default"]), actions[flag].default
        if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
            ok = float(actual) == float(expected)
        elif expected is None:
            ok = actual in (None, False, [])
        else:
            ok = actual == expected or str(actual) == str(expected)
        if not ok:
            wrong[flag] = (expected, actual)
    assert not wrong, f"defaults that differ from sd-scripts (flag: (sd-scripts, ours)): {wrong}"


def _source_text() -> str:
    files = [p for p in (ROOT / "library").rglob("*.py") if p.name != "args.py"]
    files += list((ROOT / "networks").rglob("*.py")) + [ROOT / "train_network.py"]
    return "\n".join(p.read_text() for p in files)


def test_every_flag_is_read_or_refused():
    """A flag is 'read' when its name appears in code outside the argparse definitions (a dataclass field filled by
    name, or an attribute read); otherwise using it must be an error saying it is not supported yet."""
    from library.saving import METADATA_NAMES

    source = _source_text()
    actions = _actions()
    unread = []
    for flag in FLAGS:
        action = actions[flag]
        refused = hasattr(action, "unsupported_reason")
        read = re.search(rf"\b{action.dest}\b", source) is not None
        read = read or action.dest in {f"metadata_{n}" for n in METADATA_NAMES}  # read by name in SaveConfig
        if not (read or refused):
            unread.append(flag)
    assert not unread, f"flags accepted but neither read nor refused: {unread}"


@pytest.mark.parametrize(
    "flag", sorted(f for f, a in _actions().items() if f in FLAGS and hasattr(a, "unsupported_reason"))
)
def test_refused_flags_say_not_supported_yet(flag):
    action = _actions()[flag]
    value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else "1"]
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(_parser(), [flag, *[str(v) for v in value]])
