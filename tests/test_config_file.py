"""--config_file / --output_config round trip, CLI precedence, clear errors, unsupported flags."""

import argparse

import pytest

from library.cli.parse import ConfigError, add_config_args, add_unsupported, parse_args


def _parser():
    p = argparse.ArgumentParser()
    add_config_args(p)
    g = p.add_argument_group("training")
    g.add_argument("--learning_rate", type=float, default=2e-6)
    g.add_argument("--max_train_steps", type=int, default=1600)
    g.add_argument("--network_args", type=str, nargs="*", default=None)
    g.add_argument("--text_encoder_lr", type=float, nargs="*", default=None)
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    g.add_argument("--gradient_checkpointing", action="store_true")
    add_unsupported(g, "--deepspeed", "use accelerate's DDP", action="store_true")
    return p


def test_round_trip(tmp_path):
    cfg = tmp_path / "run.toml"
    argv = [
        "--learning_rate",
        "1e-4",
        "--network_args",
        "conv_dim=4",
        "algo=locon",
        "--text_encoder_lr",
        "1e-5",
        "2e-5",
        "--mixed_precision",
        "bf16",
        "--gradient_checkpointing",
    ]
    direct = parse_args(_parser(), argv)
    assert parse_args(_parser(), [*argv, "--config_file", str(cfg), "--output_config"]) is None
    back = parse_args(_parser(), ["--config_file", str(cfg)])
    assert vars(back) | {"config_file": None} == vars(direct)


def test_cli_wins_and_sections_flatten(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[a]\nlearning_rate = 1\n[b]\nmax_train_steps = 5\ntext_encoder_lr = 0.5\nnetwork_args = "conv_dim=4 algo=locon"\n'
    )
    args = parse_args(_parser(), ["--config_file", str(cfg), "--max_train_steps", "7"])
    assert args.learning_rate == 1.0 and isinstance(args.learning_rate, float)
    assert args.max_train_steps == 7 and args.text_encoder_lr == [0.5]
    assert args.network_args == ["conv_dim=4", "algo=locon"]


def test_all_errors_at_once(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('learning_rte = 1\nmax_train_steps = "ten"\nmixed_precision = "fp8"\ngradient_checkpointing = 1\n')
    with pytest.raises(ConfigError) as e:
        parse_args(_parser(), ["--config_file", str(cfg)])
    msg = str(e.value)
    assert "4 problems" in msg and "did you mean 'learning_rate'" in msg
    assert "max_train_steps" in msg and "mixed_precision" in msg and "expected true or false" in msg


def test_unsupported_flag_is_refused():
    with pytest.raises(ConfigError, match="--deepspeed is not supported yet"):
        parse_args(_parser(), ["--deepspeed"])
    assert parse_args(_parser(), []).deepspeed is False
