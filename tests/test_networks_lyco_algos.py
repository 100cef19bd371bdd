"""LyCORIS full / "diff", (IA)³ and GLoRA: our pure functions and adapter layer against lycoris-lora 4.1.3's own
module classes (``FullModule``, ``IA3Module``, ``GLoRAModule``) on the same weights, after a few optimizer steps so
that no tensor is zero; merge == forward; file round trips; network files both ways; the tools' exact paths.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import (
    adapter_roots,
    assert_outputs_close,
    make_config,
    outputs,
    perturb,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
    unet_inputs,
)
from test_networks_oracles import (
    _lycoris_forward,
    _lycoris_te,
    lycoris,  # noqa: F401  (the fixture: LyCORIS 4.1.3 patched for diffusers UNets)
    lycoris_kohya,
)
from torch import nn

from networks import inject
from networks.algos import ALGOS, detect_algo
from networks.inject import network_from_file
from networks.layers import AdapterLayer, AdapterWeights
from networks.lycoris_reader import _ia3_reads_on_input

pytest.importorskip("lycoris")
from lycoris.modules.full import FullModule  # noqa: E402
from lycoris.modules.glora import GLoRAModule  # noqa: E402
from lycoris.modules.ia3 import IA3Module  # noqa: E402

BASES = {
    "linear": lambda: nn.Linear(6, 5),
    "conv3x3": lambda: nn.Conv2d(4, 6, 3, padding=1, stride=2),
    "conv1x1": lambda: nn.Conv2d(4, 6, 1),
}
# (our algo, LyCORIS class, its constructor options)
CASES = {
    "full": ("full", FullModule, {}),
    "ia3": ("ia3", IA3Module, {}),
    "ia3-input": ("ia3", IA3Module, {"train_on_input": True}),
    "glora": ("glora", GLoRAModule, {"lora_dim": 2, "alpha": 3.0}),
    "glora-scalar": ("glora", GLoRAModule, {"lora_dim": 3, "alpha": 1.5, "use_scalar": True}),
}


def _input(kind: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((3, 6) if kind == "linear" else (2, 4, 7, 7), generator=g)


def _base(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return BASES[kind]()


def _trained_lycoris(case: str, kind: str, steps: int = 3, multiplier: float = 0.8):
    """A LyCORIS module on a fresh base layer, trained a few Adam steps toward a random target (nothing stays 0)."""
    _, cls, opts = CASES[case]
    base = _base(kind)
    torch.manual_seed(2)
    module = cls("lora_unet_x", base, multiplier, **opts)
    module.apply_to()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=0.05)
    x = _input(kind)
    target = torch.randn_like(module(x))
    for _ in range(steps):
        opt.zero_grad()
        ((module(x) - target) ** 2).mean().backward()
        opt.step()
    return module, base


def _their_tensors(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_lycoris_module_on_the_same_weights(case, kind):
    algo, _, _ = CASES[case]
    module, base = _trained_lycoris(case, kind)
    tensors = _their_tensors(module)
    assert detect_algo(set(tensors)) == algo
    assert all(bool(t.any()) for k, t in tensors.items() if k not in ("on_input", "alpha"))  # trained: nothing is 0
    ours_base = _base(kind)  # the same base weights (same seed), without LyCORIS' forward patch
    layer = AdapterLayer(ours_base, AdapterWeights.from_file(tensors, algo, "lora_unet_x"))
    layer.multiplier = 0.8
    x = _input(kind, seed=3)
    with torch.no_grad():
        expected = module(x)
        got = layer(x)
    assert (got - ours_base(x)).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_forward_and_file_round_trip(case, kind):
    algo, _, _ = CASES[case]
    module, _ = _trained_lycoris(case, kind)
    base = _base(kind)
    layer = AdapterLayer(base, AdapterWeights.from_file(_their_tensors(module), algo, "m"))
    layer.multiplier = 0.6
    x = _input(kind, seed=4)
    with torch.no_grad():
        unmerged = layer(x)
        w0, b0 = base.weight.clone(), base.bias.clone()
        layer.merge()
        merged = layer(x)
        layer.unmerge()
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    assert torch.equal(base.weight, w0) and torch.equal(base.bias, b0)  # unmerge restores exactly
    again = AdapterLayer(copy.deepcopy(base), AdapterWeights.from_file(layer.adapter.file_tensors(), algo, "m"))
    again.multiplier = 0.6
    with torch.no_grad():
        torch.testing.assert_close(again(x), unmerged, atol=0, rtol=0)


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("case", list(CASES))
def test_lycoris_module_reads_our_tensors(case, kind):
    """The other direction: our adapter trained a few steps, its file tensors loaded by LyCORIS' loader."""
    algo, cls, opts = CASES[case]
    base = _base(kind)
    rank = opts.get("lora_dim", 4)
    init = {"train_on_input": opts.get("train_on_input", False), "use_scalar": opts.get("use_scalar", False),
            "has_bias": True}  # fmt: skip
    params = ALGOS[algo].init_params(tuple(base.weight.shape), rank, **init)
    adapter = AdapterWeights(ALGOS[algo], params, opts.get("alpha", 1.0), use_scalar=init["use_scalar"])
    layer = AdapterLayer(base, adapter)
    opt = torch.optim.Adam([p for p in adapter.parameters() if p.requires_grad], lr=0.05)
    x = _input(kind)
    target = torch.randn_like(layer(x))
    for _ in range(3):
        opt.zero_grad()
        ((layer(x) - target) ** 2).mean().backward()
        opt.step()
    tensors = adapter.file_tensors()
    assert set(tensors) == set(_their_tensors(cls("m", _base(kind), 1.0, **opts)))  # LyCORIS' own key names
    theirs_base = _base(kind)
    with _ia3_reads_on_input(), torch.no_grad():  # as lycoris.modules.make_module calls it
        args = [tensors.get(k) for k in cls.weight_list]
        theirs = cls.make_module_from_state_dict("m", theirs_base, *args)
    theirs.apply_to()
    with torch.no_grad():
        x = _input(kind, seed=5)
        torch.testing.assert_close(theirs(x), layer(x), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- whole networks

NETWORK_CASES = [("algo=diff",), ("algo=ia3", "train_on_input=True"), ("algo=glora", "conv_dim=2", "conv_alpha=1")]


@pytest.mark.usefixtures("lycoris")
@pytest.mark.parametrize("args", NETWORK_CASES, ids=lambda a: "-".join(a))
def test_lycoris_reads_our_network_file(tiny_parts, args, tmp_path):
    """lycoris.kohya on a tiny SD1 model: our file has LyCORIS' modules, keys and shapes, and lycoris-lora's loader
    (create_network_from_weights + its forward pass) gives our output."""
    parts = tiny_parts["sd1"]
    inputs = unet_inputs(parts)
    ours = copy.deepcopy(parts)
    network = inject(make_config(*args, module="lycoris.kohya", dim=4, alpha=2.0), adapter_roots(ours))
    kwargs = dict(a.split("=", 1) for a in args)
    kwargs["algo"] = kwargs["algo"].replace("diff", "full")
    fresh = copy.deepcopy(parts)
    their_net = lycoris_kohya.create_network(1.0, 4, 2.0, None, _lycoris_te(fresh.text_encoders[0]), fresh.denoiser,
                                       **kwargs)  # fmt: skip
    their_keys = {f"{m.lora_name}.{k}": tuple(v.shape) for m in their_net.unet_loras + their_net.text_encoder_loras
                  for k, v in m.state_dict().items()}  # fmt: skip
    if "train_on_input=True" not in args:  # lycoris.kohya does not forward train_on_input to its modules
        assert {k: tuple(v.shape) for k, v in network.state_dict_for_file().items()} == their_keys
    perturb(network)
    network.set_multiplier(0.7)
    expected = outputs(ours, inputs)
    assert (expected[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    network.save(tmp_path / "a.safetensors")
    with _ia3_reads_on_input():
        got, count = _lycoris_forward(lycoris_kohya, parts, tmp_path / "a.safetensors", 0.7, inputs)
    assert count == len(network)
    assert_outputs_close(got, expected, atol=1e-5)


@pytest.mark.usefixtures("lycoris")
@pytest.mark.parametrize("algo", ["full", "ia3", "glora"])
def test_we_read_a_file_lycoris_wrote(tiny_parts, algo, tmp_path):
    """lycoris-lora's own network (create_network on a tiny SD1 model, tensors made non-zero, save_weights) loads
    in ours (network_from_file, and --network_weights into a network built from flags) with LyCORIS' output."""
    parts = tiny_parts["sd1"]
    inputs = unet_inputs(parts)
    theirs = copy.deepcopy(parts)
    te = _lycoris_te(theirs.text_encoders[0])
    net = lycoris_kohya.create_network(1.0, 4, 3.0, None, te, theirs.denoiser, algo=algo, conv_dim=2, conv_alpha=1)
    net.apply_to(te, theirs.denoiser, apply_text_encoder=True, apply_unet=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    net.save_weights(str(tmp_path / "theirs.safetensors"), torch.float32, None)
    net.set_multiplier(0.5)
    expected = outputs(theirs, inputs)
    assert (expected[0] - outputs(parts, inputs)[0]).abs().max() > 1e-3

    ours = copy.deepcopy(parts)
    network = network_from_file(tmp_path / "theirs.safetensors", adapter_roots(ours))
    network.set_multiplier(0.5)
    assert len(network) == len(net.unet_loras) + len(net.text_encoder_loras)
    assert_outputs_close(outputs(ours, inputs), expected, atol=1e-5)

    flags = copy.deepcopy(parts)  # --network_weights into a network built from the same flags
    built = inject(make_config(f"algo={algo}", "conv_dim=2", "conv_alpha=1", module="lycoris.kohya", dim=4, alpha=3.0),
                   adapter_roots(flags))  # fmt: skip
    built.load_file(tmp_path / "theirs.safetensors")
    built.set_multiplier(0.5)
    assert_outputs_close(outputs(flags, inputs), expected, atol=1e-5)


# ------------------------------------------------------------------------------------------ options and flags
def test_options_lycoris_ignores_are_switched_off_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        cfg = make_config("algo=ia3", "rank_dropout=0.3", "use_scalar=True", "dora_wd=True", module="lycoris.kohya",
                          flags=("--network_dropout", "0.2"))  # fmt: skip
    assert (cfg.algo, cfg.dropout, cfg.rank_dropout, cfg.use_scalar, cfg.dora) == ("ia3", None, None, False, False)
    for what in ("rank_dropout has no effect with algo=ia3", "use_scalar", "dora_wd", "--network_dropout"):
        assert what in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        cfg = make_config("algo=glora", "use_tucker=True", "train_on_input=True", "rank_dropout=0.1",
                          module="lycoris.kohya")  # fmt: skip
    assert (cfg.use_tucker, cfg.train_on_input, cfg.rank_dropout) == (False, False, None)
    assert "never builds GLoRA's tucker core" in caplog.text and "only (IA)³ reads it" in caplog.text
    full = make_config("algo=diff", "rank_dropout=0.1", module="lycoris.kohya")  # LyCORIS' full drops diff rows
    assert (full.algo, full.rank_dropout) == ("full", 0.1)
    with pytest.raises(ValueError, match="algo=glroa: unknown algorithm.*did you mean 'glora'"):
        make_config("algo=glroa", module="lycoris.kohya")


def test_train_on_input_changes_the_trained_axis(tiny_parts):
    """The flag test: train_on_input=True gives (IA)³ scales per input channel (on_input = 1), as LyCORIS' module
    does with it; a square layer (to_q 32x32) tells the two apart only by the flag."""
    shapes = {}
    for flag in ("False", "True"):
        parts = copy.deepcopy(tiny_parts["sd1"])
        network = inject(make_config("algo=ia3", f"train_on_input={flag}", module="lycoris.kohya"),
                         adapter_roots(parts))  # fmt: skip
        state = network.state_dict_for_file()
        shapes[flag] = (tuple(state["lora_te_text_model_encoder_layers_0_mlp_fc1.weight"].shape),
                        int(state["lora_te_text_model_encoder_layers_0_mlp_fc1.on_input"]))  # fmt: skip
        layer = network.layer("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q").base_layer
        assert layer.weight.shape[0] == layer.weight.shape[1]
    assert shapes == {"False": ((64,), 0), "True": ((32,), 1)}


def test_loading_an_ia3_file_of_the_other_axis_is_refused(tiny_parts, tmp_path):
    parts = copy.deepcopy(tiny_parts["sd1"])
    inject(make_config("algo=ia3", "train_on_input=True", module="lycoris.kohya"), adapter_roots(parts)).save(
        tmp_path / "in.safetensors")  # fmt: skip
    fresh = copy.deepcopy(tiny_parts["sd1"])
    network = inject(make_config("algo=ia3", module="lycoris.kohya"), adapter_roots(fresh))
    with pytest.raises(ValueError, match="on_input is 1 but the network has 0.*train_on_input"):
        network.load_file(tmp_path / "in.safetensors")


@pytest.mark.parametrize("args", [("algo=full",), ("algo=ia3",), ("algo=glora", "conv_dim=2")])
def test_scale_weight_norms_caps_every_module_exactly(tiny_parts, args):
    """--scale_weight_norms c: a module with ‖ΔW‖ > c ends at ‖ΔW‖ = c (each factor by its own root), the rest are
    unchanged."""
    parts = copy.deepcopy(tiny_parts["sd1"])
    network = inject(make_config(*args, module="lycoris.kohya"), adapter_roots(parts))
    perturb(network)
    with torch.no_grad():
        before = {n: network.layer(n).algo_delta().norm().item() for n in network.names}
        cap = sorted(before.values())[len(before) // 2]
        scaled, _, largest = network.apply_max_norm(cap)
        after = {n: network.layer(n).algo_delta().norm().item() for n in network.names}
    assert scaled == sum(v > cap for v in before.values()) > 0
    for name, norm in after.items():
        assert norm == pytest.approx(min(before[name], cap), rel=1e-4)
    assert largest == pytest.approx(cap, rel=1e-4)


def test_rank_dropout_drops_whole_output_units_of_a_full_module_bias_included():
    base = nn.Linear(6, 32)
    params = ALGOS["full"].init_params(tuple(base.weight.shape), None, has_bias=True)
    params = {k: torch.randn_like(v) for k, v in params.items()}
    layer = AdapterLayer(base, AdapterWeights(ALGOS["full"], params, 1.0), rank_dropout=0.5)
    x = _input("linear")
    torch.manual_seed(3)
    with torch.no_grad():
        change = layer.train()(x) - base(x)
        full_change = layer.eval()(x) - base(x)
    kept = [bool((change[:, o] != 0).any()) for o in range(change.shape[1])]
    assert 0 < sum(kept) < len(kept)  # some units dropped, some kept
    for o, keep in enumerate(kept):
        torch.testing.assert_close(change[:, o], full_change[:, o] if keep else torch.zeros_like(change[:, o]))


@pytest.mark.parametrize("case", ["full", "ia3-input", "glora"])
def test_a_1x1_conv_file_loads_on_the_equal_linear(case):
    """SD2's proj_in / proj_out are 1x1 convs in single-file models and Linear in diffusers: a module trained on the
    conv (LyCORIS, 4-D tensors) loads on the Linear (fit_to_base drops the 1x1 axes) with the same output."""
    from networks.files import check_shapes, fit_to_base

    algo = CASES[case][0]
    module, _ = _trained_lycoris(case, "conv1x1")
    conv, linear = _base("conv1x1"), nn.Linear(4, 6)  # the same weights as the conv LyCORIS trained on
    with torch.no_grad():
        linear.weight.copy_(conv.weight[:, :, 0, 0])
        linear.bias.copy_(conv.bias)
    tensors = fit_to_base(_their_tensors(module), tuple(linear.weight.shape))
    check_shapes("m", algo, tensors, tuple(linear.weight.shape), "file")
    layer = AdapterLayer(linear, AdapterWeights.from_file(tensors, algo, "m"))
    layer.multiplier = 0.8
    x = _input("conv1x1", seed=6)
    with torch.no_grad():
        expected = module(x).permute(0, 2, 3, 1)
        got = layer(x.permute(0, 2, 3, 1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_glora_tucker_core_from_a_file_is_read_as_lycoris_defines_it():
    """LyCORIS 4.1.3 never builds ``bm`` (so no module class can be the oracle), but its ΔW function reads one:
    ``_glora_weight`` with bm = the tucker chain b1·bm·b2."""
    from lycoris.modules.glora import _glora_weight

    from networks.files import check_shapes

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, 3, 3, generator=g)
    t = {"a1.weight": torch.randn(4, 2, 1, 1, generator=g), "a2.weight": torch.randn(2, 4, 1, 1, generator=g),
         "b1.weight": torch.randn(6, 2, 1, 1, generator=g), "b2.weight": torch.randn(2, 4, 1, 1, generator=g),
         "bm.weight": torch.randn(2, 2, 3, 3, generator=g), "alpha": torch.tensor(3.0)}  # fmt: skip
    check_shapes("m", "glora", t, (6, 4, 3, 3), "file")
    adapter = AdapterWeights.from_file(t, "glora", "m")
    expected = _glora_weight(w, *(t[f"{k}.weight"] for k in ("a1", "a2", "b1", "b2", "bm")), 1.5)
    torch.testing.assert_close(adapter.delta_weight((6, 4, 3, 3), base=w), expected, atol=1e-5, rtol=1e-5)
    assert ALGOS["glora"].options(adapter.params) == {"use_tucker": True}
