"""The pure algorithm functions against formulas typed independently in the test (and LyCORIS' factorisation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _networks_helpers import (
    oracle_delta,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
)

from networks.algos import ALGOS, detect_algo
from networks.algos import dora as dora_algo
from networks.algos.lokr import factorization

SHAPES = {"linear": (12, 18), "conv3": (12, 8, 3, 3), "conv1": (12, 8, 1, 1)}
CASES = [
    ("lora", {}),
    ("lora", {"use_tucker": True}),
    ("loha", {}),
    ("loha", {"use_tucker": True}),
    ("lokr", {}),
    ("lokr", {"decompose_both": True, "factor": 4}),
    ("lokr", {"use_tucker": True, "factor": 2}),
    ("lokr", {"full_matrix": True}),
]


def _random(params: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in params.items()}


def _file_view(algo_name: str, params: dict, alpha: float) -> dict:
    algo = ALGOS[algo_name]
    return {**{algo.file_keys[k]: v for k, v in params.items()}, "alpha": torch.tensor(alpha)}


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("algo_name,options", CASES)
def test_fresh_params_give_zero_delta(algo_name, options, shape_name):
    shape = SHAPES[shape_name]
    algo = ALGOS[algo_name]
    params = algo.init_params(shape, 2, **options)
    assert algo.delta_weight(params, 1.0, shape).abs().max() == 0
    assert any(p.abs().sum() > 0 for p in params.values())  # not all-zero: training can move away from 0


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("algo_name,options", CASES)
def test_delta_weight_matches_independent_formula(algo_name, options, shape_name):
    shape = SHAPES[shape_name]
    algo = ALGOS[algo_name]
    params = _random(algo.init_params(shape, 2, **options))
    rank = algo.rank(params)
    alpha = 3.0
    scale = alpha / rank if rank else 1.0
    ours = algo.delta_weight(params, scale, shape)
    expected = oracle_delta(_file_view(algo_name, params, alpha), shape)
    assert ours.shape == shape
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_tucker", [False, True])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_lora_factorised_forward_equals_op_with_delta(shape_name, use_tucker):
    shape = SHAPES[shape_name]
    algo = ALGOS["lora"]
    params = _random(algo.init_params(shape, 3, use_tucker=use_tucker))
    delta = algo.delta_weight(params, 0.5, shape)
    if len(shape) == 2:
        x = torch.randn(2, 5, shape[1])
        expected, conv = F.linear(x, delta), None
    else:
        conv = {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1)}
        x = torch.randn(2, shape[1], 9, 9)
        expected = F.conv2d(x, delta, None, **conv)
    ours = algo.project_up(algo.project_down(x, params, conv), params) * 0.5
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_lokr_factorization_matches_lycoris():
    lycoris_general = pytest.importorskip("lycoris.functional.general")
    for dim in [1, 2, 7, 12, 16, 32, 127, 128, 250, 320, 360, 512, 640, 768, 1024, 1280, 2048, 2816, 5120]:
        for factor in [-1, 2, 4, 8, 16, 64]:
            assert factorization(dim, factor) == lycoris_general.factorization(dim, factor), (dim, factor)


def test_lokr_shapes_follow_lycoris_rules():
    # out 12 = 3·4, in 18 = 3·6; rank 2 < max(4, 6)/2 -> w2 decomposed; decompose_both with rank < max(3,3)/2 fails
    p = ALGOS["lokr"].init_params((12, 18), 2)
    assert {k: tuple(v.shape) for k, v in p.items()} == {"lokr_w1": (3, 3), "lokr_w2_a": (4, 2), "lokr_w2_b": (2, 6)}
    big = ALGOS["lokr"].init_params((12, 18), 8)  # rank >= max(b, d) / 2 -> full w2, scale 1
    assert set(big) == {"lokr_w1", "lokr_w2"} and ALGOS["lokr"].rank(big) is None
    conv = ALGOS["lokr"].init_params((12, 8, 3, 3), 1)  # conv, not tucker: w2_b flattened (r, d·kh·kw)
    assert tuple(conv["lokr_w2_b"].shape) == (1, 4 * 9)


@pytest.mark.parametrize("shape", [(6, 5), (6, 4, 3, 3)])
def test_dora_weight_formula_and_identity_at_init(shape):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=g)
    delta = torch.randn(shape, generator=g) * 0.3
    magnitude = dora_algo.init_magnitude(weight)
    assert magnitude.shape == (shape[0], *[1] * (len(shape) - 1))
    torch.testing.assert_close(dora_algo.dora_weight(weight, torch.zeros(shape), magnitude), weight)
    m = magnitude * (1 + torch.rand(magnitude.shape, generator=g))
    merged = weight + delta
    row_norm = merged.flatten(1).norm(dim=1).reshape(magnitude.shape)
    torch.testing.assert_close(dora_algo.dora_weight(weight, delta, m), m * merged / row_norm)


def test_dora_reads_old_per_input_magnitude():
    g = torch.Generator().manual_seed(2)
    weight, delta = torch.randn(6, 4, 3, 3, generator=g), torch.randn(6, 4, 3, 3, generator=g)
    magnitude = dora_algo.init_magnitude(weight, "in")
    assert magnitude.shape == (1, 4, 1, 1)
    merged = weight + delta
    col_norm = merged.transpose(0, 1).flatten(1).norm(dim=1).reshape(1, 4, 1, 1)
    torch.testing.assert_close(dora_algo.dora_weight(weight, delta, magnitude), magnitude * merged / col_norm)
    with pytest.raises(ValueError, match="fits neither"):
        dora_algo.dora_weight(weight, delta, torch.ones(3, 1, 1, 1))


def test_detect_algo_names_formats():
    assert detect_algo({"lora_down.weight", "lora_up.weight", "alpha"}) == "lora"
    assert detect_algo({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha", "dora_scale"}) == "loha"
    assert detect_algo({"lokr_w1", "lokr_w2_a", "lokr_w2_b"}) == "lokr"
    assert detect_algo({"diff"}) == "full"
    assert detect_algo({"lora_A.weight", "lora_B.weight"}) == "peft"
