"""library/run/block_swap.py: ``--blocks_to_swap`` and ``--cpu_offload_checkpointing`` on a tiny diffusers FLUX transformer.

Oracles:
* sd-scripts' split of N between FLUX's double and single blocks (``FluxModel.enable_block_swap``, re-typed here):
  ``N // 2`` double, ``(N - N // 2) * 2`` single, each list keeping two blocks (N <= 35 at the real size);
* the same LoRA-style training step without swapping: loss and every gradient equal bit for bit (the CPU is the
  device), with and without gradient checkpointing, offloaded checkpointing and float8 storage. Each device copy a
  block leaves is zeroed as it leaves ("poisoned"), so a gradient computed from a copy that should have gone differs;
  the same test without the saved-weight notes does differ (the oracle can fail);
* on the simulated device (meta, library/measure/simulated_device.py): the device-tensor peak of a step falls by the
  swapped blocks' bytes less the two blocks in flight, and offloaded checkpointing lowers it below plain
  checkpointing.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

import library.run.block_swap as block_swap
from library.cli.problems import ConfigError
from library.families.base import BlockList
from library.run.block_swap import (
    BlockSwap,
    BlockSwapConfig,
    add_block_swap_args,
    max_blocks_to_swap,
    offloaded_checkpoint,
    split_blocks_to_swap,
)


class Adapted(nn.Module):
    """A LoRA-style adapter on a frozen Linear: ``base(x) + up(down(x))`` with trained ``down`` / ``up``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(base.in_features * 7 + base.out_features)
        self.down = nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.down.t()) @ self.up.t()


def tiny_flux(width_heads: int = 2, seed: int = 0) -> nn.Module:
    """DIT_FAMILIES.md §4's tiny FLUX.1 dev (4 double, 4 single blocks), frozen, with adapters on q, v, proj_out and
    proj_mlp of every block."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=4, num_single_layers=4,
                                   attention_head_dim=16, num_attention_heads=width_heads, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip
    model.requires_grad_(False)
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for block in blocks:
            for name, module in list(block.named_modules()):
                if name.endswith(("to_q", "to_v", "proj_out", "proj_mlp")) and isinstance(module, nn.Linear):
                    parent, _, leaf = name.rpartition(".")
                    setattr(block.get_submodule(parent) if parent else block, leaf, Adapted(module))
    return model.train()


def flux_lists(model: nn.Module) -> list[BlockList]:
    """What the FLUX family's ``swap_blocks`` returns: double blocks 1 per unit, single blocks 2 per unit."""
    return [BlockList(model.transformer_blocks, 1), BlockList(model.single_transformer_blocks, 2)]


def inputs(device: str = "cpu", image_tokens: int = 16, text_tokens: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    made = dict(hidden_states=torch.randn(1, image_tokens, 4, generator=g),
                encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                guidance=torch.tensor([3.5]), img_ids=torch.zeros(image_tokens, 3), txt_ids=torch.zeros(text_tokens, 3))  # fmt: skip
    return {k: v.to(device) for k, v in made.items()}


def train_step(swap: int = 0, checkpointing: bool = False, offload: bool = False, fp8: bool = False):
    """One forward + backward of the adapted tiny FLUX on the CPU: (loss, {name: grad}, the BlockSwap or None)."""
    model = tiny_flux()
    if fp8:
        from library.device.fp8 import store_in_fp8

        store_in_fp8(model, torch.float32)
    if checkpointing:
        model.enable_gradient_checkpointing(offloaded_checkpoint if offload else None)
    swapper = None
    if swap:
        swapper = BlockSwap(flux_lists(model), swap, "cpu")
        swapper.place(model)
    loss = model(**inputs()).sample.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, swapper


@pytest.fixture
def poisoned(monkeypatch):
    """Every device copy a swapped block leaves is zeroed: a later read of it would give wrong gradients."""
    evict = block_swap._Swapped.evict

    def zeroing(self):
        left = [p.data for p in self.params] if self.resident else []
        evict(self)
        with torch.no_grad():
            for t in left:
                t.zero_()

    monkeypatch.setattr(block_swap._Swapped, "evict", zeroing)


def assert_on_host(swapper: BlockSwap) -> None:
    for s in swapper.swapped:
        assert not s.resident and s.pending is None
        assert all(p.data.data_ptr() == h.data_ptr() for p, h in zip(s.params, s.host))


# ------------------------------------------------------------------------------------------------ the split
def sd_scripts_split(n: int, num_double: int = 19, num_single: int = 38) -> tuple[int, int] | None:
    """flux_models.py ``FluxModel.enable_block_swap`` (v0.10.1), re-typed: None where its assert fails."""
    double_blocks_to_swap = n // 2
    single_blocks_to_swap = (n - double_blocks_to_swap) * 2
    if double_blocks_to_swap > num_double - 2 or single_blocks_to_swap > num_single - 2:
        return None
    return double_blocks_to_swap, single_blocks_to_swap


def test_split_of_n_is_sd_scripts_flux_split():
    lists = [BlockList(nn.ModuleList(nn.Identity() for _ in range(19)), 1),
             BlockList(nn.ModuleList(nn.Identity() for _ in range(38)), 2)]  # fmt: skip
    for n in range(0, 40):
        expected = sd_scripts_split(n)
        if expected is None:
            with pytest.raises(ValueError, match="at most 35"):
                split_blocks_to_swap(n, lists)
        else:
            assert tuple(split_blocks_to_swap(n, lists)) == expected
    assert max_blocks_to_swap(lists) == 35
    one = [BlockList(nn.ModuleList(nn.Identity() for _ in range(24)))]  # one list (SD3's joint blocks): N blocks
    assert split_blocks_to_swap(22, one) == [22] and max_blocks_to_swap(one) == 22


# ------------------------------------------------------------------------------------------------ exactness
@pytest.fixture(scope="module")
def reference():
    return train_step()


@pytest.mark.parametrize(
    "options",
    [
        dict(swap=1),
        dict(swap=2),
        dict(swap=2, checkpointing=True),
        dict(checkpointing=True, offload=True),
        dict(swap=2, checkpointing=True, offload=True),
    ],  # fmt: skip
    ids=["swap1", "swap2", "swap2-checkpointing", "offloaded-checkpointing", "swap2-offloaded"],
)
def test_a_swapped_step_equals_the_plain_step(reference, options, poisoned):
    ref_loss, ref_grads, _ = reference
    loss, grads, swapper = train_step(**options)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 48  # 24 adapters: 4 per double block, 2 per single
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    if swapper is not None:
        n = len(swapper.swapped)
        assert n == sum(split_blocks_to_swap(options["swap"], flux_lists(tiny_flux())))
        assert swapper.moves_in == swapper.moves_out == 2 * n  # in and out for the forward, again for the backward
        assert_on_host(swapper)


def test_float8_weights_survive_the_moves(poisoned):
    """--fp8_base storage: the swapped weights stay float8 on the host, and the step equals the unswapped one."""
    ref_loss, ref_grads, _ = train_step(fp8=True)
    for checkpointing in (False, True):
        loss, grads, swapper = train_step(swap=2, checkpointing=checkpointing, fp8=True)
        assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
        dtypes = {h.dtype for s in swapper.swapped for h in s.host}
        assert torch.float8_e4m3fn in dtypes
        assert_on_host(swapper)


def test_without_the_saved_weight_notes_the_poisoned_step_differs(reference, poisoned, monkeypatch):
    """The oracle can fail: autograd's own saved views of the device weights read the zeroed copies."""
    monkeypatch.setattr(block_swap._NotePack, "__call__", lambda self, tensor: tensor)
    _, ref_grads, _ = reference
    _, grads, _ = train_step(swap=2)
    assert any(not torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_blocks_go_back_to_the_host_after_an_exception(reference):
    model = tiny_flux()
    swapper = BlockSwap(flux_lists(model), 2, "cpu")
    swapper.place(model)
    failing = swapper.swapped[1].block  # the second swapped block: the first is resident, the next one fetched

    def fail(module, args, kwargs):
        raise RuntimeError("out of memory (simulated)")

    handle = failing.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(RuntimeError, match="simulated"):
        model(**inputs())
    assert swapper.moves_in == 2 and swapper.moves_out == 2  # the first and the failing block came in and left
    assert_on_host(swapper)  # and the fetch of the block after the failing one was dropped
    handle.remove()
    loss = model(**inputs()).sample.square().mean()
    loss.backward()
    assert torch.equal(loss.detach(), reference[0])
    assert_on_host(swapper)


def test_adapters_stay_on_the_device_and_buffers_move():
    """Only the weights frozen when swapping is set up move: adapter tensors and buffers are on the device."""
    model = tiny_flux()
    swapper = BlockSwap(flux_lists(model), 2, "meta")
    swapper.place(model)
    swapped = {id(p) for s in swapper.swapped for p in s.params}
    for name, p in model.named_parameters():
        expected = "cpu" if id(p) in swapped else "meta"
        assert p.device.type == expected, name
        assert not (p.requires_grad and id(p) in swapped), name
    assert all(b.device.type == "meta" for b in model.buffers())
    assert swapper.host_bytes == sum(p.numel() * p.element_size() for s in swapper.swapped for p in s.params)
    objects = [id(p) for p in model.parameters()]
    swapper.remove()  # hooks off, every weight on the device, in the same Parameter objects
    assert {p.device.type for p in model.parameters()} == {"meta"} and not swapper.swapped
    assert [id(p) for p in model.parameters()] == objects


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trained_swapped_weights_keep_their_post_accumulate_grad_hooks_on_meta(checkpointing):
    """A full fine-tune on the simulated device (meta): the swapped weights, trained after placing, move between the
    CPU and meta by ``swap_tensors``; ``--fused_backward_pass``'s hooks (library/optim/fused.py) must still fire for
    each of them, or their gradients all stay on the device (the FLUX fine-tune bench's step read 23.82 GiB at
    ``--blocks_to_swap 18`` for that reason)."""
    model = tiny_flux()
    if checkpointing:
        model.enable_gradient_checkpointing()
    swapper = BlockSwap(flux_lists(model), 2, "meta")
    swapper.place(model)
    swapped = {id(p) for s in swapper.swapped for p in s.params}
    model.requires_grad_(True)  # the trainer turns autograd on after placing (flux_train.py)
    fired: dict[int, int] = {}

    def step(p: nn.Parameter) -> None:  # what FusedStep does per parameter: step, then drop the gradient
        fired[id(p)] = fired.get(id(p), 0) + 1
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    for _ in range(2):  # the second step starts from parameters that have moved back and forth
        fired.clear()
        model(**inputs("meta")).sample.square().mean().backward()
        left = [n for n, p in model.named_parameters() if p.grad is not None]
        assert not left, f"gradients left after the fused steps: {left[:4]}"
        assert swapped and all(fired.get(i) == 1 for i in swapped)
        assert len(fired) == sum(1 for _ in model.parameters())


# ------------------------------------------------------------------------------------------------ device bytes
def fused_attention(monkeypatch) -> None:
    """On meta, count SDPA as the fused kernel a GPU runs, as benchmarks/bench_device_memory.py does (torch's math
    path would hold the 4608² attention matrix, which no GPU run holds)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)  # fmt: skip
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)


def device_peak(swap: int, offload: bool = False) -> dict:
    """One checkpointed step of the tiny FLUX at width 256 with 1024 px's sequence (4096 image + 512 text tokens:
    nothing is computed on meta) on the simulated device: the peak device (meta) bytes, and with swapping the host
    bytes, the two largest swapped blocks' bytes and whether every swapped block ended on the host. Only numbers
    are kept, so no meta tensor outlives the measurement."""
    import gc

    from library.measure.simulated_device import SimulatedDevice

    gc.collect()  # the previous measurement's meta tensors are not counted in this one
    model = tiny_flux(width_heads=16)
    model.enable_gradient_checkpointing(offloaded_checkpoint if offload else None)
    with SimulatedDevice() as sim:
        swapper = None
        if swap:
            swapper = BlockSwap(flux_lists(model), swap, "meta")
            swapper.place(model)
        else:
            model.to("meta")
        batch = inputs("meta", image_tokens=4096, text_tokens=512)
        sim.reset_peak()
        model(**batch).sample.square().mean().backward()
        # (less what was on meta before: under pytest an earlier measurement's model may not be collected yet)
        out = {"peak": sim.peak_bytes["meta"] - sim.baseline_bytes.get("meta", 0)}
    if swapper is not None:
        out["host"] = swapper.host_bytes
        out["in_flight"] = sum(sorted(s.nbytes for s in swapper.swapped)[-2:])
        out["on_host"] = all(not s.resident and s.pending is None for s in swapper.swapped)
    return out


@pytest.fixture(scope="module")
def peaks():
    """The device peaks of three checkpointed steps: plain, 2 blocks swapped, offloaded checkpointing."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        fused_attention(monkeypatch)
        return {"plain": device_peak(0), "swap": device_peak(2), "offload": device_peak(0, offload=True)}


def test_swapping_lowers_the_device_peak_by_the_swapped_blocks(peaks):
    plain, swapped = peaks["plain"], peaks["swap"]
    saved = plain["peak"] - swapped["peak"]
    # the swapped blocks leave the device, less at most two in flight (the running block and the next one)
    assert swapped["host"] - swapped["in_flight"] <= saved <= swapped["host"]
    assert saved > 0 and swapped["on_host"]


def test_offloaded_checkpointing_lowers_the_device_peak(peaks):
    checkpointed, offloaded = peaks["plain"]["peak"], peaks["offload"]["peak"]
    # the checkpointed inputs of the 7 blocks after the first (each (1, 4608, 256) float32) are on the host, less the
    # one a recompute copies back
    assert checkpointed - offloaded >= 6 * 4608 * 256 * 4


# ------------------------------------------------------------------------------------------------ flags
def test_flags_read_and_refused():
    parser = argparse.ArgumentParser()
    add_block_swap_args(parser)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    cfg = BlockSwapConfig.from_args(parser.parse_args(["--blocks_to_swap", "16", "--cpu_offload_checkpointing"]))
    assert cfg == BlockSwapConfig(16, True) and cfg.swaps
    assert not BlockSwapConfig.from_args(parser.parse_args([])).swaps
    with pytest.raises(ConfigError, match="--blocks_to_swap must be >= 0"):
        BlockSwapConfig.from_args(parser.parse_args(["--blocks_to_swap", "-1"]))


def test_sd_scripts_refuse_blocks_to_swap_with_a_reason():
    """SD1/SD2/SDXL: the flag is refused before anything loads, saying it is for FLUX / SD3; the family has no lists,
    and placing an SD UNet with swapping fails the same way."""
    import train_network
    from library.cli.parse import parse_args
    from library.families.sd import SD1
    from library.run.setup import place_denoiser

    with pytest.raises(ConfigError, match="--blocks_to_swap.*FLUX / SD3"):
        parse_args(train_network.build_parser(), ["--blocks_to_swap", "4"])
    assert SD1.swap_blocks(nn.Module()) == []
    with pytest.raises(ConfigError, match="no transformer block lists.*FLUX and SD3"):
        place_denoiser(nn.Linear(2, 2), SD1, BlockSwapConfig(4), torch.device("cpu"))


def test_place_denoiser_swaps_the_family_lists():
    """The run's placement hook asks the family for its lists and keeps the last blocks on the host."""
    from types import SimpleNamespace

    from library.run.setup import place_denoiser

    family = SimpleNamespace(swap_blocks=flux_lists, spec=SimpleNamespace(title="FLUX.1"))
    model = tiny_flux()
    swapper = place_denoiser(model, family, BlockSwapConfig(2), torch.device("meta"))
    assert swapper.counts == [1, 2]  # the most this tiny model allows: 1 of 4 double, 2 of 4 single blocks
    assert next(model.x_embedder.parameters()).device.type == "meta"
    assert {p.device.type for p in model.single_transformer_blocks[-1].parameters() if not p.requires_grad} == {"cpu"}
    assert {p.device.type for p in model.single_transformer_blocks[0].parameters()} == {"meta"}
    with pytest.raises(ConfigError, match="at most 2"):
        place_denoiser(tiny_flux(), family, BlockSwapConfig(3), torch.device("meta"))


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_swapping_is_asynchronous_exact_and_lighter():
    """On a GPU: pinned host copies, side-stream copies one block ahead, the same loss and gradients as without
    swapping, and a lower ``max_memory_allocated`` (the tiny model at width 512, where weights dominate)."""

    def run(swap: int):
        model = tiny_flux(width_heads=32)
        model.enable_gradient_checkpointing()
        torch.cuda.empty_cache()
        swapper = None
        if swap:
            swapper = BlockSwap(flux_lists(model), swap, "cuda")
            swapper.place(model)
        else:
            model.to("cuda")
        batch = inputs("cuda", image_tokens=256, text_tokens=32)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = model(**batch).sample.square().mean()
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), grads, torch.cuda.max_memory_allocated(), swapper

    ref_loss, ref_grads, ref_peak, _ = run(0)
    loss, grads, peak, swapper = run(2)
    assert swapper.stream is not None and all(h.is_pinned() for s in swapper.swapped for h in s.host)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7)
    assert peak < ref_peak
    assert_on_host(swapper)


def test_read_config_checks_n_against_the_released_architecture():
    """Before loading: the family's lists of its released architecture (``reference_parts``) decide."""
    from types import SimpleNamespace

    from library.families.sd import SD1
    from library.run.config import block_swap_problems

    assert block_swap_problems(SD1, BlockSwapConfig()) == []  # no flag: the architecture is not even built
    assert "FLUX and SD3" in block_swap_problems(SD1, BlockSwapConfig(4))[0]
    family = SimpleNamespace(swap_blocks=flux_lists, spec=SimpleNamespace(title="FLUX.1"),
                             reference_parts=lambda: SimpleNamespace(denoiser=tiny_flux()))  # fmt: skip
    assert block_swap_problems(family, BlockSwapConfig(2)) == []
    assert "at most 2 can be swapped" in block_swap_problems(family, BlockSwapConfig(3))[0]
