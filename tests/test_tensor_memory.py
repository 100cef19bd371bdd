"""library/measure/tensor_memory.py: live and peak tensor bytes, checked against byte counts worked out by hand."""

from __future__ import annotations

import pytest
import torch

from library.measure.tensor_memory import TensorMemory

KIB256 = 256 * 256 * 4  # one 256 x 256 float32 matrix


def test_new_storages_count_once_and_leave_when_freed():
    kept = torch.ones(256, 256)  # alive before: part of the baseline
    with TensorMemory() as mem:
        base = mem.live_bytes["cpu"]
        assert mem.baseline_bytes["cpu"] == base >= KIB256
        a = torch.randn(256, 256)
        b = a @ kept
        view = b[::2].t()  # a view: no new storage
        c = b.relu()
        assert mem.live_bytes["cpu"] == base + 3 * KIB256
        del b, view
        assert mem.live_bytes["cpu"] == base + 2 * KIB256
        a.add_(1)  # in place: nothing new
        del a, c
        assert mem.live_bytes["cpu"] == base
        assert mem.peak_bytes["cpu"] == base + 3 * KIB256
        mem.reset_peak()
        assert mem.peak_bytes["cpu"] == base
    assert mem.report()["above_baseline_mib"] == 0.0


def test_backward_saves_and_frees_activations():
    torch.manual_seed(0)
    w1 = torch.randn(256, 256, requires_grad=True)
    w2 = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256)
    with TensorMemory() as mem:
        base = mem.live_bytes["cpu"]
        loss = (x @ w1).relu().mm(w2).sum()
        # alive: x@w1 (saved by relu? relu saves its output), relu output (saved by mm), mm output freed by sum
        forward_live = mem.live_bytes["cpu"] - base
        loss.backward()
        del loss
        grads = w1.grad.nbytes + w2.grad.nbytes
        assert mem.live_bytes["cpu"] - base == grads  # the graph's saved tensors are gone, the gradients stay
        assert forward_live >= KIB256  # at least the relu output waits for backward
        assert mem.peak_bytes["cpu"] - base >= forward_live + KIB256  # plus a gradient being made


def test_module_weights_are_in_the_baseline():
    layer = torch.nn.Linear(512, 512)
    with TensorMemory() as mem:
        pass
    assert mem.baseline_bytes["cpu"] >= layer.weight.nbytes + layer.bias.nbytes
    del layer


@pytest.mark.gpu
def test_cuda_peak_matches_the_allocator():
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    # cuBLAS allocates its workspace through the caching allocator on first use: that is no tensor, so make it
    # exist before measuring
    (torch.randn(1024, 1024, device="cuda") @ w).square().sum().backward()
    w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with TensorMemory() as mem:
        loss = (torch.randn(1024, 1024, device="cuda") @ w).square().sum()
        loss.backward()
    torch.cuda.synchronize()
    counted = mem.peak_bytes["cuda"] - mem.baseline_bytes["cuda"]
    allocated = torch.cuda.max_memory_allocated() - before
    assert abs(counted - allocated) <= 0.05 * allocated + (1 << 20)  # allocator rounding and workspaces
