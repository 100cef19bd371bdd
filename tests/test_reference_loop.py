"""train_network.py against a plain diffusers + peft training loop, step by step (oracle: peft's LoRA layers,
diffusers' UNet and scheduler, ``F.mse_loss``, ``torch.optim.AdamW``, ``clip_grad_norm_``).

The loop is the one in benchmarks/compare_reference_lora.py (which measures learning and forgetting over seeds); here
it replays a short run of ours on the same draws from the same initial weights, and every adapter weight must agree
after every step. Alpha differs from the rank and the clip threshold is low enough to act, so the scale and the
clipping are part of what is compared; LoCon (conv_dim) covers the 3x3 convolutions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from library.demo import make_example_dataset

# At 64 px the mid block sees one latent pixel: its self-attention has one key, so the softmax is 1 and the gradients
# of to_q / to_k are exactly zero but for float noise, which Adam turns into lr-sized steps that differ between runs.
SINGLE_TOKEN = tuple(f"lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_{x}" for x in "qk")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_reference_lora.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("compare_reference_lora", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_steps_equal_a_plain_peft_loop(bench, tiny_dir, tmp_path):
    data = make_example_dataset(tmp_path / "data")
    a = SimpleNamespace(dim=4, alpha=2.0, lr=1e-2, steps=4, max_grad_norm=0.05,
                        ours_args=["--network_args", "conv_dim=4", "conv_alpha=2"])  # fmt: skip
    ours = bench.run_ours(tiny_dir / "sd1", data, tmp_path / "out", 0, a)
    ref = bench.run_reference(tiny_dir / "sd1", ours, a, "matched", 0)

    assert len(ours["steps"]) == len(ref["steps"]) == 4
    assert ours["grad_norms"][0] > a.max_grad_norm  # clipping acts
    kinds = {bench.group_of(n) for n in ours["targets"]}
    assert {"te", "unet attn1", "unet ff_net", "unet proj_in", "unet other"} <= kinds  # "other": ResNet convs
    assert set(ref["targets"]) == set(ours["targets"])
    for n in ours["targets"]:
        assert ref["scale"][n] == pytest.approx(ours["alpha"][n] / a.dim)
    worst, moved = 0.0, 0
    for step_ours, step_ref in zip(ours["steps"], ref["steps"]):
        for n in ours["targets"]:
            if n.startswith(SINGLE_TOKEN):
                continue
            w_ours = bench.delta_w(step_ours[n], ours["alpha"][n] / a.dim)
            w_ref = bench.delta_w(step_ref[n], ref["scale"][n])
            if w_ref.norm() > 0:
                moved += 1
                worst = max(worst, float((w_ours - w_ref).norm() / w_ref.norm()))
    assert moved > 0.9 * 4 * len(ours["targets"])  # the comparison is not of untouched weights
    # Adam turns float noise in a near-zero gradient element into up to one lr-sized step, so single elements may
    # differ; each module's ΔW as a whole must agree
    assert worst < 1e-3, worst
