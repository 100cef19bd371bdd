"""Every one of sd-scripts' 194 flux_train.py flags (195 with --help) is accepted by our flux_train.py with sd-scripts'
default, and a value other than the default changes the typed configuration the run uses (``library.run.config.read_config``
with the FLUX families, ``ModelTrainingConfig`` and ``FluxOptions``), or is refused with a message naming the flag;
the SD-only flags sd-scripts' FLUX script ignores say so once and change nothing. sd-scripts' flux_train.py trains the
transformer only: ``--train_text_encoder`` is not one of its flags, and is refused here as an unknown flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_flags import (
    VALUES,
    _value,
    assert_deepspeed_flag_acts,
    assert_flag_acts,
    assert_sd_scripts_flags,
    run_flags,
)

import flux_train

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_flux_train_flags.json").read_text())
SCRIPT = "flux_train.py"
# values whose type alone gives none that means something here (the tiny model has 11 + 20 blocks)
FT_VALUES = {"--model_type": ["chroma"], "--blocks_to_swap": ["4"], "--double_blocks_to_swap": ["2"],
             "--single_blocks_to_swap": ["4"], "--save_model_as": ["diffusers"], "--cache_text_encoder_outputs": [],
             "--cache_text_encoder_outputs_to_disk": []}  # fmt: skip
# flags that act only together with another one: flag -> arguments given to both reads compared
FT_CONTEXT = {"--use_safetensors": ["--save_model_as", "diffusers"]}


def _actions() -> dict:
    return {opt: a for a in flux_train.build_parser()._actions for opt in a.option_strings}


def test_all_194_flags_exist_with_sd_scripts_defaults():
    actions = _actions()
    assert len(FLAGS) == 194
    assert_sd_scripts_flags(FLAGS, actions, SCRIPT)
    for flag in ("--train_text_encoder", "--learning_rate_te1", "--block_lr"):  # sdxl_train.py's, not flux_train.py's
        assert flag not in actions and flag not in FLAGS


@pytest.fixture(scope="module")
def ft_config(tmp_path_factory):
    """The typed configuration flux_train.py's run reads for some extra flags, on tiny FLUX.1-dev files."""
    import dataclasses

    import fine_tune
    from library.families.flux.tiny import build_tiny_flux, write_tiny_files
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("flux_ft_flags")
    files = write_tiny_files(build_tiny_flux("flux-dev", blocks=(11, 20)), root / "model")
    data = make_example_dataset(root / "data")
    (data / "p.txt").write_text("a prompt\n")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--clip_l", str(files["clip_l"]), "--t5xxl",
            str(files["t5xxl"]), "--ae", str(files["ae"]), "--train_data_dir", str(data), "--output_dir",
            str(data / "out"), "--seed", "1"]  # fmt: skip

    def read(*extra: str):
        argv = [*base, *(e.replace("{data}", str(data)) for e in extra)]
        cfg = fine_tune.read_config(argv, flux_train.FAMILIES, flux_train.build_parser, flux_train.FORMATS)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    return read


def _flags():
    return run_flags(flux_train.build_parser())


@pytest.mark.parametrize("action", _flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(ft_config, action, caplog):
    from test_flags_fine_tune import DEEPSPEED_FLAGS

    flag = action.option_strings[0]
    if flag in DEEPSPEED_FLAGS:  # read with --deepspeed only, which needs CUDA
        assert_deepspeed_flag_acts(flux_train.build_parser, action)
        return
    value = FT_VALUES[flag] if flag in FT_VALUES else VALUES.get(flag) or _value(action, SCRIPT)
    assert_flag_acts(ft_config, SCRIPT, action, value, FT_CONTEXT.get(flag, []), caplog)


def test_deprecated_swap_flags_read_as_sd_scripts_reads_them(ft_config, caplog):
    """sd-scripts' flux_train.py: without --blocks_to_swap, N = --double_blocks_to_swap + --single_blocks_to_swap // 2
    (with a deprecation warning); --blocks_to_swap given wins."""
    with caplog.at_level("WARNING"):
        cfg = ft_config("--double_blocks_to_swap", "3", "--single_blocks_to_swap", "5")
    assert cfg.block_swap.blocks_to_swap == 3 + 5 // 2 and "deprecated" in caplog.text
    assert cfg.method.block_swap
    assert ft_config("--blocks_to_swap", "4", "--double_blocks_to_swap", "3").block_swap.blocks_to_swap == 4
    assert ft_config("--skip_latents_validity_check") == ft_config("--skip_cache_check")


def test_refusals_name_the_flag(ft_config):
    """A pickle output (FLUX files are BFL safetensors or diffusers folders), two fused modes at once, and
    --train_text_encoder (not a flag of sd-scripts' flux_train.py) stop the run before anything loads."""
    from library.cli.problems import ConfigError

    with pytest.raises(ConfigError, match="ckpt"):
        ft_config("--save_model_as", "ckpt")
    with pytest.raises(ConfigError, match="--fused_backward_pass and --blockwise_fused_optimizers"):
        ft_config("--optimizer_type", "adafactor", "--fused_backward_pass", "--blockwise_fused_optimizers")
    with pytest.raises(SystemExit):
        flux_train.build_parser().parse_args(["--train_text_encoder"])
