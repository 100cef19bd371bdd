"""AdapterLayer: fresh == base; perturbed: forward == merged forward == the independent formula, every algorithm."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _networks_helpers import (
    oracle_weight,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
)
from torch import nn

from networks.algos import ALGOS
from networks.algos import dora as dora_algo
from networks.algos import norm as norm_algo
from networks.layers import AdapterLayer, AdapterWeights, NormAdapterLayer, NormWeights

CASES = [
    ("lora", {}, False),
    ("lora", {"use_tucker": True}, False),
    ("lora", {}, True),
    ("loha", {}, False),
    ("loha", {"use_tucker": True}, True),
    ("lokr", {"factor": 4}, False),
    ("lokr", {"decompose_both": True, "factor": 4, "use_tucker": True}, True),
    ("lokr", {"full_matrix": True}, False),
]


def _base(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(16, 24)
    if kind == "conv1":
        return nn.Conv2d(16, 24, 1)
    return nn.Conv2d(16, 24, 3, stride=2, padding=1)


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 7, 16, generator=g) if kind == "linear" else torch.randn(2, 16, 9, 9, generator=g)


def _layer(algo: str, options: dict, use_dora: bool, kind: str, rank: int = 4) -> AdapterLayer:
    base = _base(kind)
    params = ALGOS[algo].init_params(tuple(base.weight.shape), rank, **options)
    magnitude = dora_algo.init_magnitude(base.weight) if use_dora else None
    return AdapterLayer(base, AdapterWeights(ALGOS[algo], params, alpha=2.0, magnitude=magnitude))


def _perturb(layer: AdapterLayer, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.adapter.params.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if layer.adapter.magnitude is not None:
            layer.adapter.magnitude.mul_(1 + 0.3 * torch.rand(layer.adapter.magnitude.shape, generator=g))


def _op(base: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if isinstance(base, nn.Linear):
        return F.linear(x, weight, base.bias)
    return F.conv2d(x, weight, base.bias, base.stride, base.padding)


@pytest.mark.parametrize("kind", ["linear", "conv1", "conv3"])
@pytest.mark.parametrize("algo,options,use_dora", CASES)
def test_fresh_adapter_leaves_output_unchanged(algo, options, use_dora, kind):
    layer = _layer(algo, options, use_dora, kind)
    x = _input(kind)
    torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "conv1", "conv3"])
@pytest.mark.parametrize("algo,options,use_dora", CASES)
def test_forward_merged_and_formula_agree(algo, options, use_dora, kind):
    layer = _layer(algo, options, use_dora, kind)
    _perturb(layer)
    layer.multiplier = 0.7
    x = _input(kind)
    base_weight = layer.base_layer.weight.detach().clone()
    tensors = layer.adapter.file_tensors()
    expected = _op(layer.base_layer, x, oracle_weight(base_weight, tensors, 0.7))
    with torch.no_grad():
        forward = layer(x)
        base_out = layer.base_layer(x)
        layer.merge()
        merged = layer(x)
    assert (forward - base_out).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(forward, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-5)
    layer.unmerge()
    assert torch.equal(layer.base_layer.weight, base_weight)  # exact restore


def test_layer_trains_only_adapter_tensors():
    layer = _layer("lora", {}, True, "conv3")
    layer.base_layer.requires_grad_(False)
    layer.train()
    layer(_input("conv3")).square().mean().backward()
    assert layer.base_layer.weight.grad is None
    assert all(p.grad is not None for p in layer.adapter.parameters())


def test_dropouts_act_in_training_only():
    layer = _layer("lora", {}, False, "linear")
    _perturb(layer)
    layer.dropout, layer.rank_dropout = 0.5, 0.5
    x = _input("linear")
    layer.eval()
    with torch.no_grad():
        eval_out = layer(x)
        layer.dropout = layer.rank_dropout = None
        clean = layer(x)
        layer.dropout, layer.rank_dropout = 0.5, 0.5
        layer.train()
        torch.manual_seed(0)
        train_out = layer(x)
    torch.testing.assert_close(eval_out, clean)
    assert not torch.allclose(train_out, clean)


def test_rank_dropout_in_weight_path_masks_output_rows():
    layer = _layer("loha", {}, False, "linear")
    _perturb(layer)
    layer.rank_dropout = 0.5
    layer.train()
    x = _input("linear")
    with torch.no_grad():
        torch.manual_seed(0)
        delta = layer(x) - layer.base_layer(x)
    dropped = (delta.abs().amax(dim=(0, 1)) == 0).sum()
    assert 0 < dropped < 24  # some output rows of ΔW dropped, not all


def test_multiplier_zero_and_module_dropout_return_base():
    layer = _layer("lokr", {"factor": 4}, False, "conv3")
    _perturb(layer)
    x = _input("conv3")
    layer.multiplier = 0.0
    torch.testing.assert_close(layer(x), layer.base_layer(x))
    layer.multiplier, layer.module_dropout = 1.0, 0.999
    layer.train()
    torch.manual_seed(0)
    torch.testing.assert_close(layer(x), layer.base_layer(x))  # skipped for the step
    layer.eval()
    assert not torch.allclose(layer(x), layer.base_layer(x))  # never in eval


def test_norm_adapter_forward_and_merge():
    torch.manual_seed(0)
    for base, x in ((nn.GroupNorm(4, 16), torch.randn(2, 16, 5, 5)), (nn.LayerNorm(16), torch.randn(2, 3, 16))):
        base.weight.data.uniform_(0.5, 1.5)
        params = norm_algo.init_params(16)
        layer = NormAdapterLayer(base, NormWeights(params))
        torch.testing.assert_close(layer(x), base(x))
        with torch.no_grad():
            layer.adapter.params["w_norm"].normal_()
            layer.adapter.params["b_norm"].normal_()
        layer.multiplier = 0.5
        ref = copy.deepcopy(base)
        with torch.no_grad():
            ref.weight += 0.5 * layer.adapter.params["w_norm"]
            ref.bias += 0.5 * layer.adapter.params["b_norm"]
            expected, out = ref(x), layer(x)
            layer.merge()
            merged = layer(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(merged, expected)


def test_use_scalar_starts_at_zero_and_is_folded_into_file_tensors():
    base = _base("linear")
    algo = ALGOS["lora"]
    params = algo.init_params((24, 16), 4, use_scalar=True)
    adapter = AdapterWeights(algo, params, alpha=4.0, use_scalar=True)
    layer = AdapterLayer(base, adapter)
    x = _input("linear")
    torch.testing.assert_close(layer(x), base(x))
    with torch.no_grad():
        adapter.scalar.fill_(0.5)
    tensors = adapter.file_tensors()
    torch.testing.assert_close(tensors["lora_up.weight"], params["lora_up"] * 0.5)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, oracle_weight(base.weight, tensors, 1.0), base.bias))


@pytest.mark.parametrize("algo,options,use_dora", [CASES[0], CASES[3], CASES[2], CASES[5]])
def test_half_precision_base_with_fp32_adapter(algo, options, use_dora):
    """Training keeps adapters in fp32 over a bf16 model: the forward runs in the input's dtype and stays close to
    the fp32 result; the merge writes a bf16 weight."""
    layer = _layer(algo, options, use_dora, "conv3")
    _perturb(layer)
    x = _input("conv3")
    with torch.no_grad():
        reference = layer(x)
        layer.base_layer.to(torch.bfloat16)
        out = layer(x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
        layer.merge()
        assert layer.base_layer.weight.dtype == torch.bfloat16
        torch.testing.assert_close(layer(x.to(torch.bfloat16)).float(), reference, rtol=0.05, atol=0.05)
