"""Every one of sd-scripts' 201 sd3_train.py flags (202 with --help) is accepted by our sd3_train.py with sd-scripts'
default, and a value other than the default changes the typed configuration the run uses (``sd3_train.read_config``:
the SD3 families, ``SD3TrainingConfig`` and ``SD3Options``), or is refused with a message naming the flag; the
SD-only flags and sd-scripts' "[DOES NOT WORK]" flags (``--save_clip --save_t5xxl --t5xxl_device --t5xxl_dtype``)
say so once and change nothing. The rules of sd3_train.py's own flags, as sd-scripts' sd3_train.py reads them:
which encoders train at which rate, which caches are refused, which parameters ``--num_last_block_to_freeze``
counts."""

from __future__ import annotations

import dataclasses
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

import fine_tune
import sd3_train
from library.cli.problems import ConfigError
from library.families.sd3 import full_training
from library.families.sd3.options import DOES_NOT_WORK, SD_ONLY_FLAGS

ROOT = Path(__file__).resolve().parents[1]
FLAGS = json.loads((ROOT / "tests" / "data" / "sd_scripts_sd3_train_flags.json").read_text())
SCRIPT = "sd3_train.py"
# values whose type alone gives none that means something here (the tiny model has 4 blocks)
FT_VALUES = {"--blocks_to_swap": ["1"], "--save_model_as": ["diffusers"], "--cache_text_encoder_outputs": [],
             "--cache_text_encoder_outputs_to_disk": [], "--num_last_block_to_freeze": ["3"]}  # fmt: skip
# flags that act only together with another one: flag -> arguments given to both reads compared
FT_CONTEXT = {"--use_safetensors": ["--save_model_as", "diffusers"], "--learning_rate_te1": ["--train_text_encoder"],
              "--learning_rate_te2": ["--train_text_encoder"],
              "--learning_rate_te3": ["--train_text_encoder", "--train_t5xxl"]}  # fmt: skip


def _actions() -> dict:
    return {opt: a for a in sd3_train.build_parser()._actions for opt in a.option_strings}


def test_all_201_flags_exist_with_sd_scripts_defaults():
    actions = _actions()
    assert len(FLAGS) == 201
    assert_sd_scripts_flags(FLAGS, actions, SCRIPT)
    for flag in ("--block_lr", "--learning_rate_te", "--mem_eff_save"):  # not flags of sd-scripts' sd3_train.py
        assert flag not in actions and flag not in FLAGS


@pytest.fixture(scope="module")
def ft_config(tmp_path_factory):
    """The typed configuration sd3_train.py's run reads for some extra flags, on a tiny SD3 medium SAI file with its
    text encoders embedded (4 joint blocks)."""
    from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("sd3_ft_flags")
    files = write_tiny_files(build_tiny_sd3("sd3", blocks=4), root / "model", diffusers=False)
    data = make_example_dataset(root / "data")
    (data / "p.txt").write_text("a prompt\n")
    base = ["--pretrained_model_name_or_path", str(files["model"]), "--train_data_dir", str(data), "--output_dir",
            str(data / "out"), "--seed", "1"]  # fmt: skip

    def read(*extra: str):
        argv = [*base, *(e.replace("{data}", str(data)) for e in extra)]
        cfg = fine_tune.read_config(argv, sd3_train.FAMILIES, sd3_train.build_parser, sd3_train.FORMATS)
        return dataclasses.replace(cfg, args={})  # compare what the run reads, not the raw flag list

    return read


def _flags():
    return run_flags(sd3_train.build_parser())


@pytest.mark.parametrize("action", _flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_changes_the_run_or_is_refused(ft_config, action, caplog):
    import test_flags
    from test_flags_fine_tune import DEEPSPEED_FLAGS

    flag = action.option_strings[0]
    if flag in DEEPSPEED_FLAGS:  # read with --deepspeed only, which needs CUDA
        assert_deepspeed_flag_acts(sd3_train.build_parser, action)
        return
    no_effect = {(SCRIPT, f): "has no effect here" for f in (*SD_ONLY_FLAGS, *DOES_NOT_WORK)}
    value = FT_VALUES[flag] if flag in FT_VALUES else VALUES.get(flag) or _value(action, SCRIPT)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(test_flags, "NO_EFFECT_HERE", {**test_flags.NO_EFFECT_HERE, **no_effect})
        assert_flag_acts(ft_config, SCRIPT, action, value, FT_CONTEXT.get(flag, []), caplog)


def test_text_encoder_learning_rates_as_sd_scripts_reads_them(ft_config, caplog):
    """lr_te* default to --learning_rate; 0 leaves that encoder frozen; T5 trains only with --train_t5xxl; without
    --train_text_encoder no encoder trains (the lrs said to be ignored); --learning_rate 0 freezes the transformer."""
    assert ft_config().method.text_encoder_lrs is None and ft_config().method.train_unet
    assert ft_config("--train_text_encoder", "--learning_rate", "3e-6").method.text_encoder_lrs == (3e-6, 3e-6, 0.0)
    cfg = ft_config("--train_text_encoder", "--learning_rate_te1", "0", "--learning_rate_te2", "1e-5")
    assert cfg.method.text_encoder_lrs == (0.0, 1e-5, 0.0)
    cfg = ft_config("--train_text_encoder", "--train_t5xxl", "--learning_rate_te3", "5e-6", "--learning_rate", "0")
    assert cfg.method.text_encoder_lrs == (0.0, 0.0, 5e-6)  # lr_te1 / te2 default to --learning_rate, 0 here
    assert not cfg.method.train_unet and cfg.method.trained_parts == ("text_encoders",)
    with caplog.at_level("WARNING"):
        assert ft_config("--learning_rate_te1", "1e-5") == ft_config()
    assert "--learning_rate_te1: no text encoder is trained without --train_text_encoder" in caplog.text
    with pytest.raises(ConfigError, match="trains nothing"):
        ft_config("--learning_rate", "0")


def test_caches_as_sd_scripts_allows_them(ft_config, caplog):
    """--use_t5xxl_cache_only turns the text cache on (also with --train_text_encoder: the partial cache); a cache
    with --train_text_encoder alone, and any cache with --train_t5xxl, is refused naming the flags."""
    with caplog.at_level("WARNING"):
        cfg = ft_config("--train_text_encoder", "--use_t5xxl_cache_only")
    assert cfg.data.cache_text_encoder_outputs and cfg.train_text_encoder and "--use_t5xxl_cache_only" in caplog.text
    with pytest.raises(ConfigError, match="--use_t5xxl_cache_only"):
        ft_config("--train_text_encoder", "--cache_text_encoder_outputs")
    with pytest.raises(ConfigError, match="--train_t5xxl with a text-encoder cache"):
        ft_config("--train_text_encoder", "--train_t5xxl", "--use_t5xxl_cache_only")
    with pytest.raises(ConfigError) as e:  # only what works is suggested: no cache flag fits a trained T5-XXL
        ft_config("--train_text_encoder", "--train_t5xxl", "--cache_text_encoder_outputs")
    assert "--train_t5xxl with a text-encoder cache" in str(e.value) and "add --use_t5xxl_cache_only" not in str(
        e.value
    )
    with pytest.raises(ConfigError, match="--train_t5xxl needs --train_text_encoder"):
        ft_config("--train_t5xxl")
    with pytest.raises(ConfigError, match="--learning_rate_te2 must be >= 0"):
        ft_config("--train_text_encoder", "--learning_rate_te2", "-1")
    with pytest.raises(ConfigError, match="ckpt"):
        ft_config("--save_model_as", "ckpt")


def test_num_last_block_to_freeze_counts_parameters_as_sd_scripts():
    """sd-scripts' rule re-typed from its sd3_train.py: ``[p for name, p in mmdit.named_parameters() if "x_block" in
    name][-N:]`` frozen. The MMDiT's parameter order is rebuilt here from sd-scripts' module classes (an
    ``AttentionLinears`` registers qkv, proj, ln_q, ln_k; a ``DismantledBlock`` attn, attn2, mlp (fc1, fc2),
    adaLN_modulation; ``Linear`` weight then bias) and compared with ours on SD3 medium (no q/k norm) and
    SD3.5-medium (q/k norms, attn2 in block 0); N = 10 on SD3 medium is the last block's whole x_block."""
    from library.families.sd3.keys import Layout

    def attention(prefix: str, qk_norm: bool) -> list[str]:
        names = [f"{prefix}.qkv.weight", f"{prefix}.qkv.bias", f"{prefix}.proj.weight", f"{prefix}.proj.bias"]
        return names + ([f"{prefix}.ln_q.weight", f"{prefix}.ln_k.weight"] if qk_norm else [])

    def sd_scripts_x_block(layers: int, dual: tuple[int, ...], qk_norm: bool) -> list[str]:
        out = []
        for i in range(layers):
            x = f"joint_blocks.{i}.x_block"
            out += attention(f"{x}.attn", qk_norm) + (attention(f"{x}.attn2", qk_norm) if i in dual else [])
            out += [f"{x}.mlp.fc1.weight", f"{x}.mlp.fc1.bias", f"{x}.mlp.fc2.weight", f"{x}.mlp.fc2.bias",
                    f"{x}.adaLN_modulation.1.weight", f"{x}.adaLN_modulation.1.bias"]  # fmt: skip
        return out

    for layers, dual, qk in ((3, (), False), (3, (0,), True)):
        ours = [sai for sai, _ in full_training.x_block_parameters(Layout(layers, dual, qk))]
        assert ours == sd_scripts_x_block(layers, dual, qk)


def test_num_last_block_to_freeze_on_the_transformer():
    """The diffusers parameters of the chosen SAI ones (a qkv is to_q | to_k | to_v): N = 10 on a 3-block SD3 medium
    is every image-stream weight of block 2 and nothing else; N = 1 its adaLN bias; N beyond the count: all x_block."""
    from library.families.sd3.tiny import tiny_transformer

    model = tiny_transformer("sd3", 3).requires_grad_(True)
    last = set(full_training.last_x_block_parameters(model, 10))
    block2 = {n for n, _ in model.named_parameters() if n.startswith("transformer_blocks.2.")}
    image_side = {n for n in block2 if "context" not in n and "add_" not in n and "added" not in n}
    assert last == image_side and len(last) == 14  # q, k, v, out, ff in/out, norm1: 7 Linears
    assert full_training.last_x_block_parameters(model, 1) == ["transformer_blocks.2.norm1.linear.bias"]
    assert len(full_training.last_x_block_parameters(model, 1000)) == 3 * 14
    frozen = full_training.freeze_last_x_block_parameters(model, 2)
    assert frozen == ["transformer_blocks.2.norm1.linear.weight", "transformer_blocks.2.norm1.linear.bias"]
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == frozen
