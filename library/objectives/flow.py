"""Rectified flow (flow matching): the math every flow-matching family's objective shares (pure torch).

The forward process is the straight line between the clean latents and the noise (Liu et al. 2022, "Flow Straight
and Fast", arXiv:2209.03003; Esser et al. 2024, SD3, arXiv:2403.03206, section 2):

    x_σ = (1 - σ) x0 + σ ε,  σ in [0, 1];  target (velocity) = ε - x0.

What differs between families (how σ is drawn, which target and prediction type, which flags) is each family's own
objective module (``library/families/<family>/objective.py``); what they share is here: the shift of a σ draw
(:func:`shift_sigmas`), the discrete σ table of ``FlowMatchEulerDiscreteScheduler`` (:func:`sigma_table`), the
resolution-dependent time shift (:func:`time_shift`), the weighting densities of a unit draw (:func:`table_density`),
the noisy input with its input perturbation (:func:`noisy_input`), the velocity target, the prediction types, the
per-sample loss weighting (:func:`loss_weighting`), the loss itself (:func:`flow_loss`), the flags
(:func:`add_weighting_args`) and the checks of the DDPM-only flags flow matching does not read
(:func:`ignored_flags`, :func:`flow_problems`).

All randomness comes from one ``torch.Generator`` argument (``None``: torch's global RNG), drawn on its device in a
fixed order, so the same generator state gives the reference trainers' values on the same draws.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .base import Example
from .losses import LossConfig, check_shapes, huber_c_by_timestep, weighted_loss_per_sample
from .noising import NoiseConfig, draw_device

logger = logging.getLogger(__name__)

WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
NUM_TRAIN_TIMESTEPS = 1000  # FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000), as the reference trainers

# Flags the reference trainers read only on their DDPM path: their flow trainers accept them and change nothing
# (sd-scripts: noise = randn_like, post_process_loss returns the loss as is; min/max_timestep unread).
DDPM_ONLY_NOISE_FLAGS = ("noise_offset", "noise_offset_random_strength", "adaptive_noise_scale",
                         "multires_noise_iterations", "multires_noise_discount", "zero_terminal_snr",
                         "min_timestep", "max_timestep")  # fmt: skip
DDPM_ONLY_LOSS_FLAGS = ("min_snr_gamma", "v_pred_like_loss", "debiased_estimation_loss",
                        "scale_v_pred_loss_like_noise_pred")  # fmt: skip


class Weighting(Protocol):
    """The settings :func:`table_density` reads (a family's flow config)."""

    weighting_scheme: str
    logit_mean: float
    logit_std: float
    mode_scale: float


def add_weighting_args(group: Any, existing: set[str], law: str) -> None:
    """``--weighting_scheme --logit_mean --logit_std --mode_scale`` (sd-scripts' names and defaults) on ``group``;
    ``--logit_mean`` / ``--logit_std`` only where the parser has none yet (``existing``: its dests). ``law``: what
    the scheme decides besides the loss weight, for the help."""
    group.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES), help=law)
    for name, default in (("logit_mean", 0.0), ("logit_std", 1.0)):
        if name not in existing:
            group.add_argument(
                f"--{name}", type=float, default=default, help=f"--weighting_scheme logit_normal: {name}"
            )
    group.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's shift ``S σ / (1 + (S - 1) σ)`` (Esser et al. 2024, eq. 23; identity for S = 1)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_table(shift: float, n: int = NUM_TRAIN_TIMESTEPS) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)``, each (n,) float32, descending: the training table of sd-scripts'
    ``FlowMatchEulerDiscreteScheduler(n, shift)`` (and diffusers' of the same name): ``s_i = (n - i) / n``,
    ``σ_i = shift_sigmas(s_i)``, ``timestep_i = n σ_i``."""
    steps = torch.linspace(1, n, n, dtype=torch.float32).flip(0)
    sigmas = shift_sigmas(steps / n, shift)
    return sigmas, sigmas * n


def time_shift(mu: float, sigmas: Tensor) -> Tensor:
    """The resolution-dependent shift ``e^μ / (e^μ + 1/σ - 1)`` (FLUX.1's; BFL ``time_shift`` with exponent 1)."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


@dataclass(frozen=True)
class ShiftLine:
    """The μ of a resolution-dependent shift: linear through ``points`` ((length, μ), (length, μ)) in the sequence
    length (h // patch)(w // patch) of (h, w) latents (sd-scripts' ``get_lin_function``, musubi-tuner's ``flux_shift``
    and its kin)."""

    points: tuple[tuple[int, float], tuple[int, float]]
    patch: int = 2

    def mu(self, h: int, w: int) -> float:
        (x1, y1), (x2, y2) = self.points
        slope = (y2 - y1) / (x2 - x1)
        return slope * ((h // self.patch) * (w // self.patch)) + (y1 - slope * x1)


def table_density(cfg: Weighting, batch_size: int, generator: torch.Generator | None = None) -> Tensor:
    """Unit draws (B,) float32 by ``--weighting_scheme`` (sd-scripts
    ``compute_density_for_timestep_sampling``; SD3 section 3.1): logit_normal ``sigmoid(N(logit_mean,
    logit_std²))``; mode ``1 - u - mode_scale (cos²(πu/2) - 1 + u)``; otherwise ``u ~ U(0, 1)``."""
    device = draw_device(generator)
    if cfg.weighting_scheme == "logit_normal":
        z = torch.normal(cfg.logit_mean, cfg.logit_std, size=(batch_size,), generator=generator, device=device)
        return torch.sigmoid(z)
    u = torch.rand((batch_size,), generator=generator, device=device)
    if cfg.weighting_scheme == "mode":
        return 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def draw_noise_and_sigmas(
    latents: Tensor,
    generator: torch.Generator | None,
    timesteps: Tensor | None,
    sample: Callable[[int, torch.Generator | None, torch.device], tuple[Tensor, Tensor]],
) -> tuple[Tensor, Tensor, Tensor]:
    """The draws of a flow example, in this order: ε (float32, the latents' shape), then σ (B,) and the timesteps the
    family's ``predict`` gets, from ``sample(batch, generator, device)`` (the family's σ law), or, with ``timesteps``
    given (B,), σ = timesteps / 1000 for every sample and no σ draw. ``ValueError`` for latents that are not
    (B, C, H, W) or timesteps of another batch size."""
    if latents.ndim != 4:
        raise ValueError(f"latents must be (B, C, H, W), got shape {tuple(latents.shape)}")
    device, batch = latents.device, latents.shape[0]
    draw = draw_device(generator, device)
    noise = torch.randn(tuple(latents.shape), generator=generator, device=draw, dtype=torch.float32).to(device)
    if timesteps is None:
        sigmas, timesteps = sample(batch, generator, device)
    elif timesteps.shape != (batch,):
        raise ValueError(f"timesteps must have shape ({batch},), got {tuple(timesteps.shape)}")
    else:
        timesteps = timesteps.to(device, torch.float32)
        sigmas = timesteps / NUM_TRAIN_TIMESTEPS
    return noise, sigmas, timesteps


def noisy_input(
    latents: Tensor,
    noise: Tensor,
    sigmas: Tensor,
    generator: torch.Generator | None = None,
    *,
    ip_noise_gamma: float | None = None,
    ip_noise_gamma_random_strength: bool = False,
) -> Tensor:
    """``(1 - σ) x0 + σ (ε + γ ξ)`` (B, C, H, W) in float32, γ ξ the input perturbation (``--ip_noise_gamma``, Ning
    et al. 2023, arXiv:2301.11706; ξ drawn before γ, as sd-scripts' FLUX path); ``sigmas`` (B,)."""
    s = sigmas.to(latents.device, torch.float32).view((-1,) + (1,) * (latents.ndim - 1))
    noise = noise.float()
    if ip_noise_gamma:
        draw = draw_device(generator)
        xi = torch.randn(tuple(latents.shape), generator=generator, device=draw).to(latents.device)
        gamma = ip_noise_gamma
        if ip_noise_gamma_random_strength:
            gamma = torch.rand((1,), generator=generator, device=draw).to(latents.device) * ip_noise_gamma
        noise = noise + gamma * xi
    return (1.0 - s) * latents.float() + s * noise


def flow_target(latents: Tensor, noise: Tensor) -> Tensor:
    """The velocity ``ε - x0`` (B, C, H, W) float32 (the same for every ``--model_prediction_type``)."""
    return noise.float() - latents.float()


def apply_model_prediction_type(kind: str, output: Tensor, noisy: Tensor, sigmas: Tensor) -> Tensor:
    """What is compared with the target: raw ``o``, additive ``o + x_σ``, sigma_scaled ``x_σ - σ o`` (sd-scripts
    ``apply_model_prediction_type``); output and noisy (B, C, H, W), sigmas (B,)."""
    if kind == "raw":
        return output
    if kind == "additive":
        return output + noisy
    if kind == "sigma_scaled":
        s = sigmas.to(output.device, output.dtype).view((-1,) + (1,) * (output.ndim - 1))
        return output * (-s) + noisy
    raise ValueError(f"--model_prediction_type must be one of {', '.join(MODEL_PREDICTION_TYPES)}, got {kind!r}")


def loss_weighting(scheme: str, sigmas: Tensor) -> Tensor | None:
    """Per-sample loss weight (B,) float32 (sd-scripts ``compute_loss_weighting_for_sd3``, applied only with
    ``--model_prediction_type sigma_scaled``): sigma_sqrt ``σ^-2``; cosmap ``2 / (π (1 - 2σ + 2σ²))`` (SD3 section
    3.1); None (weight 1) for the others."""
    if scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return None


FLOW_METADATA = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling", "sigmoid_scale")


def flow_metadata(cfg: Any, *names: str) -> dict[str, Any]:
    """The reference trainers' objective metadata: ``ss_<name>`` of each setting of ``cfg``, in order."""
    return {f"ss_{name}": getattr(cfg, name) for name in names}


def choice_error(flag: str, value: str, choices: tuple[str, ...]) -> list[str]:
    """``["--flag must be one of ..."]`` when ``value`` is not one of ``choices``, else []."""
    return [] if value in choices else [f"--{flag} must be one of {', '.join(choices)}, got {value!r}"]


def weighting_problems(cfg: Weighting) -> list[str]:
    """The weighting settings' own checks: a known scheme, a positive finite logit_std, finite mean and scale."""
    errors = choice_error("weighting_scheme", cfg.weighting_scheme, WEIGHTING_SCHEMES)
    if not (cfg.logit_std > 0 and math.isfinite(cfg.logit_std)):
        errors.append(f"--logit_std must be a finite number > 0, got {cfg.logit_std}")
    for flag in ("logit_mean", "mode_scale"):
        if not math.isfinite(getattr(cfg, flag)):
            errors.append(f"--{flag} must be finite, got {getattr(cfg, flag)}")
    return errors


def flow_loss(loss: LossConfig, weights: Tensor | None, pred: Tensor, example: Example, loss_weights: Tensor | None,
              mask: Tensor | None, generator: torch.Generator | None) -> Tensor:  # fmt: skip
    """A flow objective's loss: ``--loss_type`` (huber schedules constant / exponential on the float timesteps, as
    sd-scripts), the objective's ``weights`` per element, mask, prior weights; no SNR weighting."""
    target = example.target.to(pred.device)
    check_shapes(pred, target, example.timesteps)
    huber_c = None
    if loss.loss_type in ("huber", "smooth_l1"):
        huber_c = huber_c_by_timestep(example.timesteps, loss, NUM_TRAIN_TIMESTEPS)
    return weighted_loss_per_sample(pred, target, loss, huber_c=huber_c, element_weights=weights,
                                    loss_weights=loss_weights, mask=mask, generator=generator)  # fmt: skip


def _changed(cfg: Any, names: tuple[str, ...]) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return [f"--{name}" for name in names if getattr(cfg, name) != defaults[name]]


def ignored_flags(noise: NoiseConfig, loss: LossConfig, noise_names: tuple[str, ...] = DDPM_ONLY_NOISE_FLAGS,
                  loss_names: tuple[str, ...] = DDPM_ONLY_LOSS_FLAGS) -> list[str]:  # fmt: skip
    """The flags among ``noise_names`` / ``loss_names`` given at other than their defaults (flow matching does not
    read them)."""
    return _changed(noise, noise_names) + _changed(loss, loss_names)


def warn_ignored(title: str, ignored: list[str]) -> None:
    """One warning naming the flags the objective ignores (as sd-scripts, which ignores them silently)."""
    if ignored:
        logger.warning("%s: flow matching ignores %s (as sd-scripts does); the run goes on without them", title,
                       ", ".join(ignored))  # fmt: skip


def flow_problems(title: str, noise: NoiseConfig, loss: LossConfig, shift_hint: str) -> list[str]:
    """What no flow objective trains with: ``--huber_schedule snr`` with a Huber loss (no DDPM SNR; sd-scripts
    raises too) and ``--timestep_shift`` (a shift of SD's DDPM timesteps; ``shift_hint``: the family's own flag)."""
    problems = []
    if loss.loss_type in ("huber", "smooth_l1") and loss.huber_schedule == "snr":
        problems.append(
            f"--loss_type {loss.loss_type} with --huber_schedule snr needs a DDPM schedule's SNR, which {title}'s "
            "flow-matching objective does not have; add --huber_schedule constant or exponential"
        )
    if noise.timestep_shift != 1.0:
        problems.append(f"--timestep_shift {noise.timestep_shift} shifts SD's DDPM timesteps; for flow matching use "
                        f"{shift_hint}")  # fmt: skip
    return problems
