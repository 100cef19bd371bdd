"""Every one of sd-scripts' 218 sd3_train_network.py flags (train_network.py's 193 and 25 of SD3's) is accepted by
our sd3_train_network.py with sd-scripts' default, and a value other than the default changes the typed
configuration the run uses (``train_setup.read_config`` with the SD3 families and ``SD3Options``), or is refused
with a message naming the flag; the SD-only flags and sd-scripts' "[DOES NOT WORK]" flags say so once and change
nothing; SD3Options gives the SD3 family's ``load`` exactly the keywords of the family contract."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_flags import _expected

import sd3_train_network
from library.families.sd3.options import DOES_NOT_WORK, SD_ONLY_FLAGS, SD3Options
from library.problems import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_sd3_train_network_flags.json").read_text())
SCRIPT = "sd3_train_network.py"
# The keywords of the SD3 family's load beyond the model path (the family contract of issue 22).
LOAD_KEYWORDS = {"clip_l", "clip_g", "t5xxl", "t5xxl_max_token_length", "apply_lg_attn_mask", "apply_t5_attn_mask",
                 "clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate", "pos_emb_random_crop_rate",
                 "enable_scaled_pos_embed"}  # fmt: skip


def _parse(*argv: str):
    return sd3_train_network.build_parser().parse_args(list(argv))


def _actions() -> dict:
    return {opt: a for a in sd3_train_network.build_parser()._actions for opt in a.option_strings}


def test_all_218_flags_exist_with_sd_scripts_defaults():
    actions = _actions()
    assert len(FLAGS) == 218
    missing = sorted(set(FLAGS) - set(actions))
    assert not missing, f"flags of sd-scripts' sd3_train_network.py missing here: {missing}"
    wrong = {}
    for flag, info in FLAGS.items():
        expected, actual = _expected(info["default"]), actions[flag].default
        if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
            ok = float(actual) == float(expected)
        elif expected is None:
            ok = actual in (None, False, [])
        else:
            ok = actual == expected or str(actual) == str(expected)
        if not ok:
            wrong[flag] = (expected, actual)
    assert not wrong, f"defaults that differ from sd-scripts' sd3_train_network.py (flag: (sd-scripts, ours)): {wrong}"
    for flag, info in FLAGS.items():  # the choices sd-scripts lists are all accepted
        if "{" in info["type"] and actions[flag].choices:
            theirs = set(info["type"].split("{")[1].rstrip("}").split(","))
            assert theirs - {"None"} <= {str(c) for c in actions[flag].choices}, flag


def test_options_give_the_family_contract_keywords():
    """Defaults: sd-scripts' (T5 256 tokens, no masks, no dropout); every SD3 model flag reaches load_kwargs under its
    own name, and the metadata carries sd-scripts' two SD3 keys."""
    base = SD3Options.from_args(_parse())
    assert set(base.load_kwargs()) == LOAD_KEYWORDS
    assert base.load_kwargs()["t5xxl_max_token_length"] == 256
    assert base.metadata() == {"ss_apply_lg_attn_mask": False, "ss_apply_t5_attn_mask": False}
    given = SD3Options.from_args(_parse(
        "--t5xxl_max_token_length", "77", "--apply_lg_attn_mask", "--apply_t5_attn_mask", "--clip_l_dropout_rate",
        "0.1", "--clip_g_dropout_rate", "0.2", "--t5_dropout_rate", "0.3", "--pos_emb_random_crop_rate", "0.4",
        "--enable_scaled_pos_embed", "--text_encoder_batch_size", "3"))  # fmt: skip
    assert given.load_kwargs() == {**base.load_kwargs(), "t5xxl_max_token_length": 77, "apply_lg_attn_mask": True,
                                   "apply_t5_attn_mask": True, "clip_l_dropout_rate": 0.1, "clip_g_dropout_rate": 0.2,
                                   "t5_dropout_rate": 0.3, "pos_emb_random_crop_rate": 0.4,
                                   "enable_scaled_pos_embed": True}  # fmt: skip
    assert given.text_encoder_batch_size == 3
    assert given.metadata() == {"ss_apply_lg_attn_mask": True, "ss_apply_t5_attn_mask": True}


def test_bad_values_are_all_named_at_once(tmp_path):
    args = _parse("--clip_g", str(tmp_path / "missing.safetensors"), "--t5xxl_max_token_length", "0",
                  "--t5_dropout_rate", "1.5", "--pos_emb_random_crop_rate", "-0.1", "--clip_l_dropout_rate", "nan",
                  "--text_encoder_batch_size", "0", "--weighted_captions")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        SD3Options.from_args(args)
    text = str(e.value)
    for flag in ("--clip_g", "--t5xxl_max_token_length", "--t5_dropout_rate", "--pos_emb_random_crop_rate",
                 "--clip_l_dropout_rate", "--text_encoder_batch_size", "--weighted_captions"):  # fmt: skip
        assert flag in text, flag
    assert "missing.safetensors" in text and "no such file" in text


def test_family_problems_medium_only_flags_and_other_families():
    """--pos_emb_random_crop_rate and --enable_scaled_pos_embed are for SD3.5-medium only (sd-scripts' docs); a model
    of another family is named with the script's families."""

    def family(name, title):
        return SimpleNamespace(name=name, spec=SimpleNamespace(title=title))

    plain = SD3Options.from_args(_parse())
    tricks = SD3Options.from_args(_parse("--pos_emb_random_crop_rate", "0.5", "--enable_scaled_pos_embed"))
    assert tricks.family_problems(family("sd3.5-medium", "SD3.5 medium"), "m.safetensors") == []
    for name in ("sd3", "sd3.5-large"):
        assert plain.family_problems(family(name, name), "m.safetensors") == []
        problems = tricks.family_problems(family(name, name), "m.safetensors")
        assert len(problems) == 2 and "--pos_emb_random_crop_rate" in problems[0]
        assert "--enable_scaled_pos_embed" in problems[1] and "SD3.5-medium" in problems[1]
    (other,) = plain.family_problems(family("flux-dev", "FLUX.1 dev"), "f.safetensors")
    assert "FLUX.1 dev" in other and "sd3_train_network.py" in other


def test_sd_only_and_does_not_work_flags_are_marked():
    """The flags sd-scripts' SD3 script accepts and never reads carry the no-effect mark the run layer acts on."""
    actions = _actions()
    for flag in (*SD_ONLY_FLAGS, *DOES_NOT_WORK):
        assert getattr(actions[flag], "no_effect_reason", None), flag
