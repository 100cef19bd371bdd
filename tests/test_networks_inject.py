"""Injection into the tiny SD1 / SD2 / SDXL models: names, outputs against independent formulas, files, training hooks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _networks_helpers import (
    adapter_roots,
    assert_outputs_close,
    make_config,
    oracle_delta,
    outputs,
    patch_with_oracle,
    perturb,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
    unet_inputs,
)
from torch import nn

from library.files.weights import load_state_dict, save_state_dict
from networks import inject, merge_files_into_base, network_from_file, prepare_network
from networks.layers import AdapterLayer, NormAdapterLayer

ALGO_ARGS = {
    "lora": ("conv_dim=4", "conv_alpha=2"),
    "loha": ("algo=loha", "conv_dim=4", "use_tucker=True"),
    "lokr": ("algo=lokr", "conv_dim=4", "factor=4"),
    "dora": ("algo=dora", "conv_dim=4"),
    "dora-loha": ("algo=loha", "dora_wd=True"),
    "norm": ("train_norm=True",),
}


@pytest.fixture
def fresh(tiny_parts):
    return lambda family: copy.deepcopy(tiny_parts[family])


@pytest.mark.parametrize("algo", list(ALGO_ARGS))
def test_fresh_network_leaves_outputs_unchanged(fresh, algo):
    """SD2's UNet; SD1 and SDXL are checked in the formula test below, before its network is perturbed."""
    parts = fresh("sd2")
    inputs = unet_inputs(parts)
    before = outputs(parts, inputs)
    network = inject(make_config(*ALGO_ARGS[algo]), adapter_roots(parts))
    assert len(network) > 0
    assert_outputs_close(outputs(parts, inputs), before)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("algo", list(ALGO_ARGS))
def test_forward_equals_merged_equals_independent_formula(fresh, family, algo, tmp_path):
    parts = fresh(family)
    inputs = unet_inputs(parts)
    base = outputs(parts, inputs)
    network = inject(make_config(*ALGO_ARGS[algo]), adapter_roots(parts))
    assert len(network) > 0
    assert_outputs_close(outputs(parts, inputs), base)  # a fresh network changes nothing
    perturb(network)
    network.set_multiplier(0.7)
    adapted = outputs(parts, inputs)
    assert (adapted[0] - base[0]).abs().max() > 1e-3
    network.save(tmp_path / "a.safetensors")
    network.merge()
    assert_outputs_close(outputs(parts, inputs), adapted)
    network.unmerge()
    assert_outputs_close(outputs(parts, inputs), adapted)

    oracle = fresh(family)  # untouched copy patched with formulas typed in the test, from the written file
    state_dict, _ = load_state_dict(tmp_path / "a.safetensors")
    assert patch_with_oracle(adapter_roots(oracle), state_dict, 0.7) == len(network)
    assert_outputs_close(outputs(oracle, inputs), adapted)

    network.eject()
    assert not any(isinstance(m, (AdapterLayer, NormAdapterLayer)) for m in parts.denoiser.modules())
    assert_outputs_close(outputs(parts, inputs), base)


def test_kohya_names(fresh):
    sd1 = inject(make_config("conv_dim=4"), adapter_roots(fresh("sd1"))).names
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in sd1
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0" in sd1
    assert "lora_unet_up_blocks_1_resnets_2_conv_shortcut" in sd1
    assert "lora_unet_down_blocks_0_downsamplers_0_conv" in sd1
    xl = inject(make_config("conv_dim=4"), adapter_roots(fresh("sdxl"))).names
    assert "lora_te1_text_model_encoder_layers_1_mlp_fc2" in xl
    assert "lora_te2_text_model_encoder_layers_0_self_attn_out_proj" in xl
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k" in xl
    assert "lora_unet_middle_block_1_proj_out" in xl
    assert "lora_unet_output_blocks_2_2_conv" in xl and "lora_unet_input_blocks_3_0_op" in xl
    assert "lora_unet_input_blocks_8_0_emb_layers_1" in xl and "lora_unet_output_blocks_6_0_skip_connection" in xl
    for names in (sd1, xl):
        te = [n for n in names if n.startswith("lora_te")]
        assert te and all("_text_model_encoder_layers_" in n for n in te)
        assert not any("down_blocks" in n for n in xl)


def test_save_precision_alpha_and_metadata(fresh, tmp_path):
    network = inject(make_config("algo=dora", dim=4, alpha=2.0), adapter_roots(fresh("sd1")))
    network.save(tmp_path / "a.safetensors", {"ss_output_name": "x"}, dtype=torch.float16)
    sd, meta = load_state_dict(tmp_path / "a.safetensors")
    assert {t.dtype for t in sd.values()} == {torch.float16}
    alphas = {k: v for k, v in sd.items() if k.endswith(".alpha")}
    assert len(alphas) == len(network) and all(v.dim() == 0 and float(v) == 2.0 for v in alphas.values())
    assert sum(k.endswith(".dora_scale") for k in sd) == len(network)
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert meta["ss_network_alpha"] == "2.0" and meta["ss_output_name"] == "x"
    assert '"algo": "dora"' in meta["ss_network_args"]


# sd-scripts' block numbering, written out by hand for a few modules (SD: IN01..IN11 = 1..11, MID 12, OUT 13..24)
SD_BLOCKS = {
    "lora_unet_down_blocks_0_attentions_0_proj_in": 1,
    "lora_unet_down_blocks_1_attentions_1_proj_in": 5,
    "lora_unet_down_blocks_2_resnets_0_time_emb_proj": 7,
    "lora_unet_mid_block_attentions_0_proj_in": 12,
    "lora_unet_up_blocks_1_attentions_0_proj_in": 16,
    "lora_unet_up_blocks_3_attentions_2_proj_out": 24,
}
SDXL_BLOCKS = {
    "lora_unet_input_blocks_4_1_proj_in": 5,
    "lora_unet_input_blocks_8_1_proj_out": 9,
    "lora_unet_middle_block_1_proj_in": 11,
    "lora_unet_output_blocks_0_1_proj_in": 13,
    "lora_unet_output_blocks_5_1_proj_out": 18,
}


@pytest.mark.parametrize("family,expected,count", [("sd1", SD_BLOCKS, 25), ("sdxl", SDXL_BLOCKS, 23)])
def test_block_dims_follow_sd_scripts_block_numbering(fresh, family, expected, count):
    dims = [(i % 5) + 1 for i in range(count)]
    alphas = [float(i) + 0.5 for i in range(count)]
    cfg = make_config(
        f"block_dims={','.join(map(str, dims))}",
        f"block_alphas={','.join(map(str, alphas))}",
        "conv_dim=2",
        dim=8,
    )
    network = inject(cfg, adapter_roots(fresh(family)))
    for name, idx in expected.items():
        adapter = network.layer(name).adapter
        assert (adapter.rank, float(adapter.alpha)) == (dims[idx], alphas[idx]), name
    convs = [n for n in network.names if network.layer(n).adapter.params["lora_down"].shape[-1] == 3]
    assert convs and all(
        (network.layer(n).adapter.rank, float(network.layer(n).adapter.alpha)) == (2, 1.0) for n in convs
    )
    te = next(n for n in network.names if n.startswith("lora_te"))
    assert network.layer(te).adapter.rank == 8  # text encoders keep network_dim
    zero = make_config(f"block_dims={','.join('0' if i == 5 else '4' for i in range(count))}")
    names = inject(zero, adapter_roots(fresh(family))).names
    assert not any(n.startswith(tuple(k for k, v in expected.items() if v == 5)) for n in names)


def test_block_dims_of_the_wrong_length_name_the_argument(fresh):
    with pytest.raises(ValueError, match=r"block_dims: 25 values given, this model's UNet has 23 blocks"):
        inject(make_config("block_dims=" + ",".join(["4"] * 25)), adapter_roots(fresh("sdxl")))


def test_rank_above_a_layers_width_is_kept_as_lycoris_does(fresh, caplog):
    """LyCORIS (modules/locon.py) builds lora_down (rank, in) / lora_up (out, rank) whatever the layer's width; we
    keep the rank too, log it once per argument, and the adapter still reaches any change of that layer."""
    from lycoris.modules.locon import LoConModule

    with caplog.at_level("INFO"):
        network = inject(make_config("conv_dim=200", dim=20), adapter_roots(fresh("sd1")))
    notes = [r.getMessage() for r in caplog.records if "above the width" in r.getMessage()]
    assert len(notes) == 2 and notes[0].startswith("--network_dim 20") and notes[1].startswith("conv_dim 200")
    from networks.layers import max_rank

    layer = next(network.layer(n) for n in network.names if network.layer(n).adapter.rank == 200)
    assert max_rank(tuple(layer.base_layer.weight.shape)) < 200
    lyco = LoConModule("x", layer.base_layer, lora_dim=200, alpha=1)
    ours = {k: tuple(v.shape) for k, v in layer.adapter.file_tensors().items() if k != "alpha"}
    assert ours == {k: tuple(v.shape) for k, v in lyco.state_dict().items() if k in ours}


def _all_params(network) -> set[int]:
    return {id(p) for p in network.parameters() if p.requires_grad}


def test_param_groups_te_unet_loraplus_and_zero_lr(fresh):
    network = inject(make_config("loraplus_lr_ratio=16"), adapter_roots(fresh("sd1")))
    groups = network.param_groups(unet_lr=1e-4, text_encoder_lr=5e-5, learning_rate=1e-3)
    assert [(g["name"], g["lr"]) for g in groups] == [
        ("textencoder", 5e-5),
        ("textencoder plus", 5e-5 * 16),
        ("unet", 1e-4),
        ("unet plus", 1e-4 * 16),
    ]
    plus = {id(p) for g in groups if g["name"].endswith("plus") for p in g["params"]}
    ups = {id(a.params["lora_up"]) for a in network.adapters.values()}
    assert plus == ups
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == _all_params(network)
    groups = network.param_groups(unet_lr=1e-4, text_encoder_lr=0, learning_rate=1e-3)
    assert [g["name"] for g in groups] == ["unet", "unet plus"]
    assert all(not a.params["lora_up"].requires_grad for n, a in network.adapters.items() if n.startswith("lora_te"))


def test_param_groups_per_text_encoder_and_per_block(fresh):
    network = inject(make_config(), adapter_roots(fresh("sdxl")))
    groups = network.param_groups(unet_lr=None, text_encoder_lr=[1e-5, 2e-5], learning_rate=1e-4)
    assert [(g["name"], g["lr"]) for g in groups] == [("textencoder1", 1e-5), ("textencoder2", 2e-5), ("unet", 1e-4)]
    te1 = {id(network.adapters[n].params["lora_down"]) for n in network.names if n.startswith("lora_te1_")}
    assert te1 == {id(p) for p in groups[0]["params"] if p.dim() == 2} & te1 and len(te1) > 0

    cfg = make_config("down_lr_weight=0.5,0.25,0", "up_lr_weight=sine", "mid_lr_weight=2")
    network = inject(cfg, adapter_roots(fresh("sd1")))
    assert not any(n.startswith("lora_unet_down_blocks_0_attentions_1") for n in network.names)  # block 2: weight 0
    lrs = {g["name"]: g["lr"] for g in network.param_groups(1.0, 1.0, 1.0)}
    assert lrs["unet_block1"] == 0.25 and lrs["unet_block12"] == 2.0 and lrs["unet_block4"] == 1.0
    assert lrs["unet_block16"] == pytest.approx(math.sin(math.pi / 2 * 3 / 11))  # sd-scripts' "sine" curve
    assert lrs["unet_block24"] == pytest.approx(1.0)


def test_train_unet_only_and_text_encoder_only(fresh):
    unet_only = inject(make_config(flags=["--network_train_unet_only"]), adapter_roots(fresh("sdxl")))
    assert unet_only.names and all(n.startswith("lora_unet_") for n in unet_only.names)
    te_only = inject(make_config(flags=["--network_train_text_encoder_only"]), adapter_roots(fresh("sdxl")))
    assert te_only.names and all(n.startswith("lora_te") for n in te_only.names)


def _saved(network, path) -> str:
    network.save(path)
    return str(path)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_dim_from_weights_rebuilds_any_algorithm(fresh, family, tmp_path):
    parts = fresh(family)
    inputs = unet_inputs(parts)
    network = inject(make_config("algo=loha", "conv_dim=4", "dora_wd=True", "train_norm=True"), adapter_roots(parts))
    perturb(network)
    expected = outputs(parts, inputs)
    path = _saved(network, tmp_path / "a.safetensors")
    other = fresh(family)
    cfg = make_config(flags=["--network_weights", path, "--dim_from_weights"])
    rebuilt = prepare_network(cfg, adapter_roots(other))
    assert sorted(rebuilt.names) == sorted(network.names)
    assert_outputs_close(outputs(other, inputs), expected)


def test_network_weights_continue_training_and_diffusers_named_sdxl_files(fresh, tmp_path):
    parts = fresh("sdxl")
    inputs = unet_inputs(parts)
    network = inject(make_config("algo=lokr", "factor=4"), adapter_roots(parts))
    perturb(network)
    expected = outputs(parts, inputs)
    # the same file with diffusers-style UNet names (as some tools write SDXL files) must load too
    identity = {i: lambda p: p for i in range(1)}
    diffusers_roots = [(p, m, identity[0] if p == "lora_unet" else r) for p, m, r in adapter_roots(parts)]
    renamed = {}
    for name in network.names:
        slot = network._slots[name]
        new = name
        if slot.target.is_unet:
            new = ("lora_unet_" + slot.target.path).replace(".", "_")
        for suffix, t in network.adapters[name].file_tensors().items():
            renamed[f"{new}.{suffix}"] = t
    assert any("down_blocks" in k for k in renamed) and diffusers_roots
    save_state_dict(renamed, tmp_path / "d.safetensors")
    other = fresh("sdxl")
    cfg = make_config("algo=lokr", "factor=4", flags=["--network_weights", str(tmp_path / "d.safetensors")])
    prepare_network(cfg, adapter_roots(other))
    assert_outputs_close(outputs(other, inputs), expected)


def test_sd2_single_file_style_1x1_lora_loads_onto_linear(fresh, tmp_path):
    parts = fresh("sd2")  # diffusers SD2: proj_in/out are Linear; single-file trained LoRAs store them 4-D
    inputs = unet_inputs(parts)
    network = inject(make_config(), adapter_roots(parts))
    perturb(network)
    expected = outputs(parts, inputs)
    sd = network.state_dict_for_file()
    sd = {k: (v[..., None, None] if "proj_in.lora" in k else v) for k, v in sd.items()}
    assert any(v.dim() == 4 for v in sd.values())
    save_state_dict(sd, tmp_path / "a.safetensors")
    other = fresh("sd2")
    network_from_file(tmp_path / "a.safetensors", adapter_roots(other))
    assert_outputs_close(outputs(other, inputs), expected)


def test_base_weights_are_merged_with_their_multiplier(fresh, tmp_path):
    parts = fresh("sd1")
    inputs = unet_inputs(parts)
    network = inject(make_config("algo=lokr", "conv_dim=4", "factor=4"), adapter_roots(parts))
    perturb(network)
    path = _saved(network, tmp_path / "a.safetensors")
    target = fresh("sd1")
    merge_files_into_base([path], [0.5], adapter_roots(target))
    assert not any(isinstance(m, AdapterLayer) for m in target.denoiser.modules())
    oracle = fresh("sd1")
    patch_with_oracle(adapter_roots(oracle), load_state_dict(path)[0], 0.5)
    assert_outputs_close(outputs(target, inputs), outputs(oracle, inputs))


def _error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_load_errors_name_the_problem(fresh, tmp_path):
    sd1_file = _saved(inject(make_config(), adapter_roots(fresh("sd1"))), tmp_path / "sd1.safetensors")
    loha_file = _saved(inject(make_config("algo=loha"), adapter_roots(fresh("sd1"))), tmp_path / "loha.safetensors")
    rank8_file = _saved(inject(make_config(dim=8), adapter_roots(fresh("sd1"))), tmp_path / "r8.safetensors")

    xl = inject(make_config(), adapter_roots(fresh("sdxl")))
    msg = _error(lambda: xl.load_file(sd1_file))
    assert "'lora_te'" in msg and "SD1/SD2" in msg and "lora_te1" in msg
    msg = _error(lambda: network_from_file(sd1_file, adapter_roots(fresh("sdxl"))))
    assert "'lora_te'" in msg and "SD1/SD2" in msg

    lora = inject(make_config(), adapter_roots(fresh("sd1")))
    msg = _error(lambda: lora.load_file(loha_file))
    assert "hada_w" in msg and "algo=loha" in msg
    msg = _error(lambda: lora.load_file(rank8_file))
    assert "lora_down.weight has shape (8," in msg and "--dim_from_weights" in msg

    oft = tmp_path / "oft.safetensors"
    save_state_dict({"lora_unet_conv_in.oft_diag": torch.zeros(4, 4, 4)}, oft)
    assert "(oft_diag) is not supported" in _error(lambda: network_from_file(oft, adapter_roots(fresh("sd1"))))


@pytest.mark.parametrize("algo", ["lora", "loha", "lokr"])
def test_apply_max_norm_caps_every_module(fresh, algo):
    args = {"lora": ("conv_dim=4",), "loha": ("algo=loha",), "lokr": ("algo=lokr", "factor=4")}[algo]
    network = inject(make_config(*args), adapter_roots(fresh("sd1")))
    perturb(network, std=0.5)

    def norms():
        out = {}
        for name in network.names:
            layer = network.layer(name)
            out[name] = float(oracle_delta(layer.adapter.file_tensors(), layer.weight_shape).norm())
        return out

    before = norms()
    cap = sorted(before.values())[len(before) // 2]  # about half the modules exceed it
    scaled, mean, largest = network.apply_max_norm(cap)
    after = norms()
    assert scaled == sum(v > cap for v in before.values()) > 0
    for name, v in after.items():
        assert v <= cap * (1 + 1e-4)
        if before[name] <= cap:
            assert v == pytest.approx(before[name], rel=1e-6)
    assert largest == pytest.approx(max(after.values()), rel=1e-4)
    assert mean == pytest.approx(sum(after.values()) / len(after), rel=1e-4)


def test_only_adapter_tensors_in_network_state(fresh):
    parts = fresh("sd1")
    network = inject(make_config("algo=dora"), adapter_roots(parts))
    keys = list(network.state_dict())
    assert keys and not any("base_layer" in k for k in keys)
    n_base = sum(p.numel() for p in parts.denoiser.parameters())
    assert sum(p.numel() for p in network.parameters()) < n_base / 5
    assert isinstance(parts.denoiser.down_blocks[0].attentions[0].proj_in, AdapterLayer)
    assert isinstance(parts.denoiser.down_blocks[0].attentions[0].proj_in.base_layer, nn.Conv2d)


def test_old_per_input_dora_files_round_trip(fresh, tmp_path):
    """LyCORIS 2.2-3.1 wrote the DoRA magnitude per input column (wd_on_output=False); such files load and run."""
    parts = fresh("sd1")
    inputs = unet_inputs(parts)
    network = inject(make_config("algo=dora", "wd_on_output=False", "conv_dim=4"), adapter_roots(parts))
    perturb(network)
    expected = outputs(parts, inputs)
    path = _saved(network, tmp_path / "a.safetensors")
    sd, _ = load_state_dict(path)
    scale = sd["lora_unet_down_blocks_0_attentions_0_proj_in.dora_scale"]
    assert tuple(scale.shape) == (1, 16, 1, 1)  # (1, in, 1, 1): per input column
    oracle = fresh("sd1")
    patch_with_oracle(adapter_roots(oracle), sd, 1.0)
    assert_outputs_close(outputs(oracle, inputs), expected)
    other = fresh("sd1")
    network_from_file(path, adapter_roots(other))
    assert_outputs_close(outputs(other, inputs), expected)


def test_rs_lora_scale_is_alpha_over_sqrt_rank_and_files_stay_standard(fresh):
    network = inject(make_config("rs_lora=True", dim=4, alpha=2.0), adapter_roots(fresh("sd1")))
    adapter = next(iter(network.adapters.values()))
    assert float(adapter.scale()) == pytest.approx(2.0 / math.sqrt(4))
    # written as an ordinary alpha, so every consumer's alpha / r gives the same scale
    assert float(adapter.file_tensors()["alpha"]) / adapter.rank == pytest.approx(2.0 / math.sqrt(4))


def test_lycoris_preset_toml_file(fresh, tmp_path):
    preset = tmp_path / "preset.toml"
    preset.write_text(
        'unet_target_module = ["Transformer2DModel"]\n'
        'unet_target_name = ["conv_in"]\n'
        "text_encoder_target_module = []\n"
        'exclude_name = ["down_blocks.0.*"]\n'
        "enable_conv = true\n"
    )
    network = inject(make_config(f"preset={preset}", module="lycoris.kohya"), adapter_roots(fresh("sd1")))
    names = network.names
    assert "lora_unet_conv_in" in names and not any(n.startswith("lora_te") for n in names)
    assert not any(n.startswith("lora_unet_down_blocks_0_") for n in names)
    assert any(n.startswith("lora_unet_down_blocks_1_attentions_0_") for n in names)
    assert not any("resnets" in n for n in names)
    bad = tmp_path / "bad.toml"
    bad.write_text('unet_target_modules = ["Transformer2DModel"]\n')
    with pytest.raises(ValueError, match=r"unknown keys \['unet_target_modules'\]"):
        inject(make_config(f"preset={bad}", module="lycoris.kohya"), adapter_roots(fresh("sd1")))


@pytest.mark.parametrize("algo", ["lora", "loha", "lokr", "dora"])
def test_training_steps_with_dropouts_reach_every_adapter_and_fit_a_target(fresh, algo):
    parts = fresh("sd1")
    inputs = unet_inputs(parts)
    cfg = make_config(*ALGO_ARGS[algo], "rank_dropout=0.1", flags=["--network_dropout", "0.1"])
    network = inject(cfg, adapter_roots(parts))
    target = torch.randn_like(outputs(parts, inputs)[0])
    optimizer = torch.optim.AdamW(network.param_groups(1e-3, 1e-3, 1e-3))
    parts.denoiser.train()
    losses = []
    for step in range(8):
        torch.manual_seed(step)
        loss = torch.nn.functional.mse_loss(parts.denoiser(**inputs).sample, target)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            unet_params = [p for n, a in network.adapters.items() if n.startswith("lora_unet") for p in a.parameters()]
            assert all(p.grad is not None for p in unet_params)
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is None for p in parts.denoiser.parameters() if not p.requires_grad)
    assert losses[-1] < losses[0]
