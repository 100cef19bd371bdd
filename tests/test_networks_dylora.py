"""DyLoRA (sd-scripts ``networks.dylora``, LyCORIS ``algo=dylora``), ``extract_lora_from_dylora.py`` and LoRA-FA
(``networks.lora_fa``).

Oracles: sd-scripts' DyLoRA forward re-derived here from its source (networks/dylora.py) on the same tensors and the
same drawn rank; lycoris-lora 4.1.3's ``DyLoraModule`` on the same weights (training forward with the same
``random`` draw, gradients, its state dict); diffusers' ``load_lora_weights`` on a cut file; the math (the file is
the LoRA the eval forward applies, cut = first k ranks); LoRA-FA's frozen tensors bit-identical after training.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from _networks_helpers import (
    adapter_roots,
    make_config,
    outputs,
    perturb,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
    unet_inputs,
)
from torch import nn

from library.run.trainable import Trainable
from networks import inject, network_from_file
from networks.algos import dylora
from networks.layers import AdapterWeights, DyLoRALayer

BASES = {
    "linear": lambda: nn.Linear(12, 10),
    "conv3x3": lambda: nn.Conv2d(6, 8, 3, padding=1, stride=2),
    "conv1x1": lambda: nn.Conv2d(6, 8, 1),
}


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 12, generator=g) if kind == "linear" else torch.randn(2, 6, 7, 7, generator=g)


def _layer(kind: str, rank: int, block: int, alpha: float, style: str) -> DyLoRALayer:
    torch.manual_seed(0)
    base = BASES[kind]()
    params = dylora.init_params(tuple(base.weight.shape), rank, block=block)
    g = torch.Generator().manual_seed(2)
    params = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in params.items()}  # ΔW ≠ 0
    layer = DyLoRALayer(base, AdapterWeights(dylora.ALGORITHM, params, alpha), style=style)
    layer.base_layer.requires_grad_(False)
    return layer


def _lora_out(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, base: nn.Module) -> torch.Tensor:
    """up(down(x)) with the base layer's conv arguments on down (sd-scripts' DyLoRAModule.forward)."""
    if isinstance(base, nn.Linear):
        return F.linear(F.linear(x, down), up)
    h = F.conv2d(x, down, stride=base.stride, padding=base.padding)
    return F.conv2d(h, up.reshape(up.shape[0], up.shape[1], 1, 1))


# ------------------------------------------------------------------------------------------ sd-scripts DyLoRA
@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("unit", [1, 2])
def test_kohya_training_forward_is_sd_scripts_formula(kind, unit):
    """sd-scripts: b = randint(0, r-1) - b % unit; all r ranks used; scale alpha/r · sqrt(r / (b + unit)); only rows
    b..b+unit get gradients. (The draw comes from torch's RNG here, the same uniform law as sd-scripts' ``random``.)"""
    rank, alpha = 4, 3.0
    layer = _layer(kind, rank, unit, alpha, "kohya").train()
    x = _input(kind)
    down, up = (t.detach() for t in dylora.join(layer.adapter.params))
    for seed in range(6):
        torch.manual_seed(seed)
        b = int(torch.randint(rank, ()))
        b -= b % unit
        expected = layer.base_layer(x) + _lora_out(x, down, up, layer.base_layer) * alpha / rank * math.sqrt(
            rank / (b + unit)
        )
        torch.manual_seed(seed)
        layer.adapter.zero_grad(set_to_none=True)
        got = layer(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert layer.last_block == b // unit
        got.square().sum().backward()
        trained = {k for k, p in layer.adapter.params.items() if p.grad is not None}
        assert trained == {f"lora_down_{b // unit}", f"lora_up_{b // unit}"}  # the others: no gradient at all
        assert all(layer.adapter.params[k].grad.abs().sum() > 0 for k in trained)


def test_kohya_eval_forward_is_the_files_lora_and_merge_agrees():
    layer = _layer("conv3x3", 4, 2, 3.0, "kohya").eval()
    x = _input("conv3x3")
    f = layer.adapter.file_tensors()
    expected = layer.base_layer(x) + _lora_out(x, f["lora_down.weight"], f["lora_up.weight"], layer.base_layer) * 0.75
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        layer.merge()
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        layer.unmerge()


@pytest.mark.parametrize("style", dylora.STYLES)
def test_gradient_checkpointing_recompute_trains_the_block_the_forward_drew(style):
    """A checkpointed forward is recomputed in backward; the recompute must draw the same block (torch's RNG is
    replayed) or the scale / rows saved for backward would belong to another block."""
    from torch.utils.checkpoint import checkpoint

    for seed in range(4):
        grads = []
        for use_checkpoint in (False, True):
            layer = _layer("conv3x3", 8, 2, 3.0, style).train()
            x = _input("conv3x3")
            torch.manual_seed(seed)
            out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
            out.square().sum().backward()
            grads.append({k: p.grad for k, p in layer.adapter.params.items() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2
        assert all(torch.allclose(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-6) for k in grads[0])


def test_unit_changes_the_trained_block_size():
    """The flag test: ``unit`` is the number of rows one step trains (and the draw's granularity)."""
    seen = {}
    for unit in (1, 2, 4):
        layer = _layer("linear", 4, unit, 4.0, "kohya").train()
        torch.manual_seed(3)
        layer(_input("linear")).sum().backward()
        grads = [p.grad for p in layer.adapter.params.values() if p.grad is not None]
        seen[unit] = {tuple(g.shape) for g in grads}
    assert seen == {1: {(1, 12), (10, 1)}, 2: {(2, 12), (10, 2)}, 4: {(4, 12), (10, 4)}}


# ---------------------------------------------------------------------------------------------- LyCORIS DyLoRA
lycoris_dylora = pytest.importorskip("lycoris.modules.dylora")


@pytest.fixture
def same_draw(monkeypatch):
    """LyCORIS draws its block with ``random.randint(0, n - 1)``: give it the block our layer drew last."""
    state = {}

    def randint(a, b):
        assert (a, b) == (0, state["n"] - 1)
        return state["layer"].last_block

    monkeypatch.setattr(lycoris_dylora.random, "randint", randint)
    return state


def _lycoris_module(layer: DyLoRALayer, block: int, alpha: float):
    base = copy.deepcopy(layer.base_layer)
    theirs = lycoris_dylora.DyLoraModule("m", base, 1.0, lora_dim=layer.adapter.rank, alpha=alpha, block_size=block)
    params = layer.adapter.params
    with torch.no_grad():
        for j in range(dylora.block_count(params)):
            theirs.down_list[j].copy_(params[f"lora_down_{j}"].reshape(block, -1))
            theirs.up_list[j].copy_(params[f"lora_up_{j}"].reshape(-1, block))
    theirs.apply_to()
    return theirs, base


@pytest.mark.parametrize("kind", list(BASES))
def test_lycoris_training_forward_and_gradients_equal_dylora_module(kind, same_draw):
    """Same weights, same drawn block: the same output (≤ 1e-5) and the same gradient on the trained block; the
    untrained blocks get no gradient in either."""
    block, alpha = 2, 3.0
    layer = _layer(kind, 6, block, alpha, "lycoris").train()
    same_draw.update(layer=layer, n=3)
    theirs, base = _lycoris_module(layer, block, alpha)
    theirs.train()
    x = _input(kind)
    for seed in range(5):
        layer.adapter.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        got = layer(x)
        expected = base(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        got.square().sum().backward()
        expected.square().sum().backward()
        j = layer.last_block
        assert [i for i, p in enumerate(theirs.down_list) if p.grad is not None] == [j]
        assert {k for k, p in layer.adapter.params.items() if p.grad is not None} == {f"lora_down_{j}", f"lora_up_{j}"}
        ours_down = layer.adapter.params[f"lora_down_{j}"].grad.reshape(block, -1)
        torch.testing.assert_close(ours_down, theirs.down_list[j].grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            layer.adapter.params[f"lora_up_{j}"].grad.reshape(-1, block), theirs.up_list[j].grad, atol=1e-4, rtol=1e-4
        )


def test_lycoris_module_dropout_skips_like_dylora_module(same_draw):
    """module_dropout (LyCORIS' one DyLoRA dropout): the same torch draw skips the same calls."""
    layer = _layer("linear", 4, 2, 3.0, "lycoris").train()
    same_draw.update(layer=layer, n=2)
    layer.module_dropout = 0.5
    base = copy.deepcopy(layer.base_layer)
    theirs = lycoris_dylora.DyLoraModule("m", base, 1.0, lora_dim=4, alpha=3.0, block_size=2, module_dropout=0.5)
    with torch.no_grad():
        for j in range(2):
            theirs.down_list[j].copy_(layer.adapter.params[f"lora_down_{j}"])
            theirs.up_list[j].copy_(layer.adapter.params[f"lora_up_{j}"])
    theirs.apply_to()
    theirs.train()
    x, skipped = _input("linear"), 0
    for seed in range(8):
        torch.manual_seed(seed)
        got = layer(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, base(x), atol=1e-5, rtol=1e-5)
        skipped += torch.equal(got, layer.base_layer(x))
    assert 0 < skipped < 8  # some calls skipped, some not: the comparison covers both


@pytest.mark.parametrize("kind", list(BASES))
def test_lycoris_file_tensors_equal_its_state_dict_and_eval_is_that_lora(kind):
    layer = _layer(kind, 4, 2, 3.0, "lycoris").eval()
    theirs, _ = _lycoris_module(layer, 2, 3.0)
    their_sd = {k: v.detach() for k, v in theirs.state_dict().items()}
    ours = layer.adapter.file_tensors()
    assert set(ours) == set(their_sd) == {"lora_down.weight", "lora_up.weight", "alpha"}
    assert torch.equal(ours["lora_down.weight"], their_sd["lora_down.weight"])
    assert torch.equal(ours["lora_up.weight"].flatten(1), their_sd["lora_up.weight"])  # LyCORIS: conv up 2-D
    x = _input(kind)
    expected = layer.base_layer(x) + _lora_out(x, their_sd["lora_down.weight"], their_sd["lora_up.weight"],
                                               layer.base_layer) * float(their_sd["alpha"]) / 4  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_lycoris_network_file_loads_into_ours(tiny_parts, tmp_path, monkeypatch):
    """LyCORIS' own create_network(algo=dylora) on the tiny SD1: its modules are ours, and its saved tensors (random,
    conv lora_up 2-D) load into our lycoris dylora network and are written back unchanged."""
    from test_networks_oracles import _lycoris_te
    from test_networks_oracles import lycoris as lycoris_fixture

    from library.files.weights import save_state_dict

    kohya = lycoris_fixture.__wrapped__(monkeypatch)
    parts = copy.deepcopy(tiny_parts["sd1"])
    theirs = kohya.create_network(1.0, 4, 2.0, None, _lycoris_te(parts.text_encoders[0]), parts.denoiser,
                                  algo="dylora", block_size="2", conv_dim="4")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    their_sd = {f"{m.lora_name}.{k}": v.detach().clone() for m in theirs.unet_loras + theirs.text_encoder_loras
                for k, v in m.state_dict().items()}  # fmt: skip
    save_state_dict(their_sd, tmp_path / "theirs.safetensors")
    ours = inject(make_config("algo=dylora", "block_size=2", "conv_dim=4", module="lycoris.kohya", dim=4, alpha=2.0),
                  adapter_roots(copy.deepcopy(tiny_parts["sd1"])))  # fmt: skip
    report = ours.load_file(tmp_path / "theirs.safetensors")  # strict: every module on both sides
    assert len(report.loaded) == len(ours) == len(theirs.unet_loras) + len(theirs.text_encoder_loras)
    written = ours.state_dict_for_file()
    assert written.keys() == their_sd.keys()
    assert any(v.dim() == 2 and written[k].dim() == 4 for k, v in their_sd.items())  # a conv up was 2-D there
    assert all(torch.equal(written[k].reshape(v.shape), v) for k, v in their_sd.items())


# ----------------------------------------------------------------------------------------------- networks
@pytest.mark.parametrize(
    "module,args,same_as",
    [
        ("networks.dylora", ("unit=2",), ("networks.lora", ())),
        ("networks.dylora", ("conv_dim=4",), ("networks.lora", ("conv_dim=4",))),
        ("lycoris.kohya", ("algo=dylora", "block_size=2"), ("lycoris.kohya", ())),
    ],
)
def test_network_targets_and_file_layout(tiny_parts, module, args, same_as):
    """networks.dylora targets sd-scripts' modules (networks.lora's, conv blocks with conv_dim); lycoris dylora the
    LyCORIS preset's; the file is a plain LoRA of the same keys and shapes as a LoRA of that rank."""
    dy = inject(make_config(*args, module=module, dim=4, alpha=4.0), adapter_roots(copy.deepcopy(tiny_parts["sd1"])))
    ref = inject(make_config(*same_as[1], module=same_as[0], dim=4, alpha=4.0),
                 adapter_roots(copy.deepcopy(tiny_parts["sd1"])))  # fmt: skip
    ours = {k: tuple(v.shape) for k, v in dy.state_dict_for_file().items()}
    assert ours == {k: tuple(v.shape) for k, v in ref.state_dict_for_file().items()}
    assert all(isinstance(layer, DyLoRALayer) for layer in dy.layers())


@pytest.fixture(scope="module")
def trained_file(tiny_parts, tmp_path_factory):
    """A networks.dylora network (unit 2, rank 4, conv too) with random tensors, saved; (network, parts, path)."""
    parts = copy.deepcopy(tiny_parts["sd1"])
    network = inject(make_config("unit=2", "conv_dim=4", module="networks.dylora", dim=4, alpha=2.0),
                     adapter_roots(parts))  # fmt: skip
    perturb(network)
    path = tmp_path_factory.mktemp("dylora") / "dy.safetensors"
    network.save(path, metadata={"ss_training_comment": "hello"})
    return network, parts, path


def test_extract_cuts_the_first_units_and_diffusers_loads_the_cut(trained_file, tiny_parts, tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from library.files.weights import load_state_dict
    from networks import extract_lora_from_dylora as tool

    network, _, path = trained_file
    written = tool.run(["--model", str(path), "--save_to", str(tmp_path / "cut.safetensors"), "--unit", "2"])
    assert [p.name for p in written] == ["cut-0002.safetensors"]  # ranks below the file's rank 4, as sd-scripts
    cut, meta = load_state_dict(written[0])
    assert meta["ss_network_dim"] == "2" and meta["ss_training_comment"] == "split from DyLoRA, rank 4 to 2; hello"
    for name in network.names:
        params = network.adapters[name].params
        assert torch.equal(cut[f"{name}.lora_down.weight"], params["lora_down_0"])  # the first unit, bit for bit
        assert torch.equal(cut[f"{name}.lora_up.weight"], params["lora_up_0"])
        assert float(cut[f"{name}.alpha"]) == 2.0  # alpha kept (sd-scripts)
    # loads in diffusers and in our --network_weights reader, with the same UNet output
    inputs = unet_inputs(tiny_parts["sd1"])
    ours = copy.deepcopy(tiny_parts["sd1"])
    network_from_file(written[0], adapter_roots(ours))
    theirs = copy.deepcopy(tiny_parts["sd1"])
    pipe = StableDiffusionPipeline(vae=theirs.vae, unet=theirs.denoiser, scheduler=DDIMScheduler(),
                                   text_encoder=theirs.text_encoders[0], tokenizer=theirs.tokenizers[0],
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    pipe.load_lora_weights(str(written[0]), adapter_name="cut")
    torch.testing.assert_close(outputs(theirs, inputs)[0], outputs(ours, inputs)[0], atol=1e-5, rtol=1e-4)


def test_extract_refuses_what_is_not_a_dylora_file(tmp_path, capsys):
    from library.files.weights import save_state_dict
    from networks import extract_lora_from_dylora as tool

    save_state_dict({"lora_unet_x.hada_w1_a": torch.zeros(2, 2)}, tmp_path / "loha.safetensors")
    code = tool.main(["--model", str(tmp_path / "loha.safetensors"), "--save_to", str(tmp_path / "o.safetensors"),
                      "--unit", "1"])  # fmt: skip
    assert code == 2 and "lora_unet_x.hada_w1_a: not a DyLoRA file" in capsys.readouterr().err
    assert tool.main(["--model", str(tmp_path / "loha.safetensors"), "--save_to", "o.txt"]) == 2
    assert "--unit is required" in capsys.readouterr().err


def test_network_weights_and_dim_from_weights_rebuild_the_blocks(trained_file, tiny_parts):
    network, _, path = trained_file
    cfg = make_config("unit=2", "conv_dim=4", module="networks.dylora", dim=4, alpha=2.0)
    fresh = inject(cfg, adapter_roots(copy.deepcopy(tiny_parts["sd1"])))
    fresh.load_file(path)
    rebuilt = network_from_file(path, adapter_roots(copy.deepcopy(tiny_parts["sd1"])), cfg)  # --dim_from_weights
    for other in (fresh, rebuilt):
        assert all(isinstance(layer, DyLoRALayer) for layer in other.layers())
        assert other.sparse_gradients and isinstance(other, Trainable)  # the trainer keeps untrained blocks grad-less
        for name in network.names:
            mine, theirs = network.adapters[name].params, other.adapters[name].params
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    odd = make_config("unit=4", "conv_dim=4", module="networks.dylora", dim=4, alpha=2.0)
    assert dylora.block_size(network_from_file(path, adapter_roots(copy.deepcopy(tiny_parts["sd1"])), odd)
                             .adapters[network.names[0]].params) == 4  # fmt: skip


def test_max_norm_and_loraplus_on_dylora(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sd1"])
    cfg = make_config("unit=2", "loraplus_lr_ratio=16", module="networks.dylora", dim=4, alpha=2.0)
    network = inject(cfg, adapter_roots(parts))
    perturb(network, std=2.0)
    name = network.names[0]
    before = network.layer(name).algo_delta().norm()
    assert before > 1.0
    network.apply_max_norm(1.0)
    torch.testing.assert_close(network.layer(name).algo_delta().norm(), torch.tensor(1.0), atol=1e-5, rtol=1e-5)
    groups = {g["name"]: g for g in network.param_groups(learning_rate=1e-3)}
    plus = {id(p) for p in groups["unet plus"]["params"]}
    ups = {id(p) for k, p in network.adapters[name].params.items() if k.startswith("lora_up_")}
    assert ups <= plus and groups["unet plus"]["lr"] == pytest.approx(0.016)


@pytest.mark.parametrize(
    "module,args,flags,needle",
    [
        ("networks.dylora", ("unit=3",), (), "--network_dim 4 is not a multiple of unit=3"),
        ("networks.dylora", ("conv_dim=8",), (), "networks.dylora needs conv_dim == --network_dim (4)"),
        ("networks.dylora", ("conv_dim=4", "conv_alpha=1"), (), "conv_alpha=1.0: networks.dylora uses"),
        ("networks.dylora", (), ("--network_dropout", "0.1"), "--network_dropout is not supported by networks.dylora"),
        ("networks.dylora", ("algo=loha",), (), "networks.dylora trains dylora only"),
        ("networks.dylora", ("block_dims=" + ",".join(["2"] * 25),), (), "not supported by networks.dylora"),
        ("lycoris.kohya", ("algo=dylora", "block_size=3"), (), "--network_dim 4 is not a multiple of block_size=3"),
        ("lycoris.kohya", ("algo=dylora", "rank_dropout=0.1"), (), "rank_dropout is not supported by lycoris"),
        ("lycoris.kohya", ("algo=dylora", "unit=2"), (), "unit: only networks.dylora reads it"),
        ("networks.lora", ("algo=dylora",), (), "algo=dylora needs --network_module networks.dylora"),
        ("networks.lora_fa", ("dora_wd=1",), (), "not supported by networks.lora_fa"),
        ("networks.lora_fa", ("loraplus_lr_ratio=4",), (), "networks.lora_fa trains lora_up only"),
    ],
)
def test_refused_options_name_the_argument(module, args, flags, needle):
    with pytest.raises(ValueError) as e:
        make_config(*args, module=module, dim=4, alpha=2.0, flags=flags)
    assert needle in str(e.value)


# --------------------------------------------------------------------------------------------------- LoRA-FA
def test_lora_fa_init_and_parameters(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sd1"])
    torch.manual_seed(0)
    network = inject(make_config(module="networks.lora_fa", dim=4, alpha=2.0), adapter_roots(parts))
    groups = network.param_groups(learning_rate=1e-3)
    in_groups = {id(p) for g in groups for p in g["params"]}
    for name in network.names:
        params = network.adapters[name].params
        assert not params["lora_down"].requires_grad and id(params["lora_down"]) not in in_groups
        assert params["lora_up"].requires_grad and id(params["lora_up"]) in in_groups
        assert torch.count_nonzero(params["lora_up"]) == 0
    down = torch.cat([network.adapters[n].params["lora_down"].flatten() for n in network.names])
    # N(0, 2 / (in + r)) per module: standardised, the pooled values have std 1 (sd-scripts / the paper's init)
    std = torch.cat([(network.adapters[n].params["lora_down"] / math.sqrt(
        2.0 / (network.adapters[n].params["lora_down"].shape[1] + 4))).flatten() for n in network.names])  # fmt: skip
    assert down.numel() > 5000 and abs(std.std().item() - 1.0) < 0.05 and abs(std.mean().item()) < 0.05


# ---------------------------------------------------------------------------------------------- training runs
def test_lora_fa_training_keeps_down_bit_identical_and_trains_up(tiny_dir, dataset, tmp_path, tiny_parts):
    """A real run (AdamW with weight decay, 3 steps) from a saved init: lora_down is bit-identical, lora_up moved."""
    from test_train_network import args_for, train

    from library.files.weights import load_state_dict

    init = tmp_path / "init.safetensors"
    network = inject(make_config(module="networks.lora_fa", dim=4, alpha=2.0), adapter_roots(copy.deepcopy(
        tiny_parts["sd1"])))  # fmt: skip
    network.save(init)
    result = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "out", "--network_module",
                                    "networks.lora_fa", "--network_weights", str(init), "--optimizer_args",
                                    "weight_decay=0.1", steps=3))  # fmt: skip
    before, after = load_state_dict(init)[0], load_state_dict(result.output)[0]
    assert before.keys() == after.keys()
    downs = [k for k in before if k.endswith("lora_down.weight")]
    ups = [k for k in before if k.endswith("lora_up.weight")]
    assert downs and all(torch.equal(before[k], after[k]) for k in downs)
    assert all(torch.count_nonzero(after[k]) > 0 for k in ups)
    assert load_state_dict(result.output)[1]["ss_network_module"] == "networks.lora_fa"


def test_dylora_resume_repeats_the_uninterrupted_run(tiny_dir, dataset, tmp_path):
    """The block draws come from Python's ``random``, which --save_state keeps: a resumed run is bitwise the same."""
    from test_train_network import args_for, train

    from library.files.weights import load_state_dict

    common = ["--network_module", "networks.dylora", "--network_args", "unit=2", "--save_every_n_steps", "1",
              "--save_state"]  # fmt: skip
    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common, steps=2))
    state = tmp_path / "a" / "t-step00000001-state"
    resumed = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common, "--resume", str(state),
                                     steps=2))  # fmt: skip
    assert resumed.losses == full.losses
    a, b = load_state_dict(full.output)[0], load_state_dict(resumed.output)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_fa_max_norm_scales_both_factors_as_sd_scripts(tiny_parts):
    """--scale_weight_norms on LoRA-FA: ‖ΔW‖ capped by scaling lora_up and the frozen lora_down each by √ratio, as
    sd-scripts' lora_fa.py apply_max_norm_regularization does."""
    network = inject(make_config(module="networks.lora_fa", dim=4, alpha=4.0), adapter_roots(copy.deepcopy(
        tiny_parts["sd1"])))  # fmt: skip
    name = network.names[0]
    params = network.adapters[name].params
    with torch.no_grad():
        params["lora_up"].normal_(0, 1.0)
    down, up = params["lora_down"].clone(), params["lora_up"].clone()
    norm = network.layer(name).algo_delta().norm()
    assert norm > 1.0
    network.apply_max_norm(1.0)
    torch.testing.assert_close(params["lora_down"], down * (1.0 / norm).sqrt(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(params["lora_up"], up * (1.0 / norm).sqrt(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(network.layer(name).algo_delta().norm(), torch.tensor(1.0), atol=1e-5, rtol=1e-5)
    assert not params["lora_down"].requires_grad  # still frozen for the optimizer


def test_several_processes_leave_no_gradient_where_no_process_trained_a_block():
    """The trainer's manual all-reduce with two processes (the other one's tensors given): a block trained on some
    process gets the mean; a block trained nowhere keeps ``grad is None`` (AdamW then skips it), not zeros."""
    from types import SimpleNamespace

    from library.run.trainer import Trainer

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    params[0].grad = torch.full((3,), 4.0)  # trained here only
    other = [torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3), torch.full((3,), 2.0), torch.zeros(3)]  # flags, grads

    def reduce(t, reduction):
        theirs = other.pop(0)
        return t + theirs if reduction == "sum" else (t + theirs) / 2

    acc = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=reduce, clip_grad_norm_=None)
    for sparse in (True, False):
        for p in params[1:]:
            p.grad = None
        params[0].grad = torch.full((3,), 4.0)
        other[:] = ([torch.tensor([0.0, 1.0, 0.0])] if sparse else []) + [torch.zeros(3), torch.full((3,), 2.0),
                                                                           torch.zeros(3)]  # fmt: skip
        fake = SimpleNamespace(acc=acc, params=params, cfg=SimpleNamespace(optim=SimpleNamespace(max_grad_norm=0)),
                               trainable=SimpleNamespace(gradient_sync="manual", sparse_gradients=sparse))  # fmt: skip
        Trainer.sync_gradients(fake)
        assert not other, "one all-reduce per tensor (and one for the flags when sparse)"
        assert torch.equal(params[0].grad, torch.full((3,), 2.0)) and torch.equal(params[1].grad, torch.ones(3))
        assert (params[2].grad is None) == sparse  # without the flag: zeros, as for any other network
