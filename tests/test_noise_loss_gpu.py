"""On a CUDA device, noising and losses give the CPU's results: the draws come from the generator's device."""

from __future__ import annotations

import pytest
import torch

from library.objectives.losses import LossConfig, diffusion_loss_per_sample
from library.objectives.noising import NoiseConfig, NoiseSchedule, make_example

pytestmark = pytest.mark.gpu

SCHEDULE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
NOISE = NoiseConfig(
    noise_offset=0.1,
    noise_offset_random_strength=True,
    adaptive_noise_scale=0.05,
    multires_noise_iterations=6,
    ip_noise_gamma=0.1,
    timestep_sampling="logit_normal",
    timestep_shift=2.0,
    v_parameterization=True,
)
LOSS = LossConfig(
    loss_type="huber",
    min_snr_gamma=5.0,
    v_parameterization=True,
    unmasked_probability=0.5,
    unmasked_weight=0.1,
    normalize_masked_area_loss=True,
)


def run(device: str, generator_device: str, dtype: torch.dtype = torch.float32):
    schedule = NoiseSchedule.from_config(SCHEDULE, zero_terminal_snr=True)
    latents = torch.randn(4, 4, 32, 24, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    mask = (torch.rand(4, 1, 256, 192, generator=torch.Generator().manual_seed(1)) > 0.5).float().to(device)
    g = torch.Generator(device=generator_device).manual_seed(3)
    example = make_example(NOISE, latents, schedule, g)
    pred = example.target + 0.1 * torch.randn(example.target.shape, generator=g, device=generator_device).to(device)
    loss = diffusion_loss_per_sample(pred, example.target, example.timesteps, LOSS, schedule, mask=mask, generator=g)
    return example, loss


def test_cuda_with_cpu_generator_repeats_the_cpu_run():
    cpu_example, cpu_loss = run("cpu", "cpu")
    gpu_example, gpu_loss = run("cuda", "cpu")
    for a, b in zip(cpu_example, gpu_example):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, atol=1e-5, rtol=1e-5)


def test_cuda_generator_and_bf16_latents():
    example, loss = run("cuda", "cuda", torch.bfloat16)
    assert example.noisy.dtype == torch.bfloat16 and example.target.dtype == torch.float32
    assert all(t.device.type == "cuda" for t in (*example, loss))
    assert torch.isfinite(loss).all() and loss.shape == (4,)
