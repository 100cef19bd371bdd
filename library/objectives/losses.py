"""Diffusion training losses: per-element loss, masks, prior weights and SNR weightings (pure torch).

Order, as sd-scripts' ``train_network.py: NetworkTrainer.process_batch / post_process_loss``, in
:func:`diffusion_loss_per_sample`:

1. per-element loss in float32 (``--loss_type`` l2 / l1 / huber / smooth_l1 with ``--huber_schedule``);
2. mask (``--masked_loss`` / alpha masks), area-resized to the latent size, with OneTrainer's options;
3. mean over C, H, W -> one value per sample;
4. per-sample weights (``--prior_loss_weight`` for regularisation images);
5. ``--min_snr_gamma``; 6. ``--scale_v_pred_loss_like_noise_pred``; 7. ``--v_pred_like_loss``;
8. ``--debiased_estimation_loss``; the training loss is the batch mean of that.

Where this differs from sd-scripts (on purpose): sd-scripts computes its SNR table *before* the
``--zero_terminal_snr`` rescale, so every SNR weighting uses the original schedule while the model trains on the
rescaled one. Here the SNR always comes from the schedule actually used (``schedule.snr``), and on a schedule that
reaches SNR = 0 (zero-terminal SNR) the clamped ``SNR' = clamp(SNR, 1e-3, 1e3)`` keeps every weight finite. Any
other schedule takes sd-scripts' (and OneTrainer's) ``SNR' = min(SNR, 1000)`` with no lower bound, so the weights
equal theirs exactly: SD's scaled-linear schedules never go below SNR 0.0047, but PixArt's linear one reaches
4e-5 at t = 999, where a lower bound at 1e-3 would cut the debiased weight five-fold (:func:`snr_floor`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from library.cli.problems import ConfigError

if TYPE_CHECKING:  # type hints only: losses.py needs ``alphas_cumprod``, ``snr(t)`` and ``reaches_zero_snr``
    from library.objectives.noising import NoiseSchedule

LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
SNR_MIN, SNR_MAX = 1e-3, 1e3  # clamp of SNR' (sd-scripts: upper bound 1000 only; SNR_MIN: zero-terminal SNR only)


def add_loss_args(parser: argparse.ArgumentParser) -> None:
    """Loss flags; read into ``library.objectives.losses.LossConfig`` (same field names)."""
    g = parser.add_argument_group("loss")
    g.add_argument("--loss_type", type=str, default="l2", choices=["l1", "l2", "huber", "smooth_l1"])
    g.add_argument("--huber_schedule", type=str, default="snr", choices=["constant", "exponential", "snr"])
    g.add_argument("--huber_c", type=float, default=0.1)
    g.add_argument("--huber_scale", type=float, default=1.0)
    g.add_argument("--min_snr_gamma", type=float, default=None, help="Min-SNR weighting gamma (5 is usual)")
    g.add_argument("--scale_v_pred_loss_like_noise_pred", action="store_true")
    g.add_argument("--v_pred_like_loss", type=float, default=None)
    g.add_argument("--debiased_estimation_loss", action="store_true")
    g.add_argument("--unmasked_probability", type=float, default=0.0, help="masked loss: chance to ignore the mask")
    g.add_argument("--unmasked_weight", type=float, default=0.0, help="masked loss: weight outside the mask")
    g.add_argument(
        "--normalize_masked_area_loss", action="store_true", help="masked loss: divide by the mask's mean area"
    )


@dataclass(frozen=True)
class LossConfig:
    """Loss settings; field names and defaults are sd-scripts' flags (without ``--``).

    ``v_parameterization`` is the same flag as ``NoiseConfig.v_parameterization`` (the config reader fills both from
    one flag): it picks the v variants of the SNR weightings (the DDPM objective checks the v-prediction flags against
    it: :func:`library.objectives.ddpm.ddpm_problems`). The masked-loss options are OneTrainer's
    (``unmasked_probability``, ``unmasked_weight``, ``normalize_masked_area_loss``); their defaults (0, 0, False)
    give sd-scripts' masked loss (``loss * mask``, no re-normalisation).

    Raises:
        ValueError: listing every bad field at once, each naming its flag.
    """

    loss_type: str = "l2"
    huber_schedule: str = "snr"
    huber_c: float = 0.1
    huber_scale: float = 1.0
    min_snr_gamma: float | None = None
    debiased_estimation_loss: bool = False
    scale_v_pred_loss_like_noise_pred: bool = False
    v_pred_like_loss: float | None = None
    v_parameterization: bool = False
    masked_loss: bool = False
    unmasked_probability: float = 0.0
    unmasked_weight: float = 0.0
    normalize_masked_area_loss: bool = False
    prior_loss_weight: float = 1.0

    def __post_init__(self) -> None:
        errors = _loss_config_errors(self)
        if errors:
            raise ConfigError(errors, "loss settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LossConfig:
        """The same-named flags."""
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def _loss_config_errors(cfg: LossConfig) -> list[str]:
    errors = []
    if cfg.loss_type not in LOSS_TYPES:
        errors.append(f"--loss_type must be one of {', '.join(LOSS_TYPES)}, got {cfg.loss_type!r}")
    if cfg.huber_schedule not in HUBER_SCHEDULES:
        errors.append(f"--huber_schedule must be one of {', '.join(HUBER_SCHEDULES)}, got {cfg.huber_schedule!r}")
    if not (cfg.huber_c > 0 and math.isfinite(cfg.huber_c)):
        errors.append(f"--huber_c must be a finite number > 0 (default 0.1), got {cfg.huber_c}")
    if not (cfg.huber_scale > 0 and math.isfinite(cfg.huber_scale)):
        errors.append(f"--huber_scale must be a finite number > 0 (default 1.0), got {cfg.huber_scale}")
    if cfg.min_snr_gamma is not None and not (cfg.min_snr_gamma > 0 and math.isfinite(cfg.min_snr_gamma)):
        errors.append(f"--min_snr_gamma must be a finite number > 0 (5 is the paper's value), got {cfg.min_snr_gamma}")
    if cfg.v_pred_like_loss is not None and not cfg.v_pred_like_loss >= 0:
        errors.append(f"--v_pred_like_loss must be >= 0, got {cfg.v_pred_like_loss}")
    for flag in ("unmasked_probability", "unmasked_weight"):
        if not 0 <= getattr(cfg, flag) <= 1:
            errors.append(f"--{flag} must be in [0, 1], got {getattr(cfg, flag)}")
    if not (cfg.prior_loss_weight >= 0 and math.isfinite(cfg.prior_loss_weight)):
        errors.append(f"--prior_loss_weight must be a finite number >= 0, got {cfg.prior_loss_weight}")
    return errors


# ----------------------------------------------------------------------------------------------------------------------
# Per-element loss


def huber_c_for(timesteps: Tensor, cfg: LossConfig, schedule: NoiseSchedule) -> Tensor:
    """Per-sample pseudo-Huber ``c`` (B,) float32 on the timesteps' device (sd-scripts ``get_huber_threshold_if_needed``;
    Khrapov et al. 2024, "Improving Diffusion Models's Data-Corruption Resistance using Scheduled Pseudo-Huber Loss",
    arXiv:2403.16728).

    constant and exponential: :func:`huber_c_by_timestep`; snr: ``(1 - huber_c) / (1 + sigma_t)^2 + huber_c`` with
    ``sigma_t = sqrt((1 - a_t) / a_t)`` (huber_scale not applied, as sd-scripts), computed as ``(1 - huber_c) a_t /
    (sqrt(a_t) + sqrt(1 - a_t))^2 + huber_c`` so it stays finite (= huber_c) at a_t = 0.
    """
    if cfg.huber_schedule != "snr":
        return huber_c_by_timestep(timesteps, cfg, schedule.num_train_timesteps)
    a = schedule.gather(timesteps)
    c = (1.0 - cfg.huber_c) * a / (a.sqrt() + (1.0 - a).sqrt()) ** 2 + cfg.huber_c
    return c.to(device=timesteps.device, dtype=torch.float32)


def huber_c_by_timestep(timesteps: Tensor, cfg: LossConfig, num_train_timesteps: int) -> Tensor:
    """The pseudo-Huber ``c`` (B,) float32 of the schedules that need only the timestep (integer, or the float
    ``1000 σ`` of flow matching): constant ``huber_c * huber_scale``; exponential ``exp(-k t) * huber_scale`` with
    ``k = -ln(huber_c) / T``. ``--huber_schedule snr`` needs a DDPM schedule's SNR: ValueError (sd-scripts raises too).
    """
    if cfg.huber_schedule == "constant":
        c = torch.full(timesteps.shape, cfg.huber_c * cfg.huber_scale, dtype=torch.float64, device=timesteps.device)
    elif cfg.huber_schedule == "exponential":
        k = -math.log(cfg.huber_c) / num_train_timesteps
        c = torch.exp(-k * timesteps.detach().to(torch.float64)) * cfg.huber_scale
    else:
        raise ValueError(
            f"--huber_schedule {cfg.huber_schedule} needs a DDPM noise schedule (its SNR), which this objective does "
            "not have; use --huber_schedule constant or exponential"
        )
    return c.to(device=timesteps.device, dtype=torch.float32)


def elementwise_loss(pred: Tensor, target: Tensor, loss_type: str, huber_c: Tensor | None = None) -> Tensor:
    """Per-element loss, float32, same shape as ``pred`` (B, ...) (sd-scripts ``conditional_loss``, reduction none).

    l2: ``(p - y)^2``; l1: ``|p - y|``; huber: ``2 c (sqrt((p - y)^2 + c^2) - c)``; smooth_l1:
    ``2 (sqrt((p - y)^2 + c^2) - c)`` (both pseudo-Huber, Charbonnier 1994; ``huber_c`` (B,) per sample).
    """
    diff = pred.float() - target.float()
    if loss_type == "l2":
        return diff**2
    if loss_type == "l1":
        return diff.abs()
    if loss_type not in ("huber", "smooth_l1"):
        raise ValueError(f"--loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if huber_c is None:
        raise ValueError(f"--loss_type {loss_type} needs a per-sample huber_c (see huber_c_for)")
    c = huber_c.to(diff.device, torch.float32).view((-1,) + (1,) * (diff.ndim - 1))
    squared = diff**2
    pseudo = squared / (torch.sqrt(squared + c**2) + c)  # = sqrt(d^2 + c^2) - c without cancellation at small d
    return 2.0 * c * pseudo if loss_type == "huber" else 2.0 * pseudo


# ----------------------------------------------------------------------------------------------------------------------
# Masks


def resize_mask(mask: Tensor, size: tuple[int, int]) -> Tensor:
    """Per-pixel weights (B, 1, H, W) or (B, H, W) in [0, 1] -> (B, 1, h, w) float32 at the latent size, by area
    interpolation (the mean of the pixels each latent cell covers; identity when already at that size)."""
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError(f"mask must be (B, 1, H, W) or (B, H, W), got shape {tuple(mask.shape)}")
    return F.interpolate(mask.float(), size=tuple(size), mode="area")


def apply_mask(loss: Tensor, mask: Tensor, cfg: LossConfig, generator: torch.Generator | None = None) -> Tensor:
    """Weight a per-element loss (B, C, h, w) by a mask (B, 1, H, W) / (B, H, W) resized to (h, w).

    sd-scripts: ``loss * mask``. OneTrainer's options (seed doc 002, OneTrainer ``masked_losses`` and mgds
    ``RandomLatentMaskRemove``): with probability ``unmasked_probability`` a sample trains without its mask (mask
    -> 1; one uniform draw per sample from ``generator``, made only when the probability is > 0); the weight outside
    the mask is raised to ``unmasked_weight`` (``clamp(mask, unmasked_weight, 1)``); ``normalize_masked_area_loss``
    divides each sample by the mean of its weights so small masks are not under-weighted.
    """
    weights = resize_mask(mask, loss.shape[-2:]).to(loss.device)
    if weights.shape[0] != loss.shape[0]:
        raise ValueError(f"mask batch size {weights.shape[0]} does not match the loss batch size {loss.shape[0]}")
    if cfg.unmasked_probability > 0:
        device = generator.device if generator is not None else loss.device
        draws = torch.rand((loss.shape[0],), generator=generator, device=device).to(loss.device)
        drop = (draws < cfg.unmasked_probability).view(-1, 1, 1, 1)
        weights = torch.where(drop, torch.ones_like(weights), weights)
    weights = weights.clamp(cfg.unmasked_weight, 1.0)
    loss = loss * weights
    if cfg.normalize_masked_area_loss:
        loss = loss / weights.mean(dim=(1, 2, 3), keepdim=True).clamp(min=1e-8)
    return loss


# ----------------------------------------------------------------------------------------------------------------------
# SNR weightings (all take the SNR (B,) of the schedule actually used)


def snr_floor(schedule: NoiseSchedule) -> float:
    """The lower bound of ``SNR'``: ``SNR_MIN`` on a schedule that reaches SNR = 0 (zero-terminal SNR: it keeps the
    weights finite there), else 0 (none: sd-scripts' and OneTrainer's ``min(SNR, 1000)``)."""
    return SNR_MIN if schedule.reaches_zero_snr else 0.0


def clamp_snr(snr: Tensor, floor: float = SNR_MIN) -> Tensor:
    """``SNR' = clamp(SNR, floor, 1e3)`` (sd-scripts: ``min(SNR, 1000)``; ``floor``: :func:`snr_floor`)."""
    return snr.clamp(floor, SNR_MAX)


def min_snr_weight(snr: Tensor, gamma: float, v_prediction: bool) -> Tensor:
    """Min-SNR-gamma weight (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting Strategy",
    arXiv:2303.09556, eq. 8-9 in epsilon / v form): eps ``min(SNR, g) / SNR``, v ``min(SNR, g) / (SNR + 1)``.

    The epsilon form is evaluated as ``min(1, g / SNR)``: its limit 1 at SNR = 0. (B,) -> (B,).
    """
    if v_prediction:
        return torch.minimum(snr, torch.full_like(snr, gamma)) / (snr + 1.0)
    return torch.clamp(gamma / snr, max=1.0)


def v_pred_scale(snr: Tensor, floor: float = SNR_MIN) -> Tensor:
    """``SNR' / (SNR' + 1)``: converts a v-prediction loss to the scale of an epsilon loss, since
    ``|v - v^|^2 = (SNR + 1)/SNR |eps - eps^|^2`` (Salimans & Ho 2022, sec. 4). (B,) -> (B,)."""
    s = clamp_snr(snr, floor)
    return s / (s + 1.0)


def debiased_weight(snr: Tensor, v_prediction: bool, floor: float = SNR_MIN) -> Tensor:
    """Debiased estimation weight (Yu et al. 2024, "Debias the Training of Diffusion Models", arXiv:2310.08442):
    eps ``1 / sqrt(SNR')``, v ``1 / (SNR' + 1)`` (sd-scripts ``apply_debiased_estimation``). (B,) -> (B,)."""
    s = clamp_snr(snr, floor)
    return 1.0 / (s + 1.0) if v_prediction else 1.0 / s.sqrt()


def apply_snr_weightings(loss: Tensor, timesteps: Tensor, cfg: LossConfig, schedule: NoiseSchedule) -> Tensor:
    """Steps 5-8 on per-sample losses (B,) in sd-scripts' order, with the schedule's SNR at ``timesteps`` bounded
    below at its :func:`snr_floor`; weights computed in float64, loss stays float32."""
    snr, floor = schedule.snr(timesteps), snr_floor(schedule)
    weight = torch.ones_like(snr)
    if cfg.min_snr_gamma is not None:
        weight = weight * min_snr_weight(snr, cfg.min_snr_gamma, cfg.v_parameterization)
    if cfg.scale_v_pred_loss_like_noise_pred:
        weight = weight * v_pred_scale(snr, floor)
    if cfg.v_pred_like_loss:
        weight = weight * (1.0 + cfg.v_pred_like_loss / v_pred_scale(snr, floor))
    if cfg.debiased_estimation_loss:
        weight = weight * debiased_weight(snr, cfg.v_parameterization, floor)
    return loss * weight.to(device=loss.device, dtype=loss.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The composite


def weighted_loss_per_sample(
    pred: Tensor,
    target: Tensor,
    cfg: LossConfig,
    *,
    huber_c: Tensor | None = None,
    element_weights: Tensor | None = None,
    loss_weights: Tensor | None = None,
    mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-sample loss (B,) float32, steps 1-4 of the module docstring, with an objective's weight per element
    between steps 1 and 2 (flow matching's ``--weighting_scheme``, as sd-scripts' ``process_batch``).

    Args:
        pred, target: (B, C, h, w) what is compared (any float dtype; the loss is computed in float32).
        huber_c: (B,) pseudo-Huber ``c`` for ``--loss_type huber / smooth_l1``, else None.
        element_weights: a tensor that broadcasts against (B, C, h, w) (e.g. (B, 1, 1, 1)), or None for 1.
        loss_weights, mask, generator: as :func:`diffusion_loss_per_sample`.
    """
    loss = elementwise_loss(pred, target, cfg.loss_type, huber_c)
    if element_weights is not None:
        loss = loss * element_weights.to(device=loss.device, dtype=loss.dtype)
    if mask is not None:
        loss = apply_mask(loss, mask, cfg, generator)
    elif cfg.masked_loss:
        raise ValueError(
            "--masked_loss is set but the batch has no mask (mask images or alpha masks); check the dataset"
        )
    loss = loss.mean(dim=(1, 2, 3))
    if loss_weights is not None:
        loss = loss * loss_weights.to(device=loss.device, dtype=loss.dtype)
    return loss


def diffusion_loss_per_sample(
    pred: Tensor,
    target: Tensor,
    timesteps: Tensor,
    cfg: LossConfig,
    schedule: NoiseSchedule,
    *,
    loss_weights: Tensor | None = None,
    mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-sample diffusion loss (B,) float32, steps 1-8 of the module docstring (for logging and validation).

    Args:
        pred, target: (B, C, h, w) model output and target (any float dtype; the loss is computed in float32).
        timesteps: (B,) integer timesteps the example was noised at.
        schedule: the training schedule (provides ``snr`` and ``gather``).
        loss_weights: (B,) per-sample weights (the batch's ``loss_weights``: ``--prior_loss_weight`` for
            regularisation images, DreamBooth prior preservation, Ruiz et al. 2023, arXiv:2208.12242), or None for 1.
        mask: (B, 1, H, W) or (B, H, W) per-pixel weights in [0, 1] at image or latent resolution, or None.
        generator: draws for ``unmasked_probability``.
    """
    check_shapes(pred, target, timesteps)
    huber_c = huber_c_for(timesteps, cfg, schedule) if cfg.loss_type in ("huber", "smooth_l1") else None
    loss = weighted_loss_per_sample(
        pred, target, cfg, huber_c=huber_c, loss_weights=loss_weights, mask=mask, generator=generator
    )
    return apply_snr_weightings(loss, timesteps, cfg, schedule)


def check_shapes(pred: Tensor, target: Tensor, timesteps: Tensor) -> None:
    """ValueError unless pred and target are both (B, C, h, w) and timesteps (B,)."""
    if pred.shape != target.shape or pred.ndim != 4:
        raise ValueError(
            f"pred and target must both be (B, C, h, w), got {tuple(pred.shape)} and {tuple(target.shape)}"
        )
    if timesteps.shape != pred.shape[:1]:
        raise ValueError(f"timesteps must have shape ({pred.shape[0]},), got {tuple(timesteps.shape)}")
