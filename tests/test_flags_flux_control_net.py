"""flux_train_control_net.py takes every one of sd-scripts' 193 flags of its script (flux_train.py's but
``--reg_data_dir``) with sd-scripts' default; the flags it shares with flux_train.py / flux_train_network.py are read
by the same readers (tests/test_flags_flux_train.py, tests/test_flags_flux.py check each of them), and its own flags
each change what the run uses or are refused naming the flag."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_flags import NO_EFFECT_HERE, assert_choices_accepted, assert_flag_acts, assert_sd_scripts_flags

import flux_train
import flux_train_control_net as script
from library.cli.parse import parse_args
from library.cli.problems import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_flux_train_control_net_flags.json").read_text())
SCRIPT = "flux_train_control_net.py"
OWN = ("--controlnet_model_name_or_path", "--mem_eff_save", "--double_blocks_to_swap", "--single_blocks_to_swap",
       "--skip_latents_validity_check", "--use_safetensors", "--blockwise_fused_optimizers",
       "--fused_optimizer_groups", "--conditioning_data_dir", "--fused_backward_pass", "--save_model_as",
       "--deepspeed")  # fmt: skip
NO_EFFECT_HERE[(SCRIPT, "--use_safetensors")] = "always .safetensors"


def _actions(parser) -> dict:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_sd_scripts_flags_exist_with_their_defaults():
    assert len(FLAGS) == 193
    actions = _actions(script.build_parser())
    assert_sd_scripts_flags(FLAGS, actions, SCRIPT)
    assert_choices_accepted(FLAGS, actions)
    # every flag is one of flux_train.py's (which refuses --conditioning_data_dir and --controlnet_model_name_or_path)
    assert set(actions) <= set(_actions(flux_train.build_parser()))


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    import shutil

    from library.families.flux.tiny import build_tiny_flux, write_tiny_files
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("flux_cn_flags")
    files = write_tiny_files(build_tiny_flux("flux-dev", blocks=(4, 6)), root / "m")
    data = make_example_dataset(root / "data") / "10_sks shape"
    for name in ("cond", "cond2"):
        shutil.copytree(data, data.parent / name)
    weights = root / "cn.safetensors"
    weights.write_bytes(b"")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--clip_l", str(files["clip_l"]), "--t5xxl",
            str(files["t5xxl"]), "--ae", str(files["ae"]), "--train_data_dir", str(data), "--conditioning_data_dir",
            str(data.parent / "cond"), "--resolution", "64", "--output_dir", str(root / "out"), "--seed", "1"]  # fmt: skip
    values = {"--controlnet_model_name_or_path": [str(weights)], "--conditioning_data_dir": [str(data.parent / "cond2")],
              "--double_blocks_to_swap": ["1"], "--single_blocks_to_swap": ["2"], "--save_model_as": ["diffusers"],
              "--fused_optimizer_groups": ["2"]}  # fmt: skip

    def config(*extra: str):
        cfg = script.read_config(parse_args(script.build_parser(), [*base, *extra]))
        return dataclasses.replace(cfg, args={})

    return config, values


@pytest.mark.parametrize("flag", OWN)
def test_own_flags_change_the_run_or_are_refused(read, flag, caplog):
    config, values = read
    action = _actions(script.build_parser())[flag]
    value = values.get(flag, [] if action.nargs == 0 else ["1"])
    assert_flag_acts(config, SCRIPT, action, value, [], caplog)


def test_deprecated_swap_flags_read_as_sd_scripts_reads_them(read):
    """sd-scripts: without --blocks_to_swap, N = --double_blocks_to_swap + --single_blocks_to_swap // 2."""
    config, _ = read
    assert config("--double_blocks_to_swap", "1", "--single_blocks_to_swap", "2").block_swap.blocks_to_swap == 2
    assert config("--blocks_to_swap", "1", "--double_blocks_to_swap", "2").block_swap.blocks_to_swap == 1
    assert config("--skip_latents_validity_check") == config("--skip_cache_check")
    with pytest.raises(ConfigError, match="--controlnet_model_name_or_path missing.safetensors: file not found"):
        config("--controlnet_model_name_or_path", "missing.safetensors")
