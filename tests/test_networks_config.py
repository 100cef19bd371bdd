"""Network flags: sd-scripts' names, types and defaults; --network_args parsing; every bad input reported at once."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
from _networks_helpers import (
    make_config,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
)

from library.families import FAMILIES
from networks import NetworkConfig, add_network_args


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_network_args(parser)
    return parser.parse_args(argv)


def _config(argv: list[str]) -> NetworkConfig:
    return NetworkConfig.from_args(_parse(argv))


def _errors(argv: list[str]) -> str:
    with pytest.raises(ValueError) as info:
        _config(argv)
    return str(info.value)


def test_flags_have_sd_scripts_types_and_defaults():
    # sd-scripts train_network.py (train_network.py: setup_parser, network options)
    expected = {
        "network_module": (str, None, None),
        "network_dim": (int, None, None),
        "network_alpha": (float, 1, None),
        "network_dropout": (float, None, None),
        "network_args": (str, None, "*"),
        "network_weights": (str, None, None),
        "dim_from_weights": (None, False, 0),
        "network_train_unet_only": (None, False, 0),
        "network_train_text_encoder_only": (None, False, 0),
        "scale_weight_norms": (float, None, None),
        "base_weights": (str, None, "*"),
        "base_weights_multiplier": (float, None, "*"),
    }
    parser = argparse.ArgumentParser()
    add_network_args(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == set(expected)
    for dest, (type_, default, nargs) in expected.items():
        a = actions[dest]
        assert (a.type, a.default, a.nargs) == (type_, default, nargs), dest


def test_defaults_and_alpha_zero_means_rank():
    cfg = _config(["--network_module", "networks.lora"])
    assert (cfg.algo, cfg.dim, cfg.alpha, cfg.dora, cfg.conv_dim) == ("lora", 4, 1.0, False, None)
    assert cfg.resolved_conv() == (0, 1.0)  # networks.lora: no conv adapters without conv_dim
    assert _config(["--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "0"]).alpha == 16
    lyco = _config(["--network_module", "lycoris.kohya", "--network_dim", "8", "--network_alpha", "4"])
    assert lyco.resolved_conv() == (8, 4.0)  # LyCORIS: conv_dim / conv_alpha default to the linear ones


def test_network_args_are_typed_and_lycoris_spellings_accepted():
    cfg = make_config("algo=LoHa", "conv_dim=8", "conv_alpha=4", "dora_wd=true", "disable_conv_cp=False", "factor=8")
    assert (cfg.algo, cfg.conv_dim, cfg.conv_alpha, cfg.dora, cfg.use_tucker, cfg.factor) == (
        "loha",
        8,
        4.0,
        True,
        True,
        8,
    )
    assert make_config("algo=dora").algo == "lora" and make_config("algo=dora").dora
    assert make_config("algo=locon").algo == "lora" and not make_config("algo=locon").dora
    assert make_config("use_cp=True").use_tucker and not make_config("use_tucker=false").use_tucker
    cfg = make_config("block_dims=" + ",".join(["4"] * 25), "down_lr_weight=sine+0.5", "mid_lr_weight=2")
    assert cfg.block_dims == (4,) * 25 and cfg.down_lr_weight == "sine+0.5" and cfg.mid_lr_weight == (2.0,)


def test_every_problem_is_reported_at_once_with_did_you_mean():
    msg = _errors(
        ["--network_module", "networks.lora", "--network_dim", "0", "--network_dropout", "1.5",
         "--network_args", "algo=lohaa", "conv_dimm=4", "rank_dropout=x", "nokey"]
    )  # fmt: skip
    assert "algo=lohaa: unknown algorithm; did you mean 'loha'?" in msg
    assert "conv_dimm: unknown argument; did you mean 'conv_dim'?" in msg
    assert "rank_dropout=x" in msg
    assert "'nokey': expected key=value" in msg
    assert "--network_dim 0: the rank must be at least 1" in msg
    assert "--network_dropout 1.5" in msg


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--network_args", "algo=tlora"], "algo=tlora is not supported yet"),
        (["--network_args", "algo=oft"], "LyCORIS has no algorithm 'oft'; use algo=diag-oft or algo=boft"),
        (["--network_args", "preset=ful"], "did you mean 'full'?"),
        (["--network_args", "block_dims=4,4,4"], "block_dims: 3 values given"),
        (["--network_args", "conv_dim=-1"], "conv_dim=-1: must not be negative"),
        (["--network_args", "loraplus_lr_ratio=0"], "loraplus_lr_ratio=0.0: must be > 0"),
        (["--dim_from_weights"], "--dim_from_weights needs --network_weights"),
        (["--network_weights", "/nonexistent.safetensors"], "--network_weights /nonexistent.safetensors: no such"),
        (["--network_train_unet_only", "--network_train_text_encoder_only"], "exclude each other"),
        (["--base_weights_multiplier", "0.5"], "--base_weights_multiplier has 1 values for 0 --base_weights"),
        (["--scale_weight_norms", "0"], "--scale_weight_norms 0.0: must be > 0"),
    ],
)
def test_bad_network_options_name_the_argument(argv, needle):
    assert needle in _errors(["--network_module", "networks.lora", *argv])


def test_network_module_choices():
    assert "--network_module is required" in _errors([])
    assert _config(["--network_module", "networks.dylora"]).algo == "dylora"
    assert _config(["--network_module", "networks.lora_fa"]).algo == "lora_fa"
    assert _config(["--network_module", "networks.oft"]).algo == "oft"
    # a family module no registered family provides is unknown; the modules listed come from the registry
    unknown = _errors(["--network_module", "networks.lora_no_such_family"])
    assert "--network_module 'networks.lora_no_such_family' is unknown" in unknown
    assert "(supported: networks.lora, lycoris.kohya, networks.dylora, networks.lora_fa, networks.oft, " in unknown
    assert all(m in unknown for f in FAMILIES.values() for m in f.adapter_rules)
    assert "did you mean 'networks.lora'?" in _errors(["--network_module", "networks.lorra"])
    assert _config(["--network_module", "lycoris.kohya"]).is_lycoris


def test_seed_guide_lycoris_command_line_runs_unchanged(caplog):
    # the --network_args of seeds/004 (an SDXL LyCORIS guide), verbatim
    args = ["use_reentrant=False", "preset=full", "conv_dim=256", "conv_alpha=4", "use_tucker=False",
            "use_scalar=False", "rank_dropout_scale=False", "algo=locon", "train_norm=False",
            "block_dims=" + ",".join(["8"] * 25), "block_alphas=" + ",".join(["0.0625"] * 25)]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        cfg = make_config(*args, module="lycoris.kohya", dim=8, alpha=4, flags=["--network_dropout", "0"])
    assert (cfg.algo, cfg.preset, cfg.conv_dim, cfg.conv_alpha, cfg.dim, cfg.alpha) == ("lora", "full", 256, 4, 8, 4)
    assert cfg.block_dims is None and cfg.block_alphas is None  # LyCORIS ignores them; so do we, with a warning
    text = caplog.text
    assert "block_dims is ignored by lycoris.kohya" in text and "use_reentrant=False has no effect" in text


def test_metadata_keeps_network_args():
    cfg = make_config("conv_dim=8", "algo=loha", dim=16, alpha=8)
    meta = cfg.metadata()
    assert meta["ss_network_module"] == "networks.lora"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("16", "8.0")
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "8", "algo": "loha"}
