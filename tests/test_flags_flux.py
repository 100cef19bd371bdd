"""Every one of sd-scripts' 215 flux_train_network.py flags (train_network.py's 193 and 22 of FLUX's) is accepted by
our flux_train_network.py with sd-scripts' default, and a value other than the default changes the typed
configuration the run uses (``library.run.config.read_config`` with the FLUX families and ``FluxOptions``), or is refused
with a message naming the flag; the SD-only flags sd-scripts' FLUX script ignores say so once and change nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_flags import (
    VALUES,
    _value,
    assert_choices_accepted,
    assert_flag_acts,
    assert_sd_scripts_flags,
    run_flags,
)

import flux_train_network
from library.cli.parse import parse_args

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_flux_train_network_flags.json").read_text())
SCRIPT = "flux_train_network.py"
# values for FLUX flags whose type alone gives none that means something here
FLUX_VALUES = {"--model_type": ["chroma"], "--blocks_to_swap": ["4"]}


def _actions() -> dict:
    return {opt: a for a in flux_train_network.build_parser()._actions for opt in a.option_strings}


def test_all_215_flags_exist_with_sd_scripts_defaults():
    actions = _actions()
    assert len(FLAGS) == 215
    assert_sd_scripts_flags(FLAGS, actions, SCRIPT)
    assert_choices_accepted(FLAGS, actions)  # the choices sd-scripts lists are all accepted


@pytest.fixture(scope="module")
def flux_config(tmp_path_factory):
    """The typed configuration flux_train_network.py's run reads for some extra flags, on tiny FLUX.1-dev files."""
    import dataclasses

    import train_network
    from library.families.flux.tiny import build_tiny_flux, write_tiny_files
    from library.run.config import read_config
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("flux_flags")
    files = write_tiny_files(build_tiny_flux("flux-dev"), root / "model")
    data = make_example_dataset(root / "data")
    (data / "p.txt").write_text("a prompt\n")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--clip_l", str(files["clip_l"]), "--t5xxl",
            str(files["t5xxl"]), "--ae", str(files["ae"]), "--train_data_dir", str(data), "--output_dir",
            str(data / "out"), "--network_module", "networks.lora", "--seed", "1"]  # fmt: skip

    def read(*extra: str):
        argv = [*base, *(e.replace("{data}", str(data)) for e in extra)]
        args = parse_args(flux_train_network.build_parser(), argv)
        cfg = read_config(args, flux_train_network.FAMILIES, train_network.AdapterMethod.from_args)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    return read


def _flags():
    return run_flags(flux_train_network.build_parser())


@pytest.mark.parametrize("action", _flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(flux_config, action, caplog):
    flag = action.option_strings[0]
    value = FLUX_VALUES.get(flag) or VALUES.get(flag) or _value(action, SCRIPT)
    assert_flag_acts(flux_config, SCRIPT, action, value, [], caplog)


def test_sd_only_flags_warn_once_and_change_nothing(flux_config, caplog):
    """--v2 --v_parameterization --clip_skip 2 --max_token_length 225 together: the same configuration as without,
    one warning each that names the flag (sd-scripts' FLUX script ignores them)."""
    base = flux_config()
    with caplog.at_level("WARNING"):
        cfg = flux_config("--v2", "--v_parameterization", "--clip_skip", "2", "--max_token_length", "225")
    assert cfg == base
    for flag in ("--v2", "--v_parameterization", "--clip_skip", "--max_token_length"):
        assert sum(flag + " has no effect here" in r.getMessage() for r in caplog.records) == 1, flag


def test_weighted_captions_are_refused_before_training():
    """sd-scripts' FLUX script accepts --weighted_captions and fails at the first step (its FLUX tokenizer has no
    weighting); here the flag stops the run before anything loads, naming itself."""
    import flux_train_network
    from library.cli.problems import ConfigError
    from library.families.flux.options import FluxOptions

    args = flux_train_network.build_parser().parse_args(["--weighted_captions"])
    with pytest.raises(ConfigError, match="--weighted_captions"):
        FluxOptions.from_args(args, training=True)
    FluxOptions.from_args(flux_train_network.build_parser().parse_args([]), training=True)  # without it: read
