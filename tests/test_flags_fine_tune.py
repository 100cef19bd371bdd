"""Every one of sd-scripts' fine_tune.py (167), sdxl_train.py (176) and train_db.py (169) flags (its
argparse parsers) is accepted by our script of the same name with sd-scripts' default, and in each of the three
scripts a value other than the default changes the typed configuration that script's run uses
(``fine_tune.read_config``), or is refused with a message naming the flag (as tests/test_flags.py does for
train_network.py). The scripts share readers but not their rules (train_db.py trains the text encoder by default,
sdxl_train.py leaves the UNet out at --learning_rate 0), so a flag is checked in every script that has it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_flags import _expected

import fine_tune
from library.cli.parse import ConfigError, parse_args
from library.families import get_family
from library.run.model_trainable import ModelTrainingConfig

ROOT = Path(__file__).resolve().parents[1]
COUNTS = {"fine_tune": 167, "sdxl_train": 176, "train_db": 169}
FLAGS = {s: json.loads((ROOT / "tests" / "data" / f"sd_scripts_{s}_flags.json").read_text()) for s in COUNTS}


def _actions(script: str) -> dict:
    return {opt: a for a in __import__(script).build_parser()._actions for opt in a.option_strings}


def _default_ok(expected, actual) -> bool:
    if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
        return float(actual) == float(expected)
    if expected is None:
        return actual in (None, False, [])
    return actual == expected or str(actual) == str(expected)


@pytest.mark.parametrize("script", COUNTS)
def test_flags_exist_with_sd_scripts_defaults(script):
    flags, actions = FLAGS[script], _actions(script)
    assert len(flags) == COUNTS[script]
    missing = sorted(set(flags) - set(actions))
    assert not missing, f"flags of sd-scripts' {script}.py missing here: {missing}"
    wrong = {f: (i["default"], actions[f].default) for f, i in flags.items()
             if not _default_ok(_expected(i["default"]), actions[f].default)}  # fmt: skip
    assert not wrong, f"defaults that differ from sd-scripts' {script}.py (flag: (sd-scripts, ours)): {wrong}"


# values for flags of the full trainers whose type alone gives none that means something here
FT_VALUES = {
    "--block_lr": [",".join(["1e-5"] * 23)],
    "--learning_rate_te": ["1e-5"],
    "--learning_rate_te1": ["1e-5"],
    "--learning_rate_te2": ["1e-5"],
    "--stop_text_encoder_training": ["5"],
    "--fused_optimizer_groups": ["2"],
    "--cache_text_encoder_outputs": ["--stop_text_encoder_training", "-1"],
    "--cache_text_encoder_outputs_to_disk": ["--stop_text_encoder_training", "-1"],
}
DEEPSPEED_FLAGS = {"--zero_stage", "--offload_optimizer_device", "--offload_optimizer_nvme_path",
                   "--offload_param_device", "--offload_param_nvme_path", "--zero3_init_flag", "--zero3_save_16bit_model",
                   "--fp16_master_weights_and_gradients"}  # fmt: skip
# flags that act only together with another one: flag -> arguments given to both runs compared (train_db.py
# trains the text encoder without being asked and has no --train_text_encoder)
FT_CONTEXT = {"--learning_rate_te": ["--train_text_encoder"], "--learning_rate_te1": ["--train_text_encoder"],
              "--learning_rate_te2": ["--train_text_encoder"]}  # fmt: skip
FT_SCRIPT_CONTEXT = {("train_db", "--learning_rate_te"): []}
FT_BASE = {"sdxl_train": "sdxl"}  # the tiny model each script reads (sd1 otherwise)
# train_db.py trains the text encoder unless told -1; fine_tune.py / sdxl_train.py only with --train_text_encoder
FT_SCRIPT_VALUES = {("fine_tune", "--cache_text_encoder_outputs"): [],
                    ("fine_tune", "--cache_text_encoder_outputs_to_disk"): [],
                    ("sdxl_train", "--cache_text_encoder_outputs"): [],
                    ("sdxl_train", "--cache_text_encoder_outputs_to_disk"): []}  # fmt: skip


@pytest.fixture(scope="module")
def ft_config(tiny_dir, tmp_path_factory):
    """script -> the typed configuration its run reads for some extra flags (fine_tune.read_config: the
    script's parser, every group's reader and every cross-check)."""
    import dataclasses

    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path_factory.mktemp("ft_flags_data"))
    (data / "p.txt").write_text("a prompt\n")

    def read(script: str, *extra: str):
        model = tiny_dir / FT_BASE.get(script, "sd1")
        argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir",
                str(data / "out"), "--seed", "1", *[e.replace("{data}", str(data)) for e in extra]]  # fmt: skip
        module = __import__(script)  # its parser, families and training type, as its run reads them
        training = "dreambooth" if script == "train_db" else "fine_tune"
        cfg = fine_tune.read_config(argv, module.FAMILIES, module.build_parser, training=training)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    return read


def _ft_flags():
    """Every flag of each of the three scripts."""
    from test_flags import NOT_A_RUN_SETTING

    return [
        (script, a)
        for script in COUNTS
        for a in __import__(script).build_parser()._actions
        if a.option_strings and a.dest not in NOT_A_RUN_SETTING
    ]


@pytest.mark.parametrize("script,action", _ft_flags(), ids=lambda x: x if isinstance(x, str) else x.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(ft_config, script, action, caplog):
    """Setting the flag to a value other than its default either changes the typed configuration the run uses, or
    the run refuses it with a message that names the flag (flags that ask for what sdtrain always does say so)."""
    from test_flags import VALUES, _value, assert_deepspeed_flag_acts, assert_flag_acts

    flag = action.option_strings[0]
    if flag in DEEPSPEED_FLAGS:  # read with --deepspeed only, which needs CUDA
        assert_deepspeed_flag_acts(lambda: __import__(script).build_parser(), action)
        return
    if (script, flag) in FT_SCRIPT_VALUES:
        value = FT_SCRIPT_VALUES[script, flag]
    elif flag in FT_VALUES:
        value = FT_VALUES[flag]
    else:
        value = VALUES.get(flag) or _value(action)
    context = FT_SCRIPT_CONTEXT.get((script, flag), FT_CONTEXT.get(flag, []))
    assert_flag_acts(lambda *extra: ft_config(script, *extra), script, action, value, context, caplog)


@pytest.mark.parametrize(
    "script, flags, trained",
    [
        ("sdxl_train", [], ("denoiser",)),
        ("sdxl_train", ["--learning_rate", "0", "--train_text_encoder", "--learning_rate_te2", "1e-5"],
         ("text_encoders",)),
        ("sdxl_train", ["--train_text_encoder", "--learning_rate_te1", "0", "--learning_rate_te2", "0"],
         ("denoiser",)),
        ("fine_tune", ["--learning_rate", "0"], ("denoiser",)),
        ("train_db", ["--learning_rate", "0"], ("denoiser", "text_encoders")),
        ("train_db", ["--stop_text_encoder_training", "-1"], ("denoiser",)),
    ],
)  # fmt: skip
def test_learning_rates_of_zero_pick_the_trained_parts_as_sd_scripts(ft_config, script, flags, trained):
    """sd-scripts' rules per script: sdxl_train.py trains a part only when its lr is not 0 (the UNet:
    --learning_rate; an encoder: its own lr, else --learning_rate); fine_tune.py / train_db.py always train the UNet
    (at lr 0 if asked), train_db.py the text encoder too unless --stop_text_encoder_training -1."""
    assert ft_config(script, *flags).trained_parts == trained


REFUSED = sorted(
    (script, flag) for script in COUNTS for flag, a in _actions(script).items()
    if flag in FLAGS[script] and hasattr(a, "unsupported_reason")
)  # fmt: skip


@pytest.mark.parametrize("script, flag", REFUSED)
def test_refused_flags_say_not_supported_yet(script, flag):
    action = _actions(script)[flag]
    value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else "1"]
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(__import__(script).build_parser(), [flag, *[str(v) for v in value]])


def test_the_deepspeed_flags_are_real_flags_here():
    assert not hasattr(_actions("sdxl_train")["--deepspeed"], "unsupported_reason")


def test_no_token_padding_is_read_in_train_db_only():
    """train_db.py's --no_token_padding is a real flag (read by ModelTrainingConfig); sd-scripts' fine_tune.py and
    sdxl_train.py have no such flag, and neither do we."""
    action = _actions("train_db")["--no_token_padding"]
    assert not hasattr(action, "unsupported_reason") and ("train_db", "--no_token_padding") not in REFUSED
    assert all("--no_token_padding" not in _actions(s) for s in ("fine_tune", "sdxl_train"))
    args = __import__("train_db").build_parser().parse_args(["--no_token_padding"])
    assert ModelTrainingConfig.reader(get_family("sd1"), "dreambooth")(args).no_token_padding
