"""Every one of sd-scripts' 193 train_network.py flags, 169 train_textual_inversion.py flags and 170
sdxl_train_textual_inversion.py flags (sd-scripts' argparse parsers) is accepted by our script of the same name with
sd-scripts' default, and every flag of a script changes the configuration the run uses or is refused with a message
naming it (sdxl_train_textual_inversion.py shares train_textual_inversion.py's parser and reader)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import train_network
import train_textual_inversion
import train_textual_inversion_XTI
from library.cli.parse import ConfigError, parse_args
from library.run.xti import SAMPLE_FLAGS

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_train_network_flags.json").read_text())
# Defaults we change on purpose (documented in docs/): flag -> reason
DIFFERENT_DEFAULTS = {
    "--save_model_as": "safetensors like sd-scripts' train_network; our choices add diffusers formats for fine-tunes",
}

# sd-scripts script -> (its flags, our parser of the same script; sdxl_train_textual_inversion.py uses the SD one's)
SCRIPTS = {
    "train_network": (FLAGS, train_network.build_parser),
    **{
        name: (json.loads((ROOT / "tests" / "data" / f"sd_scripts_{name}_flags.json").read_text()),
               (train_textual_inversion_XTI if name.endswith("XTI") else train_textual_inversion).build_parser)
        for name in ("train_textual_inversion", "sdxl_train_textual_inversion", "train_textual_inversion_XTI")
    },
}  # fmt: skip


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


def _default_matches(expected, actual) -> bool:
    """sd-scripts' default (as ``_expected`` reads it) == ours: numbers by value, None also as False / []."""
    if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(expected, (int, float)):
        return float(actual) == float(expected)
    if expected is None:
        return actual in (None, False, [])
    return actual == expected or str(actual) == str(expected)


def defaults_that_differ(flags: dict, actions: dict, skip=()) -> dict:
    """flag -> (sd-scripts' default, ours) for every flag of ``flags`` (sd-scripts' list) whose default differs."""
    wrong = {}
    for flag, info in flags.items():
        expected = _expected(info["default"])
        if flag not in skip and not _default_matches(expected, actions[flag].default):
            wrong[flag] = (expected, actions[flag].default)
    return wrong


def assert_sd_scripts_flags(flags: dict, actions: dict, script: str) -> None:
    """Every flag of sd-scripts' ``script`` (``flags``: its argparse list) is one of ours (``actions``: option ->
    action) with sd-scripts' default."""
    missing = sorted(set(flags) - set(actions))
    assert not missing, f"flags of sd-scripts' {script} missing here: {missing}"
    wrong = defaults_that_differ(flags, actions)
    assert not wrong, f"defaults that differ from sd-scripts' {script} (flag: (sd-scripts, ours)): {wrong}"


def assert_choices_accepted(flags: dict, actions: dict) -> None:
    """Every choice sd-scripts lists for a flag (``{a,b}`` in its type) is one of ours."""
    for flag, info in flags.items():
        if "{" in info["type"] and actions[flag].choices:
            theirs = set(info["type"].split("{")[1].rstrip("}").split(","))
            assert theirs - {"None"} <= {str(c) for c in actions[flag].choices}, flag


def run_flags(parser, skip=frozenset()) -> list:
    """The actions of ``parser`` that are run settings: every flag but ``NOT_A_RUN_SETTING`` and ``skip`` (dests)."""
    return [a for a in parser._actions if a.option_strings and a.dest not in NOT_A_RUN_SETTING | set(skip)]


def assert_deepspeed_flag_acts(build_parser, action) -> None:
    """A DeepSpeed flag is read with --deepspeed only, which needs CUDA: it must change the DeepSpeed configuration
    ``DeepSpeedConfig.from_args`` makes from ``build_parser()``'s arguments."""
    from library.run.engines import DeepSpeedConfig

    def ds(*extra: str):
        return DeepSpeedConfig.from_args(build_parser().parse_args(["--deepspeed", *extra]), [])

    flag = action.option_strings[0]
    assert ds(flag, *_value(action)) != ds(), f"{flag} changes nothing DeepSpeed is given"


def test_all_193_flags_exist():
    assert len(FLAGS) == 193
    missing = sorted(set(FLAGS) - set(_actions()))
    assert not missing, f"flags of sd-scripts' train_network.py missing here: {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_defaults_match_sd_scripts(script):
    flags, actions = SCRIPTS[script][0], _actions(script)
    missing = sorted(set(flags) - set(actions))
    assert not missing, f"flags of sd-scripts' {script}.py missing here: {missing}"
    wrong = defaults_that_differ(flags, actions, skip=DIFFERENT_DEFAULTS)
    assert not wrong, f"defaults that differ from sd-scripts' {script}.py (flag: (sd-scripts, ours)): {wrong}"


def test_textual_inversion_flag_counts():
    assert {name: len(SCRIPTS[name][0]) for name in TI_SCRIPTS} == TI_SCRIPTS


TI_SCRIPTS = {"train_textual_inversion": 169, "sdxl_train_textual_inversion": 170, "train_textual_inversion_XTI": 168}


# A value that differs from the default for flags whose type alone does not give a usable one, plus any flag the
# value needs to mean something (e.g. sampling needs prompts).
VALUES = {
    "--resolution": ["64,64"],
    "--face_crop_aug_range": ["2.0,4.0"],
    "--skip_image_resolution": ["32"],
    "--network_args": ["conv_dim=4"],
    "--optimizer_args": ["weight_decay=0.1"],
    "--lr_scheduler_args": ["last_epoch=-1"],
    "--lr_scheduler_type": ["StepLR", "--lr_scheduler_args", "step_size=5"],
    "--text_encoder_lr": ["1e-5"],
    "--lr_warmup_steps": ["10"],
    "--lr_decay_steps": ["10"],
    "--cache_text_encoder_outputs_to_disk": ["--network_train_unet_only"],
    "--sample_every_n_steps": ["5", "--sample_prompts", "{data}/p.txt"],
    "--sample_every_n_epochs": ["5", "--sample_prompts", "{data}/p.txt"],
}
# The same for one script only (textual inversion trains text-encoder rows: no --network_train_unet_only there).
SCRIPT_VALUES = {(script, "--cache_text_encoder_outputs_to_disk"): []
                 for script in ("train_textual_inversion.py", "train_textual_inversion_XTI.py")}  # fmt: skip
# Flags that ask for what sdtrain always does: the run's configuration cannot change, and the run says so in the log
# (or the help says it is the default). flag -> the words the log or the help text carries.
ALWAYS_ON = {
    "--sdpa": "the default",
    "--mem_eff_attn": "SDPA",
    "--highvram": "never empties the CUDA cache",
    "--cache_info": "nothing to cache",
}
# The same for flags that have nothing to act on in one script: (script, flag) -> the words the log or help carries.
# DDP never wraps what the adapter and TI scripts train (the trainer averages its gradients itself).
NO_EFFECT_HERE = {
    (script, flag): "never wrapped in DDP"
    for script in ("train_network.py", "train_textual_inversion.py", "train_textual_inversion_XTI.py")
    for flag in ("--ddp_gradient_as_bucket_view", "--ddp_static_graph")
}
# flux_train_network.py: DDP as above; the SD-only flags sd-scripts' FLUX script ignores (flux/options.py)
NO_EFFECT_HERE.update({("flux_train_network.py", flag): "never wrapped in DDP"
                       for flag in ("--ddp_gradient_as_bucket_view", "--ddp_static_graph")})  # fmt: skip
NO_EFFECT_HERE.update({(script, flag): "has no effect here" for script in ("flux_train_network.py", "flux_train.py")
                       for flag in ("--v2", "--v_parameterization", "--clip_skip", "--max_token_length")})  # fmt: skip
# modes that answer instead of training (--plan_memory: tests/test_plan_memory.py), and the config-file flags
NOT_A_RUN_SETTING = {"help", "config_file", "output_config", "demo", "demo_dir", "plan_memory"}


def _value(action, script: str = "train_network.py") -> list[str]:
    flag = action.option_strings[0]
    if (script, flag) in SCRIPT_VALUES:
        return SCRIPT_VALUES[script, flag]
    if flag in VALUES:
        return VALUES[flag]
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(c for c in action.choices if c is not None and c != action.default))]
    if action.type is int:
        return [str((action.default or 1) + 1)]
    if action.type is float:
        return [str(0.5 if not action.default else action.default * 0.5)]
    return ["x1"]


# Flags whose effect shows only together with another one: flag -> arguments given to both runs compared.
CONTEXT = {("gen_img.py", "--no_half_vae"): ["--fp16"]}
# gen_img.py reads its console-logging flags before its configuration (test_gen_img_console_log_flags).
GEN_IMG_OUTSIDE_CONFIG = {"console_log_level", "console_log_file", "console_log_simple"}


@pytest.fixture(scope="module")
def run_config(tiny_dir, tmp_path_factory):
    """script -> a function giving the typed configuration that script's run uses for some extra flags
    (train_network.py: session.read_config, every group and cross-check; gen_img.py: GenImgConfig.from_args)."""
    import dataclasses

    import gen_img
    from library.run.config import read_config
    from library.run.demo import make_example_dataset
    from library.sampling.inference import GenImgConfig

    data = make_example_dataset(tmp_path_factory.mktemp("flags_data"))
    (data / "p.txt").write_text("a prompt\n")
    bases = {
        "train_network.py": ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir", str(data),
                             "--output_dir", str(data / "out"), "--network_module", "networks.lora", "--seed", "1"],
        "gen_img.py": ["--ckpt", str(tiny_dir / "sd1"), "--outdir", str(data / "img"), "--prompt", "a cat",
                       "--seed", "1"],
        "train_textual_inversion.py": ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir",
                                       str(data), "--output_dir", str(data / "out"), "--token_string", "sksx",
                                       "--init_word", "cat", "--seed", "1"],
    }  # fmt: skip
    bases["train_textual_inversion_XTI.py"] = bases["train_textual_inversion.py"]

    def train(argv):
        cfg = read_config(parse_args(_parser(), argv), ("sd1", "sd2"), train_network.AdapterMethod.from_args)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    def gen(argv):
        return GenImgConfig.from_args(parse_args(gen_img.build_parser(), argv))

    def ti(argv):
        from library.run.token_embeddings import TextualInversionConfig

        args = parse_args(train_textual_inversion.build_parser(), argv)
        args.output_name = args.output_name or args.token_string  # as train_textual_inversion.run
        cfg = read_config(args, ("sd1", "sd2"), TextualInversionConfig.from_args)
        return dataclasses.replace(cfg, args={})

    def xti(argv):
        from library.run.xti import XTIConfig

        args = parse_args(train_textual_inversion_XTI.build_parser(), argv)
        args.output_name = args.output_name or args.token_string  # as train_textual_inversion_XTI.run
        cfg = read_config(args, ("sd1", "sd2"), XTIConfig.from_args)
        return dataclasses.replace(cfg, args={})

    readers = {"train_network.py": train, "gen_img.py": gen, "train_textual_inversion.py": ti,
               "train_textual_inversion_XTI.py": xti}  # fmt: skip

    def read(script: str, *extra: str):
        extra = tuple(e.replace("{data}", str(data)) for e in extra)
        return readers[script]([*bases[script], *extra])

    return read


def _run_flags():
    import gen_img

    out = [("train_network.py", a) for a in _parser()._actions if a.option_strings and a.dest not in NOT_A_RUN_SETTING]
    skip = NOT_A_RUN_SETTING | GEN_IMG_OUTSIDE_CONFIG
    out += [("gen_img.py", a) for a in gen_img.build_parser()._actions if a.option_strings and a.dest not in skip]
    ti = _parser("train_textual_inversion")._actions
    out += [("train_textual_inversion.py", a) for a in ti if a.option_strings and a.dest not in NOT_A_RUN_SETTING]
    # train_textual_inversion_XTI.py: textual inversion's parser (test_xti_parser_is_textual_inversions) and reader
    # but for the sampling flags, which it refuses
    xti = _parser("train_textual_inversion_XTI")._actions
    out += [("train_textual_inversion_XTI.py", a) for a in xti if a.dest in SAMPLE_FLAGS]
    return out


def test_xti_parser_is_textual_inversions():
    """Every flag of train_textual_inversion_XTI.py is one of train_textual_inversion.py's with the same default, so
    the flag-effect test of the latter covers it (the XTI reader differs in SAMPLE_FLAGS only: library/run/xti.py)."""
    xti, ti = _actions("train_textual_inversion_XTI"), _actions("train_textual_inversion")
    assert set(xti) == set(ti) and all(xti[f].default == ti[f].default for f in xti)


@pytest.mark.parametrize("script,action", _run_flags(), ids=lambda x: x if isinstance(x, str) else x.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(run_config, script, action, caplog):
    """Setting the flag to a value other than its default either changes the typed configuration the run uses, or
    the run refuses it with a message that names the flag. Flags that ask for what sdtrain always does are listed
    in ALWAYS_ON and must say so."""
    flag = action.option_strings[0]
    assert_flag_acts(lambda *extra: run_config(script, *extra), script, action, _value(action, script),
                     CONTEXT.get((script, flag), []), caplog)  # fmt: skip


def assert_flag_acts(read, script: str, action, value: list[str], context: list[str], caplog) -> None:
    """``read(*flags)`` (the typed configuration a run uses) changes when the flag is set to ``value``, or raises a
    ConfigError that names the flag; a flag in ALWAYS_ON (or NO_EFFECT_HERE for ``script``) leaves it unchanged and
    says why. ``context``: flags given to both reads."""
    flag = action.option_strings[0]
    said = ALWAYS_ON.get(flag) or NO_EFFECT_HERE.get((script, flag))
    base = read(*context)
    try:
        with caplog.at_level("INFO"):
            changed = read(*context, flag, *value)
    except ConfigError as e:
        assert flag in str(e), f"{flag}: refused with a message that does not name it: {e}"
        return
    if said:
        assert changed == base, f"{script} {flag}: listed as having no effect, yet it changes the configuration"
        assert said in caplog.text + (action.help or ""), f"{flag}: says nothing about having no effect"
        return
    assert changed != base, f"{script} {flag} is accepted but changes nothing the run reads (a silent no-op)"


def test_gen_img_console_log_flags(tiny_dir, tmp_path):
    import gen_img

    log = tmp_path / "gen.log"
    gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--outdir", str(tmp_path), "--prompt", "a cat", "--steps", "2",
                  "--W", "64", "--H", "64", "--console_log_file", str(log), "--console_log_simple",
                  "--console_log_level", "INFO"])  # fmt: skip
    lines = log.read_text().splitlines()
    assert any("image(s)" in line for line in lines) and not any(line.startswith("INFO") for line in lines)


@pytest.mark.parametrize(
    "script,flag",
    sorted(
        (script, f) for script in ("train_network", "train_textual_inversion")
        for f, a in _actions(script).items() if f in SCRIPTS[script][0] and hasattr(a, "unsupported_reason")
    ),
)  # fmt: skip
def test_refused_flags_say_not_supported_yet(script, flag):
    action = _actions(script)[flag]
    value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else "1"]
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(_parser(script), [flag, *[str(v) for v in value]])
