"""sdxl_train_control_net_lllite.py takes every one of sd-scripts' 171 flags of its script with sd-scripts' default;
the flags it shares with sdxl_train_network.py are read by the same readers (tests/test_flags.py checks each of
them), and its own flags each change what the run uses or are refused naming the flag."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from test_flags import assert_choices_accepted, assert_flag_acts, assert_sd_scripts_flags

import sdxl_train_control_net_lllite as script
import train_network
from library.cli.parse import parse_args
from library.run.config import read_config
from networks.lllite_config import LLLiteConfig

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_sdxl_train_control_net_lllite_flags.json").read_text())
OWN = ("--cond_emb_dim", "--network_dim", "--network_dropout", "--network_weights", "--conditioning_data_dir")


def _actions(parser) -> dict:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_sd_scripts_flags_exist_with_their_defaults():
    assert len(FLAGS) == 171
    actions = _actions(script.build_parser())
    assert_sd_scripts_flags(FLAGS, actions, "sdxl_train_control_net_lllite.py")
    assert_choices_accepted(FLAGS, actions)
    # everything else is train_network.py's flag of the same name (read by the same group readers)
    adapter = set(_actions(train_network.build_parser()))
    assert set(actions) - adapter == {"--cond_emb_dim"}


@pytest.fixture(scope="module")
def read(tiny_dir, tmp_path_factory):
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path_factory.mktemp("lllite_flags")) / "10_sks shape"
    cond = data.parent / "cond"
    shutil.copytree(data, cond)
    other = data.parent / "cond2"
    shutil.copytree(data, other)
    weights = data.parent / "w.safetensors"
    weights.write_bytes(b"")
    base = ["--pretrained_model_name_or_path", str(tiny_dir / "sdxl"), "--train_data_dir", str(data),
            "--conditioning_data_dir", str(cond), "--resolution", "64", "--output_dir", str(data.parent / "out"),
            "--cond_emb_dim", "8", "--network_dim", "4"]  # fmt: skip
    values = {"--network_weights": [str(weights)], "--conditioning_data_dir": [str(other)]}

    def config(*extra: str):
        cfg = read_config(parse_args(script.build_parser(), [*base, *extra]), ("sdxl",), LLLiteConfig.from_args)
        return dataclasses.replace(cfg, args={})

    return config, values


@pytest.mark.parametrize("flag", OWN)
def test_own_flags_change_the_run_or_are_refused(read, flag, caplog):
    config, values = read
    action = _actions(script.build_parser())[flag]
    value = values.get(flag) or [str(action.default * 2 if action.default else 0.5 if action.type is float else 6)]
    assert_flag_acts(config, "sdxl_train_control_net_lllite.py", action, value, [], caplog)
