"""library/device/fp8.py: float8 storage of frozen Linear / Conv2d weights, computed in the compute dtype.

Oracle: the same layers holding the float8-rounded weights in the compute dtype, without any hook: outputs and
gradients are equal bit for bit, whether autograd keeps the compute copy or a note to cast it again, and with
gradient checkpointing. The note path holds no compute copy between forward and backward (tensor bytes counted).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from library.device.fp8 import compute_weight, store_in_fp8, stored_in_fp8
from library.measure.tensor_memory import TensorMemory

BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.proj = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))  # trained: the gradient's path runs through both layers

    def forward(self, x):
        h = self.norm(self.conv(x)).permute(0, 2, 3, 1)
        return (self.proj(h) * self.scale).sum()


def models(scaled: bool = False):
    torch.manual_seed(0)
    reference = Block().to(BF16).requires_grad_(False)
    reference.scale.requires_grad_(True)
    stored = copy.deepcopy(reference)
    assert store_in_fp8(stored, BF16, scaled=scaled) == 2  # the conv and the linear layer; the norm is skipped by name
    for name in ("conv", "proj"):  # the reference holds the same (float8-rounded, scaled back) values in bf16
        layer = getattr(stored, name)
        scale = layer._sdtrain_fp8.scale
        getattr(reference, name).weight.data = layer.weight.data.to(BF16) * (1.0 if scale is None else scale)
    return reference, stored


def grads(model, x, ckpt=False):
    x = x.clone().requires_grad_(True)
    out = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
    out.backward()
    return out.detach(), x.grad, model.scale.grad


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("outer_hooks", [False, True])
def test_outputs_and_gradients_equal_the_rounded_weights_in_bf16(ckpt, outer_hooks, scaled):
    reference, stored = models(scaled)
    x = torch.randn(2, 8, 6, 6, dtype=BF16)
    expected = grads(reference, x, ckpt)
    if outer_hooks:  # someone else's saved-tensor hooks: the layers keep their copies instead of notes
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            got = grads(stored, x, ckpt)
    else:
        got = grads(stored, x, ckpt)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert stored.conv.weight.dtype == torch.float8_e4m3fn and stored.proj.weight.dtype == torch.float8_e4m3fn
    assert stored.norm.weight.dtype == BF16 and stored.conv.bias.dtype == BF16
    assert stored_in_fp8(stored.conv) and not stored_in_fp8(stored.norm)
    assert torch.equal(compute_weight(stored.conv), reference.conv.weight)


def test_backward_keeps_notes_not_copies():
    """Between forward and backward the recast path holds no compute-dtype weight; the copy path holds both."""
    _, stored = models()
    stored.conv = nn.Conv2d(8, 256, 3, padding=1).to(BF16).requires_grad_(False)  # a weight that dominates
    stored.norm, stored.proj = nn.GroupNorm(4, 256).to(BF16), nn.Linear(256, 16).to(BF16).requires_grad_(False)
    store_in_fp8(stored, BF16)
    x = torch.randn(1, 8, 4, 4, dtype=BF16, requires_grad=True)
    weight_bytes = stored.conv.weight.numel() * 2  # its bf16 copy

    def held_after_forward(outer: bool) -> int:
        with TensorMemory() as mem:
            base = mem.live_bytes["cpu"]
            if outer:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    out = stored(x)
            else:
                out = stored(x)
            held = mem.live_bytes["cpu"] - base
            out.backward()
        return held

    copies, notes = held_after_forward(True), held_after_forward(False)
    assert copies - notes >= weight_bytes


def test_trained_and_embedding_weights_stay_as_they_are():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].weight.requires_grad_(True)
    model[1].requires_grad_(False)
    assert store_in_fp8(model, BF16) == 1
    assert model[0].weight.dtype == torch.float32 and model[2].weight.dtype == torch.float32
    assert model[1].weight.dtype == torch.float8_e4m3fn
    assert store_in_fp8(model, BF16) == 0  # stored once


def test_t5_keeps_wo_as_transformers_says_and_runs_in_bf16():
    """T5's feed-forward casts its input to ``wo.weight.dtype`` before calling ``wo`` (transformers keeps ``wo`` out
    of 8-bit storage, ``_keep_in_fp32_modules``): ``wo`` stays as it is, every other Linear is stored in float8, and
    the output equals the same encoder with those weights rounded through float8, in bf16."""
    from library.families.flux.tiny import tiny_t5

    t5 = tiny_t5().eval().to(torch.bfloat16).requires_grad_(False)
    rounded = copy.deepcopy(t5)
    for name, module in rounded.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(".wo"):
            module.weight.data = module.weight.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    store_in_fp8(t5, torch.bfloat16)
    linears = {name: m for name, m in t5.named_modules() if isinstance(m, nn.Linear)}
    assert all(stored_in_fp8(m) != name.endswith(".wo") for name, m in linears.items())
    ids = torch.tensor([[3, 7, 11, 1]])
    with torch.no_grad():
        torch.testing.assert_close(t5(ids).last_hidden_state, rounded(ids).last_hidden_state, rtol=0, atol=0)


def test_scaled_storage_keeps_small_weights_that_plain_casting_loses():
    """--fp8_scaled: a weight of small magnitude (std 1e-3; e4m3fn's smallest normal is 2^-6) keeps ~3 significant
    bits per value with a scale, where plain casting rounds most values to subnormals or zero."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64) * 1e-3
    errors = {}
    for scaled in (False, True):
        layer = nn.Linear(64, 64, bias=False).requires_grad_(False)
        layer.weight.data = weight.clone()
        store_in_fp8(layer, torch.float32, skip=(), scaled=scaled)
        errors[scaled] = ((compute_weight(layer) - weight).norm() / weight.norm()).item()
    assert errors[True] < 0.05 < errors[False]
