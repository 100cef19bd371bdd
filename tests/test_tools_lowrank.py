"""networks.lowrank: the SVD of a product from its factors against torch.linalg on the full matrix, the rank rules
against their definitions typed here independently, the quantile against torch.quantile."""

from __future__ import annotations

import pytest
import torch

from networks.lowrank import Delta, clamp_factors, dynamic_rank, quantile, select_rank, sum_deltas, svd_all, to_lora


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


@pytest.mark.parametrize("out_dim,in_dim,rank", [(40, 24, 6), (8, 50, 12), (30, 7, 16), (33, 33, 33)])
def test_factored_svd_is_the_svd_of_the_product(out_dim, in_dim, rank):
    up, down = _rand(out_dim, rank, seed=1), _rand(rank, in_dim, seed=2)
    full = up.double() @ down.double()
    (svd,) = svd_all([Delta((out_dim, in_dim), up=up, down=down)])
    k = min(out_dim, in_dim, rank)
    assert svd.S.shape == (k,) and svd.Vh.shape == (k, in_dim)
    torch.testing.assert_close(svd.S.double(), torch.linalg.svdvals(full)[:k], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(svd.Vh @ svd.Vh.T, torch.eye(k), atol=1e-5, rtol=0)  # orthonormal rows
    torch.testing.assert_close(svd.us().double() @ svd.Vh.double(), full, atol=1e-4, rtol=1e-5)  # ΔW = U S Vh
    u = svd.u()
    torch.testing.assert_close(u.T @ u, torch.eye(k), atol=1e-4, rtol=0)


def test_batched_groups_and_dense_deltas_come_back_in_order():
    deltas = [
        Delta((20, 12), up=_rand(20, 4, seed=i), down=_rand(4, 12, seed=10 + i)) if i % 2 else
        Delta((20, 3, 2, 2), dense=_rand(20, 12, seed=i))
        for i in range(6)
    ]  # fmt: skip
    for d, svd in zip(deltas, svd_all(deltas)):
        torch.testing.assert_close(svd.S, torch.linalg.svdvals(d.matrix())[: svd.S.numel()], atol=1e-5, rtol=1e-5)


def test_to_lora_is_the_best_rank_r_approximation_with_conv_layout():
    dense = _rand(16, 3 * 3 * 3, seed=3)
    (svd,) = svd_all([Delta((16, 3, 3, 3), dense=dense)])
    up, down = to_lora(svd, 5, (16, 3, 3, 3), scale=0.5)
    assert up.shape == (16, 5, 1, 1) and down.shape == (5, 3, 3, 3)
    approx = 0.5 * up.reshape(16, 5) @ down.reshape(5, -1)
    s = torch.linalg.svdvals(dense)
    # Eckart-Young: the error of the best rank-5 approximation is the norm of the dropped singular values
    assert float(torch.linalg.matrix_norm(dense - approx)) == pytest.approx(float(s[5:].norm()), rel=1e-4)
    torch.testing.assert_close(torch.linalg.svdvals(approx)[:5], s[:5], atol=1e-5, rtol=1e-5)


def test_sum_of_products_stays_an_exact_product():
    a = Delta((10, 6), up=_rand(10, 2, seed=1), down=_rand(2, 6, seed=2))
    b = Delta((10, 6, 1, 1), up=_rand(10, 3, seed=3), down=_rand(3, 6, seed=4))
    total = sum_deltas([a, b], [0.5, -2.0])
    assert total.factored and total.rank_bound == 5
    torch.testing.assert_close(total.matrix(), 0.5 * a.matrix() - 2.0 * b.matrix())
    mixed = sum_deltas([a, Delta((10, 6), dense=_rand(10, 6, seed=5))])
    assert not mixed.factored
    with pytest.raises(ValueError, match="different shapes"):
        sum_deltas([a, Delta((10, 7), dense=_rand(10, 7))])


# ------------------------------------------------------------------------------------------ rank rules by definition
def ratio_rank(S, p):
    return max(1, sum(1 for s in S if s > S[0] / p))


def cumulative_rank(S, p):
    total, acc = sum(S), 0.0
    for r, s in enumerate(S, start=1):
        acc += s
        if acc / total >= p:
            return r
    return len(S)


def fro_rank(S, p):
    total, acc = sum(s * s for s in S), 0.0
    for r, s in enumerate(S, start=1):
        acc += s * s
        if (acc / total) ** 0.5 >= p:
            return r
    return len(S)


@pytest.mark.parametrize("method,rule", [("sv_ratio", ratio_rank), ("sv_cumulative", cumulative_rank),
                                         ("sv_fro", fro_rank)])  # fmt: skip
@pytest.mark.parametrize("param", [0.3, 0.75, 0.93, 2.0, 10.0])
def test_dynamic_ranks_follow_their_definitions(method, rule, param):
    if method != "sv_ratio" and param > 1:
        param = 1 / param
    for seed in range(8):
        S = sorted((float(x) for x in torch.rand(12, generator=torch.Generator().manual_seed(seed)) ** 3),
                   reverse=True)  # fmt: skip
        assert dynamic_rank(torch.tensor(S), method, param) == rule(S, param), (seed, S)


def test_select_rank_caps_and_zero_matrix():
    S = torch.tensor([5.0, 3.0, 1.0, 0.5])
    assert select_rank(S, cap=2) == 2
    assert select_rank(S, cap=10) == 4  # never more than the singular values there are
    assert select_rank(S, cap=3, method="sv_ratio", param=100.0) == 3  # the cap wins
    assert select_rank(torch.zeros(4), cap=3) == 1  # sd-scripts: a zero matrix keeps rank 1


def test_quantile_and_clamp_match_torch_quantile():
    x = _rand(1000, seed=7)
    for q in (0.5, 0.9, 0.99, 1.0):
        torch.testing.assert_close(quantile(x, q), torch.quantile(x, q))
    up, down = _rand(30, 4, seed=8), _rand(4, 20, seed=9)
    cu, cd = clamp_factors(up, down, 0.9)
    hi = torch.quantile(torch.cat([up.flatten(), down.flatten()]), 0.9)
    assert float(cu.abs().max()) <= float(hi) + 1e-6 and float(cd.abs().max()) <= float(hi) + 1e-6
    assert clamp_factors(up, down, 1.0)[0] is up
