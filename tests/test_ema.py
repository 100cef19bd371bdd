"""EMA against a direct recurrence, interval handling, swap-in, and resume."""

import pytest
import torch

from library.run.ema import EMA


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


def test_matches_direct_recurrence_with_interval():
    params = _params()
    ema = EMA(params, decay=0.9, update_every=2, warmup=True)
    expected = [p.detach().clone() for p in params]
    n = 0
    for step in range(1, 11):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        updated = ema.update(step)
        assert updated == (step % 2 == 0)
        if updated:
            d = min(0.9**2, (1 + n) / (10 + n))
            expected = [e * d + p.detach() * (1 - d) for e, p in zip(expected, params)]
            n += 1
    for s, e in zip(ema.shadow, expected):
        torch.testing.assert_close(s, e, rtol=0, atol=1e-6)


def test_applied_swaps_and_restores():
    params = _params()
    ema = EMA(params, decay=0.5, warmup=False)
    with torch.no_grad():
        params[0].add_(1.0)
    ema.update(1)
    live = params[0].detach().clone()
    with ema.applied():
        torch.testing.assert_close(params[0].detach(), ema.shadow[0])
        assert not torch.equal(params[0].detach(), live)
    torch.testing.assert_close(params[0].detach(), live)


def test_state_round_trip_and_errors():
    params = _params()
    ema = EMA(params, device="cpu")
    ema.update(1)
    other = EMA(_params())
    other.load_state_dict(ema.state_dict())
    assert other.num_updates == 1 and all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow))
    with pytest.raises(ValueError, match="shape"):
        EMA([torch.nn.Parameter(torch.zeros(2, 3)), params[1]]).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="--ema_decay"):
        EMA(params, decay=1.0)
