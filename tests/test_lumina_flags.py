"""Every one of sd-scripts' lumina_train_network.py flags (213: train_network.py's and Lumina's 20) and
lumina_train.py flags (191) is accepted by our script of the same name with sd-scripts' default, and a value other than
the default changes the typed configuration the run uses (``library.run.config.read_config`` with the Lumina 2 family
and ``LuminaOptions``), or is refused with a message naming the flag; the SD-only flags sd-scripts' Lumina scripts
ignore say so once and change nothing. (The flag lists are sd-scripts' own parsers, dumped to tests/data.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_flags import (
    NO_EFFECT_HERE,
    VALUES,
    _value,
    assert_choices_accepted,
    assert_deepspeed_flag_acts,
    assert_flag_acts,
    assert_sd_scripts_flags,
    run_flags,
)

import lumina_train
import lumina_train_network
from library.cli.parse import parse_args

ROOT = Path(__file__).resolve().parents[1]
FLAGS = {s: json.loads((ROOT / "tests" / "data" / f"sd_scripts_{s}_flags.json").read_text())
         for s in ("lumina_train_network", "lumina_train")}  # fmt: skip
# values whose type alone gives none that means something here
LUMINA_VALUES = {"--blocks_to_swap": ["4"], "--gemma2_max_token_length": ["128"], "--save_model_as": ["diffusers"],
                 "--cache_text_encoder_outputs": [], "--cache_text_encoder_outputs_to_disk": []}  # fmt: skip
FT_CONTEXT = {"--use_safetensors": ["--save_model_as", "diffusers"]}
# the SD-only flags sd-scripts' Lumina scripts ignore (lumina/options.py): said once, no effect (script-specific keys)
NO_EFFECT_HERE.update({(script, flag): "has no effect here" for script in ("lumina_train_network.py", "lumina_train.py")
                       for flag in ("--v2", "--v_parameterization", "--clip_skip", "--max_token_length")})  # fmt: skip
NO_EFFECT_HERE.update({("lumina_train_network.py", flag): "never wrapped in DDP"
                       for flag in ("--ddp_gradient_as_bucket_view", "--ddp_static_graph")})  # fmt: skip


@pytest.mark.parametrize("script", [lumina_train_network, lumina_train], ids=lambda m: m.__name__)
def test_every_sd_scripts_flag_exists_with_its_default(script):
    flags = FLAGS[script.__name__]
    actions = {opt: a for a in script.build_parser()._actions for opt in a.option_strings}
    assert len(flags) == {"lumina_train_network": 213, "lumina_train": 191}[script.__name__]
    assert_sd_scripts_flags(flags, actions, script.__name__ + ".py")
    assert_choices_accepted(flags, actions)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The typed configuration each script's run reads for some extra flags, on tiny Lumina 2 files."""
    import fine_tune
    import train_network
    from library.families.lumina.tiny import build_tiny_lumina, write_tiny_files
    from library.run.config import read_config
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("lumina_flags")
    files = write_tiny_files(build_tiny_lumina(layers=6), root / "model")
    data = make_example_dataset(root / "data")
    (data / "p.txt").write_text("a prompt\n")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--gemma2", str(files["gemma2"]), "--ae",
            str(files["ae"]), "--train_data_dir", str(data), "--output_dir", str(data / "out"), "--seed", "1"]  # fmt: skip

    def network(*extra: str):
        argv = [*base, "--network_module", "networks.lora_lumina", *(e.replace("{data}", str(data)) for e in extra)]
        args = parse_args(lumina_train_network.build_parser(), argv)
        cfg = read_config(args, lumina_train_network.FAMILIES, train_network.AdapterMethod.from_args)
        return dataclasses.replace(cfg, args={})

    def full(*extra: str):
        argv = [*base, *(e.replace("{data}", str(data)) for e in extra)]
        cfg = fine_tune.read_config(argv, lumina_train.FAMILIES, lumina_train.build_parser, lumina_train.FORMATS)
        return dataclasses.replace(cfg, args={})

    return {"lumina_train_network": network, "lumina_train": full}


CASES = [(s, a) for s in (lumina_train_network, lumina_train) for a in run_flags(s.build_parser())]


@pytest.mark.parametrize("script,action", CASES, ids=lambda x: getattr(x, "option_strings", [getattr(x, "__name__",
                                                                                                    "")])[0])  # fmt: skip
def test_every_flag_changes_the_run_or_is_refused(configs, script, action, caplog):
    from test_flags_fine_tune import DEEPSPEED_FLAGS

    flag = action.option_strings[0]
    if flag in DEEPSPEED_FLAGS:  # read with --deepspeed only, which needs CUDA
        assert_deepspeed_flag_acts(script.build_parser, action)
        return
    value = LUMINA_VALUES[flag] if flag in LUMINA_VALUES else VALUES.get(flag) or _value(action, script.__name__)
    context = FT_CONTEXT.get(flag, []) if script is lumina_train else []
    assert_flag_acts(configs[script.__name__], script.__name__ + ".py", action, value, context, caplog)


def test_sd_only_flags_warn_once_and_change_nothing(configs, caplog):
    read = configs["lumina_train_network"]
    base = read()
    with caplog.at_level("WARNING"):
        cfg = read("--v2", "--v_parameterization", "--clip_skip", "2", "--max_token_length", "225")
    assert cfg == base
    for flag in ("--v2", "--v_parameterization", "--clip_skip", "--max_token_length"):
        assert sum(flag + " has no effect here" in r.getMessage() for r in caplog.records) == 1, flag
