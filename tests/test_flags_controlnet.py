"""train_control_net.py (153 flags) and sdxl_train_control_net.py (169) take every one of sd-scripts' flags of
those scripts with sd-scripts' defaults; the flags they share with train_network.py are read by the same readers
(tests/test_flags.py checks each of them), and their own flags each change what the run uses or are refused naming
the flag."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from test_flags import assert_choices_accepted, assert_flag_acts, assert_sd_scripts_flags

import sdxl_train_control_net
import train_control_net
import train_controlnet
import train_network
from library.cli.parse import parse_args
from library.run.config import read_config
from networks.controlnet_config import ControlNetConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {  # script: (module, sd-scripts' flag count, families, its own flags)
    "train_control_net": (train_control_net, 153, ("sd1", "sd2"), ("--controlnet_model_name_or_path",)),
    "sdxl_train_control_net": (sdxl_train_control_net, 169, ("sdxl",),
                               ("--controlnet_model_name_or_path", "--control_net_lr")),
}  # fmt: skip


def _actions(parser) -> dict:
    return {opt: a for a in parser._actions for opt in a.option_strings}


@pytest.mark.parametrize("name", SCRIPTS)
def test_sd_scripts_flags_exist_with_their_defaults(name):
    module, count, _, own = SCRIPTS[name]
    flags = json.loads((ROOT / "tests" / "data" / f"sd_scripts_{name}_flags.json").read_text())
    assert len(flags) == count
    actions = _actions(module.build_parser())
    assert_sd_scripts_flags(flags, actions, f"{name}.py")
    assert_choices_accepted(flags, actions)
    # everything else is train_network.py's flag of the same name (read by the same group readers)
    assert set(actions) - set(_actions(train_network.build_parser())) == set(own)


def test_the_deprecated_name_takes_the_same_flags():
    assert set(_actions(train_controlnet.build_parser())) == set(_actions(train_control_net.build_parser()))


@pytest.fixture(scope="module")
def data(tiny_dir, tmp_path_factory):
    from library.run.demo import make_example_dataset

    images = make_example_dataset(tmp_path_factory.mktemp("controlnet_flags")) / "10_sks shape"
    for name in ("cond", "cond2"):
        shutil.copytree(images, images.parent / name)
    return images


@pytest.mark.parametrize("name, flag", [(n, f) for n, s in SCRIPTS.items() for f in (*s[3], "--conditioning_data_dir")])
def test_own_flags_change_the_run_or_are_refused(tiny_dir, data, tmp_path, name, flag, caplog):
    module, _, families, _ = SCRIPTS[name]
    base = ["--pretrained_model_name_or_path", str(tiny_dir / families[-1]), "--train_data_dir", str(data),
            "--conditioning_data_dir", str(data.parent / "cond"), "--resolution", "64",
            "--output_dir", str(tmp_path / "out")]  # fmt: skip

    def config(*extra: str):
        cfg = read_config(parse_args(module.build_parser(), [*base, *extra]), families, ControlNetConfig.from_args)
        return dataclasses.replace(cfg, args={})

    values = {"--controlnet_model_name_or_path": [str(data)],  # a folder: read as a diffusers ControlNet
              "--conditioning_data_dir": [str(data.parent / "cond2")], "--control_net_lr": ["3e-4"]}  # fmt: skip
    action = _actions(module.build_parser())[flag]
    assert_flag_acts(config, f"{name}.py", action, values[flag], [], caplog)
