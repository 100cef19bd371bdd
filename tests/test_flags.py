"""Every one of sd-scripts' 193 train_network.py flags, 169 train_textual_inversion.py flags and 170
sdxl_train_textual_inversion.py flags (SD_SCRIPTS.md section 1) is accepted by our script of the same name with
sd-scripts' default, and is either read by the toolkit or refused with "not supported yet" when used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import train_network
import train_textual_inversion
from library.config import ConfigError, parse_args

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_train_network_flags.json").read_text())
# sd-scripts script -> (its flags, our parser of the same script; sdxl_train_textual_inversion.py uses the SD one's)
SCRIPTS = {
    "train_network": (FLAGS, train_network.build_parser),
    **{
        name: (json.loads((ROOT / "tests" / "data" / f"sd_scripts_{name}_flags.json").read_text()),
               train_textual_inversion.build_parser)
        for name in ("train_textual_inversion", "sdxl_train_textual_inversion")
    },
}  # fmt: skip
# Defaults we change on purpose (documented in docs/): flag -> reason
DIFFERENT_DEFAULTS = {
    "--save_model_as": "safetensors like sd-scripts' train_network; our choices add diffusers formats for fine-tunes",
}


def _parser(script="train_network"):
    return SCRIPTS[script][1]()


def _actions(script="train_network"):
    return {opt: a for a in _parser(script)._actions for opt in a.option_strings}


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
    files += list((ROOT / "networks").rglob("*.py")) + [ROOT / "train_network.py", ROOT / "train_textual_inversion.py"]
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


TI_SCRIPTS = {"train_textual_inversion": 169, "sdxl_train_textual_inversion": 170}


@pytest.mark.parametrize("script", TI_SCRIPTS)
def test_textual_inversion_flags_exist_with_defaults_and_are_read(script):
    from library.saving import METADATA_NAMES

    flags, actions, source = SCRIPTS[script][0], _actions(script), _source_text()
    assert len(flags) == TI_SCRIPTS[script]
    missing = sorted(set(flags) - set(actions))
    assert not missing, f"flags of sd-scripts' {script}.py missing here: {missing}"
    wrong, unread = {}, []
    for flag, info in flags.items():
        action = actions[flag]
        expected, actual = _expected(info["default"]), action.default
        if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
            ok = float(actual) == float(expected)
        else:
            ok = actual in (None, False, []) if expected is None else actual == expected or str(actual) == str(expected)
        if not ok:
            wrong[flag] = (expected, actual)
        read = re.search(rf"\b{action.dest}\b", source) is not None
        read = read or action.dest in {f"metadata_{n}" for n in METADATA_NAMES}
        if not (read or hasattr(action, "unsupported_reason")):
            unread.append(flag)
    assert not wrong, f"defaults that differ from sd-scripts' {script}.py (flag: (sd-scripts, ours)): {wrong}"
    assert not unread, f"flags accepted but neither read nor refused: {unread}"


@pytest.mark.parametrize(
    "flag",
    sorted(
        f for f, a in _actions("train_textual_inversion").items()
        if f in SCRIPTS["sdxl_train_textual_inversion"][0] and hasattr(a, "unsupported_reason")
    ),
)  # fmt: skip
def test_textual_inversion_refused_flags_say_not_supported_yet(flag):
    action = _actions("train_textual_inversion")[flag]
    value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else "1"]
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(_parser("train_textual_inversion"), [flag, *[str(v) for v in value]])
