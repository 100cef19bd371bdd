"""library/measure/meta_outputs.py: operator outputs on meta answered by input signature.

Oracle: the operator's own meta kernel. A cached answer has the kernel's shape, strides, dtype and storage size
and a storage of its own; operators that alias or write their arguments are never answered from the cache; and a
small network's forward and backward on the simulated device counts the same device bytes after every operator
with the cache as with every kernel run.
"""

from __future__ import annotations

import torch

from library.measure import simulated_device as sim_device
from library.measure.meta_outputs import MetaOutputs
from library.measure.tensor_memory import tensors_in

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def describe(out):
    return [
        None if t is None else (t.shape, t.stride(), t.dtype, t.untyped_storage().nbytes()) for t in tensors_in(out)
    ]


def test_a_cached_answer_is_the_kernels_output_in_a_storage_of_its_own():
    q, k, v = meta(1, 2, 16, 8), meta(1, 2, 16, 8), meta(1, 2, 16, 8)
    x = meta(4, 8).t()  # non-contiguous input: the output strides follow it
    calls = [
        (aten.add.Tensor, (meta(4, 8, dtype=torch.int64), 1), {}),
        (aten.add.Tensor, (meta(4, 8, dtype=torch.int64), 1.5), {}),  # same value class, other type: float out
        (aten.mul.Tensor, (x, 2.0), {}),
        (aten.addmm.default, (meta(8), meta(4, 16), meta(16, 8)), {}),
        (aten.native_layer_norm.default, (meta(2, 5, 8), [8], meta(8), meta(8), 1e-5), {}),
        (aten.cat.default, ([meta(2, 3), meta(4, 3)],), {}),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, False), {"scale": None}),
        (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
    ]
    outputs = MetaOutputs()
    for func, args, kwargs in calls:
        tensors = tensors_in(args, kwargs)
        expected = describe(func(*args, **kwargs))
        first = outputs(func, args, kwargs, tensors)
        second = outputs(func, args, kwargs, tensors)
        assert describe(first) == describe(second) == expected, func
        storages = [t.untyped_storage()._cdata for t in tensors_in(first, second)]
        assert len(set(storages)) == len(storages)
    assert outputs.hits == len(calls) and outputs.runs == len(calls)
    assert outputs(aten.add.Tensor, (meta(4, 8, dtype=torch.int64), 1.5), {}, []).dtype == torch.float32


def test_views_and_writes_are_always_computed():
    outputs = MetaOutputs()
    x = meta(4, 8)
    for _ in range(2):
        view = outputs(aten.view.default, (x, [8, 4]), {}, [x])
        assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
        written = outputs(aten.add_.Tensor, (x, 1.0), {}, [x])
        assert written is x
    assert outputs.hits == 0 and outputs.recipes == {}


def _trace(monkeypatch, cached: bool) -> tuple[list[int], int]:
    """Device bytes after every operator of a small network's forward and backward on the simulated device."""
    if not cached:
        monkeypatch.setattr(sim_device, "_META_OUTPUTS", lambda func, args, kwargs, tensors: func(*args, **kwargs))
    trace: list[int] = []

    class Traced(sim_device.SimulatedDevice):
        def _dispatch(self, func, args, kwargs, tensors):
            out = super()._dispatch(func, args, kwargs, tensors)
            trace.append(self.live_bytes["meta"])
            return out

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU(), torch.nn.Flatten(2)
    )
    block = torch.nn.TransformerEncoderLayer(8, 2, 32, batch_first=True, norm_first=True)
    with Traced() as sim, sim_device.fused_attention():
        net.to("meta"), block.to("meta")
        for _ in range(2):  # the second round is answered from the cache when there is one
            x = torch.empty(2, 3, 8, 8, device="meta")
            loss = block(net(x).transpose(1, 2)).float().pow(2).mean()
            loss.backward()
            del x, loss
    return trace, sim.peak_bytes["meta"]


def test_the_simulated_device_counts_the_same_bytes_with_the_cache(monkeypatch):
    monkeypatch.setattr(sim_device, "_META_OUTPUTS", MetaOutputs())
    cache = sim_device._META_OUTPUTS
    with_cache = _trace(monkeypatch, cached=True)
    assert cache.hits > cache.runs  # the second round came from the cache
    assert with_cache == _trace(monkeypatch, cached=False)
