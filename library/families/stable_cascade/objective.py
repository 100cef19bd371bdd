"""Stable Cascade stage C's training objective: the continuous-time cosine DDPM of Würstchen / Stable Cascade ("GDF"
in Stability's code), as sd-scripts' stable-cascade branch trains it (``stable_cascade_train_stage_c.py`` /
``stable_cascade_train_c_network.py``: ``GDF(CosineSchedule(clamp_range=[0.0001, 0.9999]), VPScaler(),
EpsilonTarget(), CosineTNoiseCond(), P2LossWeight())``); diffusers' ``DDPMWuerstchenScheduler`` is the same schedule.

For clean latents x0 (B, 16, h, w) and ε ~ N(0, I):

* t = clamp(1 − u + 0.001, 0.001, 1), u ~ U[0, 1) (the branch's and OneTrainer's draw);
* ᾱ(t) = clamp(cos²((t + s) / (1 + s) · π/2) / cos²(s / (1 + s) · π/2), 1e-4, 0.9999), s = 0.008;
* noisy = sqrt(ᾱ) x0 + sqrt(1 − ᾱ) ε, the target ε;
* the model reads the timestep ratio recovered from log SNR = log(ᾱ / (1 − ᾱ)) (``CosineTNoiseCond``: t itself except
  where the clamp of ᾱ acts, near t = 0.001 and t = 1; OneTrainer feeds t);
* the loss per sample is the mean squared error times P2's weight 1 / (1 + SNR) = 1 − ᾱ (the branch's default; its
  ``--adaptive_loss_weight`` keeps running per-log-SNR loss averages across steps, which this objective does not hold
  in its state: refused).

Every draw comes from the step's generator (noise first, then u), so resumed runs repeat the draws.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from library.objectives.base import EPSILON, NUM_VALIDATION_TIMESTEPS, Example
from library.objectives.losses import LossConfig, check_shapes, huber_c_by_timestep, weighted_loss_per_sample
from library.objectives.noising import NoiseConfig, draw_device, make_noise

S = 0.008
CLAMP = (1e-4, 0.9999)
T_MIN = 0.001
REFUSED_NOISE = {
    "zero_terminal_snr": "rescales a discrete DDPM schedule",
    "min_timestep": "bounds SD's integer timesteps (0-1000)",
    "max_timestep": "bounds SD's integer timesteps (0-1000)",
    "ip_noise_gamma": "is not part of the stage C trainers' objective",
}
REFUSED_LOSS = {
    "min_snr_gamma": "the loss already carries GDF's P2 weight 1 / (1 + SNR)",
    "debiased_estimation_loss": "the loss already carries GDF's P2 weight 1 / (1 + SNR)",
    "v_pred_like_loss": "stage C predicts ε only",
    "scale_v_pred_loss_like_noise_pred": "stage C predicts ε only",
}


def alpha_cumprod(t: Tensor) -> Tensor:
    """ᾱ(t) of the cosine schedule, clamped to [1e-4, 0.9999] (``DDPMWuerstchenScheduler._alpha_cumprod``)."""
    s = torch.tensor(S, dtype=t.dtype, device=t.device)
    start = torch.cos(s / (1 + s) * math.pi * 0.5) ** 2
    return (torch.cos((t + s) / (1 + s) * math.pi * 0.5) ** 2 / start).clamp(*CLAMP)


def ratio_of(alpha: Tensor) -> Tensor:
    """The timestep ratio whose cosine ᾱ is ``alpha`` (``CosineTNoiseCond`` on log SNR = logit ᾱ)."""
    s = torch.tensor(S, dtype=alpha.dtype, device=alpha.device)
    start = torch.cos(s / (1 + s) * math.pi * 0.5) ** 2
    return ((alpha * start) ** 0.5).acos() / (math.pi * 0.5) * (1 + s) - s


def draw_ratios(batch: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """t = clamp(1 − u + 0.001, 0.001, 1) (B,) float32, u ~ U[0, 1) from ``generator``."""
    u = torch.rand((batch,), generator=generator, device=draw_device(generator, device))
    return (1 - u).add(T_MIN).clamp(T_MIN, 1.0).to(device)


@dataclass(frozen=True, eq=False)
class CascadeObjective:
    """The stage C objective (module docstring); ``Example.timesteps`` are the ratios the prior reads (B,) float32,
    ``Example.sigmas`` ᾱ of each sample."""

    noise: NoiseConfig
    loss: LossConfig
    name: str = EPSILON
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> Example:  # fmt: skip
        noise = make_noise(self.noise, latents, generator)
        b = latents.shape[0]
        t = draw_ratios(b, generator, latents.device) if timesteps is None else timesteps.to(latents.device).float()
        alpha = alpha_cumprod(t.to(torch.float32))
        a = alpha.sqrt().view(b, 1, 1, 1)
        noisy = (a * latents.float() + (1 - alpha).sqrt().view(b, 1, 1, 1) * noise).to(latents.dtype)
        return Example(noisy, noise, ratio_of(alpha), noise, alpha)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        return output

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        """``--loss_type`` (Huber's c from 1000 t for the constant / exponential schedules), mask, prior weights, then
        P2's 1 − ᾱ per sample."""
        target = example.target.to(pred.device)
        check_shapes(pred, target, example.timesteps)
        huber = None
        if self.loss.loss_type in ("huber", "smooth_l1"):
            huber = huber_c_by_timestep(example.timesteps.to(pred.device) * 1000, self.loss, 1000)
        loss = weighted_loss_per_sample(pred, target, self.loss, huber_c=huber, loss_weights=loss_weights, mask=mask,
                                        generator=generator)  # fmt: skip
        return loss * (1 - example.sigmas.to(loss.device, torch.float32))

    def validation_timesteps(self) -> list[float]:
        """Ratios 0.2, 0.4, 0.6, 0.8 (the shared four fixed validation points on [0, 1])."""
        points = torch.linspace(0, 1, NUM_VALIDATION_TIMESTEPS + 2)[1:-1]
        return [round(float(v), 6) for v in points]

    def metadata(self) -> dict[str, Any]:
        return {"ss_loss_weighting": "p2", "ss_noise_schedule": "cosine_continuous"}

    def to(self, device: torch.device | str) -> CascadeObjective:
        return dataclasses.replace(self)


def cascade_problems(noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """The shared noise / loss flags the stage C objective cannot train with (before anything loads)."""
    problems = []
    if noise.timestep_sampling != "uniform":
        problems.append(f"--timestep_sampling {noise.timestep_sampling}: Stable Cascade draws its continuous "
                        "timestep uniformly (as sd-scripts' stable-cascade branch and OneTrainer); drop the flag")  # fmt: skip
    if noise.timestep_shift != 1.0:
        problems.append("--timestep_shift: Stable Cascade's cosine schedule has no shift here; drop the flag")
    if noise.v_parameterization or loss.v_parameterization:
        problems.append("--v_parameterization: Stable Cascade stage C predicts ε")
    for flag, why in REFUSED_NOISE.items():
        if getattr(noise, flag) not in (None, False):
            problems.append(f"--{flag} is not supported for Stable Cascade: it {why}; drop it")
    for flag, why in REFUSED_LOSS.items():
        if getattr(loss, flag) not in (None, False):
            problems.append(f"--{flag} is not supported for Stable Cascade: {why}; drop it")
    if loss.loss_type in ("huber", "smooth_l1") and loss.huber_schedule == "snr":
        problems.append(f"--loss_type {loss.loss_type} with --huber_schedule snr needs a discrete DDPM schedule; add "
                        "--huber_schedule constant or exponential")  # fmt: skip
    return problems


def cascade_objective(noise: NoiseConfig, loss: LossConfig) -> CascadeObjective:
    return CascadeObjective(noise, loss)
