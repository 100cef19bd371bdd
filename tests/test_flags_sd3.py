"""Every one of sd-scripts' 218 sd3_train_network.py flags (train_network.py's 193 and 25 of SD3's) is accepted by
our sd3_train_network.py with sd-scripts' default, and a value other than the default changes the typed
configuration the run uses (``library.run.config.read_config`` with the SD3 families and ``SD3Options``), or is refused
with a message naming the flag; the SD-only flags and sd-scripts' "[DOES NOT WORK]" flags say so once and change
nothing; SD3Options (the SD3 families' ``options``) holds every SD3 model flag as a typed field that the family's
``load`` keeps as ``parts.options``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_flags import assert_choices_accepted, assert_sd_scripts_flags

import sd3_train_network
from library.cli.problems import ConfigError
from library.families.sd3.options import DOES_NOT_WORK, SD_ONLY_FLAGS, SD3Options

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_sd3_train_network_flags.json").read_text())
SCRIPT = "sd3_train_network.py"
# The SD3 model flags the options hold (the family contract of issue 22, typed since issue 32).
LOAD_KEYWORDS = {"clip_l", "clip_g", "t5xxl", "t5xxl_max_token_length", "apply_lg_attn_mask", "apply_t5_attn_mask",
                 "clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate", "pos_emb_random_crop_rate",
                 "enable_scaled_pos_embed"}  # fmt: skip


def _parse(*argv: str):
    return sd3_train_network.build_parser().parse_args(list(argv))


def _read(args) -> SD3Options:
    return SD3Options.from_args(args, training=True)


def _fields(options: SD3Options) -> dict:
    return {k: getattr(options, k) for k in LOAD_KEYWORDS}


def _actions() -> dict:
    return {opt: a for a in sd3_train_network.build_parser()._actions for opt in a.option_strings}


def test_all_218_flags_exist_with_sd_scripts_defaults():
    actions = _actions()
    assert len(FLAGS) == 218
    assert_sd_scripts_flags(FLAGS, actions, SCRIPT)
    assert_choices_accepted(FLAGS, actions)  # the choices sd-scripts lists are all accepted


def test_options_give_the_family_contract_keywords():
    """Defaults: sd-scripts' (T5 256 tokens, no masks, no dropout); every SD3 model flag reaches load_kwargs under its
    own name, and the metadata carries sd-scripts' two SD3 keys."""
    base = _read(_parse())
    assert base.t5xxl_max_token_length == 256 and base.flow is not None
    assert base.metadata() == {"ss_apply_lg_attn_mask": False, "ss_apply_t5_attn_mask": False}
    given = _read(_parse(
        "--t5xxl_max_token_length", "77", "--apply_lg_attn_mask", "--apply_t5_attn_mask", "--clip_l_dropout_rate",
        "0.1", "--clip_g_dropout_rate", "0.2", "--t5_dropout_rate", "0.3", "--pos_emb_random_crop_rate", "0.4",
        "--enable_scaled_pos_embed", "--text_encoder_batch_size", "3"))  # fmt: skip
    assert _fields(given) == {**_fields(base), "t5xxl_max_token_length": 77, "apply_lg_attn_mask": True,
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
        _read(args)
    text = str(e.value)
    for flag in ("--clip_g", "--t5xxl_max_token_length", "--t5_dropout_rate", "--pos_emb_random_crop_rate",
                 "--clip_l_dropout_rate", "--text_encoder_batch_size", "--weighted_captions"):  # fmt: skip
        assert flag in text, flag
    assert "missing.safetensors" in text and "no such file" in text


def test_encoder_flags_take_the_diffusers_folders_the_loader_reads(tmp_path):
    """--clip_l / --clip_g / --t5xxl may name a diffusers folder (the SD3 loader reads text_encoder*/ there): the
    options accept an existing folder, and still name a missing one."""
    (tmp_path / "text_encoder").mkdir()
    options = _read(_parse("--clip_l", str(tmp_path / "text_encoder"), "--clip_g", str(tmp_path)))
    assert options.clip_l == str(tmp_path / "text_encoder")
    with pytest.raises(ConfigError, match="no_folder: no such file or folder"):
        _read(_parse("--t5xxl", str(tmp_path / "no_folder")))


def test_family_problems_medium_only_flags_and_other_families():
    """--pos_emb_random_crop_rate and --enable_scaled_pos_embed are for SD3.5-medium only (sd-scripts' docs); a model
    of another family is named with the script's families."""

    def family(name, title):  # the spec of the family read from the weights
        return SimpleNamespace(name=name, title=title)

    plain = _read(_parse())
    tricks = _read(_parse("--pos_emb_random_crop_rate", "0.5", "--enable_scaled_pos_embed"))
    assert tricks.problems(family("sd3.5-medium", "SD3.5 medium"), "m.safetensors") == []
    for name in ("sd3", "sd3.5-large"):
        assert plain.problems(family(name, name), "m.safetensors") == []
        problems = tricks.problems(family(name, name), "m.safetensors")
        assert len(problems) == 2 and "--pos_emb_random_crop_rate" in problems[0]
        assert "--enable_scaled_pos_embed" in problems[1] and "SD3.5-medium" in problems[1]
    (other,) = plain.problems(family("flux-dev", "FLUX.1 dev"), "f.safetensors")
    assert "FLUX.1 dev" in other and "sd3_train_network.py" in other


def test_sd_only_and_does_not_work_flags_are_marked():
    """The flags sd-scripts' SD3 script accepts and never reads carry the no-effect mark the run layer acts on."""
    actions = _actions()
    for flag in (*SD_ONLY_FLAGS, *DOES_NOT_WORK):
        assert getattr(actions[flag], "no_effect_reason", None), flag


def test_load_takes_the_options_and_the_options_hold_every_model_flag():
    import dataclasses
    import inspect

    from library.families import get_family

    assert LOAD_KEYWORDS <= {f.name for f in dataclasses.fields(SD3Options)}
    for name in sd3_train_network.FAMILIES:
        family = get_family(name)
        assert family.options is SD3Options and "options" in inspect.signature(family.load).parameters


@pytest.fixture(scope="module")
def sd3_files(tmp_path_factory):
    """Tiny SD3.5-medium files: the SAI file without its encoders, and the separate CLIP-L / CLIP-G / T5 files."""
    from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files

    return write_tiny_files(build_tiny_sd3("sd3.5-medium"), tmp_path_factory.mktemp("sd3_files"), text_encoders=False)


@pytest.fixture(scope="module")
def sd3_config(sd3_files, tmp_path_factory):
    """The typed configuration sd3_train_network.py's run reads for some extra flags, on tiny SD3.5-medium files
    (the SAI file without its encoders, and --clip_l --clip_g --t5xxl)."""
    import dataclasses

    import train_network
    from library.cli.parse import parse_args
    from library.run.config import read_config
    from library.run.demo import make_example_dataset

    root, files = tmp_path_factory.mktemp("sd3_flags"), sd3_files
    data = make_example_dataset(root / "data")
    (data / "p.txt").write_text("a prompt\n")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--clip_l", str(files["clip_l"]), "--clip_g",
            str(files["clip_g"]), "--t5xxl", str(files["t5xxl"]), "--train_data_dir", str(data), "--output_dir",
            str(data / "out"), "--network_module", "networks.lora", "--seed", "1"]  # fmt: skip

    def read(*extra: str):
        argv = [*base, *(e.replace("{data}", str(data)) for e in extra)]
        args = parse_args(sd3_train_network.build_parser(), argv)
        cfg = read_config(args, sd3_train_network.FAMILIES, train_network.AdapterMethod.from_args)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    return read


# values for SD3 flags whose type alone gives none that means something here
SD3_VALUES = {"--blocks_to_swap": ["1"]}


def _flags():
    from test_flags import run_flags

    # the base command line gives clip_l / clip_g / t5xxl (a test below)
    return run_flags(sd3_train_network.build_parser(), skip={"clip_l", "clip_g", "t5xxl"})


@pytest.mark.parametrize("action", _flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(sd3_config, action, caplog):
    import test_flags
    from test_flags import VALUES, _value, assert_flag_acts

    no_effect = {(SCRIPT, flag): "never wrapped in DDP" for flag in ("--ddp_gradient_as_bucket_view",
                                                                     "--ddp_static_graph")}  # fmt: skip
    no_effect.update({(SCRIPT, flag): "has no effect here" for flag in (*SD_ONLY_FLAGS, *DOES_NOT_WORK)})
    flag = action.option_strings[0]
    value = SD3_VALUES.get(flag) or VALUES.get(flag) or _value(action, SCRIPT)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(test_flags, "NO_EFFECT_HERE", {**test_flags.NO_EFFECT_HERE, **no_effect})
        assert_flag_acts(sd3_config, SCRIPT, action, value, [], caplog)


def test_the_encoder_files_are_read(sd3_config, tmp_path):
    """--clip_l --clip_g --t5xxl (given by the base command line) reach the family's load keywords; a missing file
    is refused naming its flag."""
    cfg = sd3_config()
    assert cfg.options.clip_g is not None and cfg.options.t5xxl.endswith("t5xxl.safetensors")
    with pytest.raises(ConfigError, match="--clip_l"):
        sd3_config("--clip_l", str(tmp_path / "missing.safetensors"))


def test_sd3_model_flags_change_what_the_family_computes(sd3_files):
    """Direct checks, from the command line through SD3Options into the family: --t5xxl_max_token_length
    sets T5's token count in the context (77 CLIP + T5 tokens); --apply_t5_attn_mask / --apply_lg_attn_mask mask
    the padding in T5's / the CLIP models' attention (sd-scripts passes the masks to the encoders), changing that
    part of the context only; --t5_dropout_rate 1 zeroes T5's part of the context in
    a training step's prediction (grad enabled), not in inference; --pos_emb_random_crop_rate 1 moves the
    position-embedding crop in training steps."""
    from library.families import get_family

    family = get_family("sd3.5-medium")
    files = ["--clip_l", str(sd3_files["clip_l"]), "--clip_g", str(sd3_files["clip_g"]), "--t5xxl",
             str(sd3_files["t5xxl"])]  # fmt: skip

    def load(*flags: str):
        return family.load(str(sd3_files["model"]), options=_read(_parse(*files, *flags)))

    captions = ["a cat"]
    base = load()
    plain = family.encode_prompt(base, captions).hidden_states
    assert plain.shape[1] == 77 + 256
    assert family.encode_prompt(load("--t5xxl_max_token_length", "77"), captions).hidden_states.shape[1] == 77 + 77
    t5_masked = family.encode_prompt(load("--apply_t5_attn_mask"), captions).hidden_states
    assert not torch.equal(t5_masked[:, 77:], plain[:, 77:]) and torch.equal(t5_masked[:, :77], plain[:, :77])
    lg_masked = family.encode_prompt(load("--apply_lg_attn_mask"), captions).hidden_states
    assert not torch.equal(lg_masked[:, :77], plain[:, :77]) and torch.equal(lg_masked[:, 77:], plain[:, 77:])

    dropped = load("--t5_dropout_rate", "1")
    objective_options = family.training_objective(dropped, *_noise_and_loss()).predict_options
    cond = family.encode_prompt(dropped, captions)
    noisy, t = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500.0])
    zeroed = type(cond)(cond.hidden_states.clone(), cond.pooled)
    zeroed.hidden_states[:, 77:] = 0
    with torch.enable_grad():
        trained = family.predict(dropped.denoiser, noisy, t, cond, **objective_options)
        expected = family.predict(dropped.denoiser, noisy, t, zeroed)
    torch.testing.assert_close(trained, expected)
    with torch.no_grad():
        assert not torch.equal(family.predict(dropped.denoiser, noisy, t, cond, **objective_options), expected)

    cropped = load("--pos_emb_random_crop_rate", "1")
    with torch.enable_grad():
        torch.manual_seed(0)
        a = family.predict(cropped.denoiser, noisy, t, cond)
        b = family.predict(base.denoiser, noisy, t, cond)
    assert not torch.equal(a, b)
    with torch.no_grad():
        torch.testing.assert_close(family.predict(cropped.denoiser, noisy, t, cond),
                                   family.predict(base.denoiser, noisy, t, cond))  # fmt: skip


def _noise_and_loss():
    """The run's default noise and loss settings as sd3_train_network.py reads them."""
    from library.objectives.losses import LossConfig
    from library.objectives.noising import NoiseConfig

    args = _parse()
    return NoiseConfig.from_args(args), LossConfig.from_args(args)
