"""OFT: LyCORIS diag-oft and boft, sd-scripts' networks.oft.

Oracles: lycoris-lora 4.1.3's own ``DiagOFTModule`` / ``ButterflyOFTModule`` trained side by side with ours (same
init, same loss, same optimizer: outputs and tensors after the steps), its factorisation rules, its loader on files
each side wrote; sd-scripts' ``OFTModule`` formula re-derived below from its source (networks/oft.py, git 48d368fa);
the algebra (merged == unmerged, R orthogonal, save -> load).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from _networks_helpers import (
    adapter_roots,
    assert_outputs_close,
    make_config,
    outputs,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
    unet_inputs,
)
from torch import nn

from library.files.weights import load_state_dict
from networks import inject
from networks.algos import ALGOS, boft, lokr
from networks.algos.oft import cayley
from networks.files import algo_of
from networks.inject import network_from_file, new_adapter
from networks.layers import AdapterLayer, AdapterWeights
from networks.lycoris_reader import _without_timestep_embedding_target, apply_with_lycoris
from networks.sd_scripts_oft_reader import apply_sd_scripts_oft

lycoris_functional = pytest.importorskip("lycoris.functional")
from lycoris.modules.boft import ButterflyOFTModule  # noqa: E402
from lycoris.modules.diag_oft import DiagOFTModule  # noqa: E402

LYCORIS = {"diag-oft": DiagOFTModule, "boft": ButterflyOFTModule}


def test_block_splits_are_lycoris_rules():
    for dim in (4, 12, 16, 48, 96, 320, 360, 640, 1280):
        for factor in (-1, 1, 2, 3, 4, 5, 8, 16, 64):
            assert lokr.factorization(dim, factor) == lycoris_functional.factorization(dim, factor)
            theirs = lycoris_functional.power2factorization(dim, factor)
            ours = boft.power2factorization(dim, factor)
            assert ours == (None if theirs[1] == 0 else theirs), (dim, factor)
    assert boft.stages(1) == 1 and boft.stages(8) == 4 and boft.stages(16) == 5


def _layers(kind: str):
    torch.manual_seed(0)
    base = {"linear": nn.Linear(12, 16), "conv3": nn.Conv2d(6, 16, 3, padding=1), "conv1": nn.Conv2d(6, 16, 1)}[kind]
    base.requires_grad_(False)
    x = torch.randn(3, 12) if kind == "linear" else torch.randn(3, 6, 5, 5)
    return base, copy.deepcopy(base), x


@pytest.mark.parametrize("algo", ["diag-oft", "boft"])
@pytest.mark.parametrize("kind", ["linear", "conv3", "conv1"])
@pytest.mark.parametrize("constraint,rescaled", [(0.0, False), (0.0, True), (1e-3, False), (1e-3, True)])
def test_training_steps_match_lycoris_module(algo, kind, constraint, rescaled):
    """Same zero init, same loss and SGD steps on LyCORIS' module and ours: the same tensors and outputs."""
    base, theirs_base, x = _layers(kind)
    theirs = LYCORIS[algo]("m", theirs_base, 1.0, lora_dim=4, constraint=constraint, rescaled=rescaled)
    theirs.apply_to()
    params = {"oft_blocks": torch.zeros_like(theirs.oft_blocks)}
    if rescaled:
        params["rescale"] = torch.ones_like(theirs.rescale)
    ours = AdapterLayer(base, AdapterWeights(ALGOS[algo], params, float(theirs.alpha)))
    target = torch.randn_like(base(x))
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.5)
    opt_o = torch.optim.SGD(ours.adapter.parameters(), lr=0.5)
    for _ in range(3):
        for opt, fwd in ((opt_t, theirs_base), (opt_o, ours)):
            opt.zero_grad()
            F.mse_loss(fwd(x), target).backward()
            opt.step()
    assert theirs.oft_blocks.abs().max() > 1e-3  # it trained
    torch.testing.assert_close(ours.adapter.params["oft_blocks"], theirs.oft_blocks, atol=1e-5, rtol=1e-4)
    if rescaled:
        torch.testing.assert_close(ours.adapter.params["rescale"], theirs.rescale, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        for m in (1.0, 0.5):  # the multiplier moves R (every BOFT stage) toward I, rescale untouched: LyCORIS' rule
            theirs.multiplier, ours.multiplier = m, m
            assert (theirs_base(x) - ours(x)).abs().max() <= 1e-5
        q = theirs.oft_blocks - theirs.oft_blocks.transpose(-1, -2)
        if constraint:  # the constraint was active (it caps ||Q|| at constraint * out)
            assert torch.linalg.vector_norm(q) > constraint * 16


@pytest.mark.parametrize("algo,blocks", [("diag-oft", (4, 4, 4)), ("boft", (3, 4, 4, 4)), ("oft", (4, 4, 4))])
def test_half_precision_blocks_and_weights_run_in_float32(algo, blocks):
    base, _, x = _layers("linear")
    params = {"oft_blocks": (torch.randn(blocks) * 0.3).to(torch.bfloat16)}
    layer = AdapterLayer(base.to(torch.bfloat16), AdapterWeights(ALGOS[algo], params, 1e-2))
    full = AdapterLayer(copy.deepcopy(base).float(), AdapterWeights(ALGOS[algo], {"oft_blocks": params["oft_blocks"]
                                                                                   .float()}, 1e-2))  # fmt: skip
    delta = layer.delta()
    assert delta.dtype == torch.float32
    torch.testing.assert_close(delta, full.delta(), atol=2e-2, rtol=2e-2)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rotation_is_orthogonal_and_merge_is_exact():
    base, _, x = _layers("conv3")
    blocks = torch.randn(4, 4, 4) * 0.3
    r = cayley(blocks, torch.tensor(0.0))
    torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(4).expand(4, 4, 4), atol=1e-5, rtol=0)
    layer = AdapterLayer(base, AdapterWeights(ALGOS["diag-oft"], {"oft_blocks": blocks}, 0.0))
    layer.multiplier = 0.7
    with torch.no_grad():
        unmerged = layer(x)
        layer.merge()
        torch.testing.assert_close(layer(x), unmerged, atol=1e-5, rtol=1e-5)
        layer.unmerge()
        assert (layer.base_layer(x) - unmerged).abs().max() > 1e-2
        # at m = 1 R is orthogonal: each block keeps its column norms, the change is a rotation
        w = layer.base_layer.weight
        turned = (w + layer.delta(1.0)).reshape(4, 4, -1)
        torch.testing.assert_close(w.reshape(4, 4, -1).norm(dim=1), turned.norm(dim=1), atol=1e-5, rtol=1e-5)
        layer.multiplier = 0.0  # off: forward and merge
        assert torch.equal(layer(x), layer.base_layer(x)) and not layer.delta().any()


# ----------------------------------------------------------------------------------------- sd-scripts networks.oft
def _sd_scripts_weight(blocks, alpha, weight, multiplier):
    """sd-scripts' OFTModule.get_weight + forward (networks/oft.py), re-typed here from its source."""
    out_dim = weight.shape[0]
    constraint = alpha * out_dim
    block_q = blocks - blocks.transpose(1, 2)
    norm_q = torch.norm(block_q.flatten())
    new_norm_q = torch.clamp(norm_q, max=constraint)
    block_q = block_q * ((new_norm_q + 1e-8) / (norm_q + 1e-8))
    eye = torch.eye(blocks.shape[1]).unsqueeze(0).repeat(blocks.shape[0], 1, 1)
    block_r = torch.matmul(eye + block_q, (eye - block_q).float().inverse())
    r = multiplier * (block_r - eye) + eye
    w = weight.reshape(blocks.shape[0], blocks.shape[1], *weight.shape[1:])
    return torch.einsum("k n m, k n ... -> k m ...", r, w).reshape(weight.shape)


@pytest.mark.parametrize("kind", ["linear", "conv3", "conv1"])
@pytest.mark.parametrize("alpha,multiplier", [(1e-3, 1.0), (10.0, 1.0), (1e-2, 0.6)])
def test_networks_oft_is_sd_scripts_formula(kind, alpha, multiplier):
    base, theirs, x = _layers(kind)
    blocks = torch.randn(4, 4, 4) * 0.3  # --network_dim 4 = four blocks of 16 / 4
    ours = AdapterLayer(base, AdapterWeights(ALGOS["oft"], {"oft_blocks": blocks}, alpha))
    ours.multiplier = multiplier
    with torch.no_grad():
        theirs.weight.copy_(_sd_scripts_weight(blocks, alpha, theirs.weight, multiplier))
        assert (theirs(x) - ours(x)).abs().max() <= 1e-5
        assert (theirs(x) - base(x)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------- networks on the UNet
CASES = [
    (
        "lycoris.kohya",
        ("algo=diag-oft", "constraint=1e-3", "rescaled=True", "conv_dim=4", "preset=unet-convblock-only"),
    ),
    ("lycoris.kohya", ("algo=boft", "rescaled=True", "preset=attn-only")),
    ("networks.oft", ("enable_conv=True",)),
]


def _random(network, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in network.layers():
            for name, p in layer.adapter.params.items():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.1 * noise if name == "rescale" else 0.2 * noise)


@pytest.mark.parametrize("module,args", CASES)
def test_merged_unmerged_and_file_round_trip(tiny_parts, tmp_path, module, args):
    parts = tiny_parts["sd1"]
    inputs = unet_inputs(parts, batch=1)
    ours = copy.deepcopy(parts)
    network = inject(make_config(*args, module=module, dim=4, alpha=1e-2), adapter_roots(ours))
    _random(network)
    expected = outputs(ours, inputs)
    assert (expected[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    network.merge()
    assert_outputs_close(outputs(ours, inputs), expected, atol=1e-5)
    network.unmerge()
    path = tmp_path / "oft.safetensors"
    network.save(path)
    state, meta = load_state_dict(path)
    assert meta["ss_network_module"] == module
    names = {k.partition(".")[0] for k in state}
    algos = {algo_of(n, {k.partition(".")[2]: v for k, v in state.items() if k.startswith(n + ".")}, "f")
             for n in names}  # fmt: skip
    assert algos == {{"networks.oft": "oft"}.get(module, args[0].removeprefix("algo="))}
    if module == "networks.oft":
        assert all(n.startswith("oft_unet_") for n in names)
    again = copy.deepcopy(parts)
    network_from_file(path, adapter_roots(again))
    assert_outputs_close(outputs(again, inputs), expected, atol=1e-5)


def test_networks_oft_targets_sd_scripts_modules(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sd1"])
    roots = adapter_roots(parts)

    def names(*args):
        network = inject(make_config(*args, module="networks.oft", dim=4, alpha=1e-3), roots)
        out = set(network.names)
        network.eject()
        return out

    attn = names()
    assert attn and all(n.startswith("lora_unet_") for n in attn)  # the U-Net only
    assert all(n.endswith(("to_q", "to_k", "to_v", "to_out_0")) for n in attn)
    assert len(attn) == 4 * sum(type(m).__name__ == "Attention" for m in parts.denoiser.modules())
    linear = names("enable_all_linear=True")
    assert attn < linear and any(n.endswith("proj_in") for n in linear) and any("ff_net" in n for n in linear)
    conv = names("enable_conv=True")
    assert attn < conv and any(n.endswith("conv1") for n in conv) and any("downsamplers" in n for n in conv)


@pytest.mark.parametrize(
    "module,args,needle",
    [
        ("networks.oft", ("--network_dim", "3"), "--network_dim 3 (the number of blocks) does not divide the 16"),
        ("lycoris.kohya", ("--network_args", "algo=boft", "conv_dim=1"), "cannot be split into a power-of-two"),
    ],
)
def test_widths_the_algorithm_cannot_split_are_named_before_training(tiny_parts, module, args, needle):
    import argparse

    from networks import NetworkConfig, add_network_args

    parser = argparse.ArgumentParser()
    add_network_args(parser)
    cfg = NetworkConfig.from_args(parser.parse_args(["--network_module", module, "--network_alpha", "0.01", *args]))
    parts = copy.deepcopy(tiny_parts["sd1"])
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        inject(cfg, adapter_roots(parts))
    assert "lora_unet_" in str(info.value)
    assert not any(isinstance(m, AdapterLayer) for m in parts.denoiser.modules())  # nothing injected


@pytest.mark.parametrize(
    "module,args,needle",
    [
        ("lycoris.kohya", ("algo=diag-oft", "dora_wd=True"), "dora_wd=True is not supported with algo=diag-oft"),
        ("lycoris.kohya", ("algo=boft", "use_scalar=True"), "use_scalar=True is not supported with algo=boft"),
        ("lycoris.kohya", ("algo=boft", "constraint=-1"), "constraint=-1.0: must not be negative"),
        ("networks.lora", ("enable_conv=True",), "only --network_module networks.oft reads it"),
    ],
)
def test_bad_oft_options_name_the_argument(module, args, needle):
    with pytest.raises(ValueError, match=needle):
        make_config(*args, module=module)


def test_bypass_mode_is_refused_because_lycoris_bypass_turns_the_bias():
    """LyCORIS' bypass form rotates base(x) including the bias: a different model (so bypass_mode=True is refused)."""
    base, theirs_base, x = _layers("linear")
    theirs = DiagOFTModule("m", theirs_base, 1.0, lora_dim=4, bypass_mode=True)
    with torch.no_grad():
        theirs.oft_blocks.copy_(torch.randn_like(theirs.oft_blocks) * 0.3)
    theirs.apply_to()
    ours = AdapterLayer(base, AdapterWeights(ALGOS["diag-oft"], {"oft_blocks": theirs.oft_blocks.detach()}, 0.0))
    with torch.no_grad():
        r = cayley(theirs.oft_blocks, torch.tensor(0.0))
        turned_bias = torch.einsum("kij,ki->kj", r, base.bias.reshape(4, 4)).reshape(-1)
        torch.testing.assert_close(theirs_base(x) - ours(x), (turned_bias - base.bias).expand(3, -1), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="bypass_mode=True is not supported with algo=diag-oft"):
        make_config("algo=diag-oft", "bypass_mode=True", module="lycoris.kohya")


def test_oft_flags_change_what_runs(caplog):
    plain = make_config("algo=diag-oft", module="lycoris.kohya")
    tuned = make_config("algo=diag-oft", "constraint=0.01", "rescaled=True", module="lycoris.kohya")
    weight = torch.randn(16, 8)
    a = new_adapter(plain, weight, 4, 1.0)
    b = new_adapter(tuned, weight, 4, 1.0)
    assert float(a.alpha) == 0.0 and float(b.alpha) == pytest.approx(0.01)
    assert "rescale" not in a.params and tuple(b.params["rescale"].shape) == (16, 1)
    oft = make_config(module="networks.oft", alpha=0.005, dim=2)
    c = new_adapter(oft, weight, 2, 0.005)
    assert tuple(c.params["oft_blocks"].shape) == (2, 8, 8)  # --network_dim = the number of blocks
    assert float(c.alpha) == pytest.approx(0.005)
    assert oft.train_unet_only and oft.algo == "oft"
    assert make_config(module="networks.oft", flags=("--network_dropout", "0.1")).dropout is None  # sd-scripts: none
    with pytest.raises(ValueError, match="networks.oft uses it as the constraint"):
        make_config(module="networks.oft", alpha=0.0)


def test_max_norm_caps_oft_blocks_as_lycoris():
    base, theirs_base, _ = _layers("linear")
    theirs = DiagOFTModule("m", theirs_base, 1.0, lora_dim=4, rescaled=True)
    with torch.no_grad():
        theirs.oft_blocks.copy_(torch.randn_like(theirs.oft_blocks))
        theirs.rescale.copy_(torch.full_like(theirs.rescale, 1.5))
    params = {"oft_blocks": theirs.oft_blocks.detach().clone(), "rescale": theirs.rescale.detach().clone()}
    ours = AdapterLayer(base, AdapterWeights(ALGOS["diag-oft"], params, 0.0))
    from networks.network import _cap_params

    scaled, norm = _cap_params(ours.adapter, 0.5)
    their_scaled, their_norm = theirs.apply_max_norm(0.5)
    assert bool(scaled) and bool(their_scaled)
    torch.testing.assert_close(ours.adapter.params["oft_blocks"], theirs.oft_blocks)
    torch.testing.assert_close(norm, their_norm)
    assert (ours.adapter.params["rescale"] == 1.5).all()  # the rescale is not a rotation: left alone


def test_scale_weight_norms_caps_every_module_of_a_network(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sd1"])
    network = inject(make_config("algo=boft", "rescaled=True", "preset=attn-only", module="lycoris.kohya"),
                     adapter_roots(parts))  # fmt: skip
    _random(network)
    count, mean, largest = network.apply_max_norm(0.5)
    assert count == len(network) and largest == pytest.approx(0.5, rel=1e-5) and mean <= largest
    for layer in network.layers():
        assert float(layer.adapter.params["oft_blocks"].detach().norm()) <= 0.5 + 1e-5
        assert (layer.adapter.params["rescale"] - 1).abs().max() > 1e-3  # untouched


# ------------------------------------------------------------------------------------------------ files, both ways
@pytest.mark.parametrize("algo", ["diag-oft", "boft"])
def test_lycoris_reads_our_files_and_we_read_theirs(tiny_parts, tmp_path, algo):
    parts = tiny_parts["sd1"]
    inputs = unet_inputs(parts, batch=1)
    # ours -> lycoris-lora (the demo's reader)
    ours = copy.deepcopy(parts)
    network = inject(make_config(f"algo={algo}", "constraint=1e-2", "rescaled=True", "preset=attn-only",
                                 module="lycoris.kohya", dim=4), adapter_roots(ours))  # fmt: skip
    _random(network)
    network.save(tmp_path / "ours.safetensors")
    theirs = copy.deepcopy(parts)
    lyc = apply_with_lycoris(tmp_path / "ours.safetensors", adapter_roots(theirs))
    assert len(lyc.unet_loras) + len(lyc.text_encoder_loras) == len(network)
    assert_outputs_close(outputs(theirs, inputs), outputs(ours, inputs), atol=1e-5)
    # lycoris-lora's own network -> ours
    theirs = copy.deepcopy(parts)
    te = nn.Module()
    te.text_model = theirs.text_encoders[0]
    with _without_timestep_embedding_target() as kohya:
        lyc = kohya.create_network(1.0, 4, 1.0, None, te, theirs.denoiser, algo=algo, constraint="1e-2",
                                   rescaled="True", preset="attn-mlp")  # fmt: skip
    lyc.apply_to(te, theirs.denoiser, apply_text_encoder=True, apply_unet=True)  # registers its modules
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lyc.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("rescale")
                    else 0.2 * torch.randn(p.shape, generator=g))  # fmt: skip
    lyc.save_weights(str(tmp_path / "theirs.safetensors"), torch.float32, {})
    mine = copy.deepcopy(parts)
    loaded = network_from_file(tmp_path / "theirs.safetensors", adapter_roots(mine))
    assert len(loaded) == len(lyc.unet_loras) + len(lyc.text_encoder_loras) > 0
    assert (outputs(theirs, inputs)[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    assert_outputs_close(outputs(mine, inputs), outputs(theirs, inputs), atol=1e-5)


def test_lycoris_reads_our_sdxl_boft_file(tiny_parts, tmp_path):
    parts = tiny_parts["sdxl"]
    inputs = unet_inputs(parts, batch=1)
    ours = copy.deepcopy(parts)
    network = inject(make_config("algo=boft", "preset=attn-only", module="lycoris.kohya", dim=8),
                     adapter_roots(ours))  # fmt: skip
    _random(network)
    network.save(tmp_path / "xl.safetensors")
    assert any(k.startswith("lora_unet_input_blocks_") for k in load_state_dict(tmp_path / "xl.safetensors")[0])
    theirs = copy.deepcopy(parts)
    lyc = apply_with_lycoris(tmp_path / "xl.safetensors", adapter_roots(theirs))
    assert len(lyc.unet_loras) + len(lyc.text_encoder_loras) == len(network)
    assert_outputs_close(outputs(theirs, inputs), outputs(ours, inputs), atol=1e-5)


def test_sd_scripts_oft_reader_reads_our_networks_oft_file(tiny_parts, tmp_path):
    parts = tiny_parts["sd1"]
    inputs = unet_inputs(parts, batch=1)
    ours = copy.deepcopy(parts)
    network = inject(make_config("enable_all_linear=True", module="networks.oft", dim=4, alpha=1e-2),
                     adapter_roots(ours))  # fmt: skip
    _random(network)
    network.set_multiplier(0.8)
    network.save(tmp_path / "oft.safetensors")
    theirs = copy.deepcopy(parts)
    count = apply_sd_scripts_oft(tmp_path / "oft.safetensors", adapter_roots(theirs), multiplier=0.8)
    assert count == len(network)
    assert_outputs_close(outputs(theirs, inputs), outputs(ours, inputs), atol=1e-5)


def test_gen_img_accepts_networks_oft_files(tmp_path):
    import argparse

    from library.sampling.inference import _networks

    path = tmp_path / "oft.safetensors"
    path.write_bytes(b"x")
    args = argparse.Namespace(network_module=["networks.oft"], network_weights=[str(path)], network_mul=[0.5],
                              network_merge=False, prompt=None, from_file=None)  # fmt: skip
    problems: list[str] = []
    (spec,) = _networks(args, problems)
    assert not problems and spec.module == "networks.oft" and spec.multiplier == 0.5
