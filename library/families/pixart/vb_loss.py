"""PixArt's training loss: the ε loss on the first half of the transformer's 8 channels plus ``--vb_loss_strength`` ×
the variational bound on the second half, the learned variance (the hybrid loss of improved DDPM, Nichol & Dhariwal
2021, arXiv:2102.09672, which the PixArt authors train with, and OneTrainer's ``vb_loss_strength``, default 1).

The variance half ``v`` ∈ [-1, 1] interpolates the log variance of the reverse step between the posterior's and β_t:
``log σ² = (v + 1)/2 · log β_t + (1 - v)/2 · log β̃_t`` (β̃_t the posterior variance, its t = 0 value replaced by
t = 1's as the original code clips it; diffusers' ``DDPMScheduler(variance_type="learned_range")`` reads the output
the same way when sampling). The bound's term at t > 0 is KL(q(x_{t-1} | x_t, x_0) ‖ p(x_{t-1} | x_t)), at t = 0 the
discretized Gaussian decoder NLL of x_0, both in bits per element; the mean of p comes from ε with its gradient
stopped, so the bound trains the variance only and the ε loss the mean. Per sample: the mask, the mean over
elements, the prior-loss weights, then the sum with the ε loss takes the SNR weightings (OneTrainer's order).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from library.objectives.base import Example
from library.objectives.ddpm import DDPMObjective
from library.objectives.losses import apply_mask, apply_snr_weightings, huber_c_for, weighted_loss_per_sample
from library.objectives.noising import NoiseSchedule

_BITS = math.log(2.0)


class VBExample(Example):
    """A DDPM example that also carries its clean latents (x_0 of the bound); unpacks as :class:`Example`."""

    latents: Tensor


@dataclass(frozen=True)
class Coefficients:
    """The (T,) float64 tables of the bound, from a schedule's ᾱ."""

    alphas_cumprod: Tensor
    betas: Tensor
    log_posterior_variance: Tensor  # clipped: t = 0 takes t = 1's value
    posterior_mean_x0: Tensor
    posterior_mean_xt: Tensor

    @classmethod
    def of(cls, schedule: NoiseSchedule) -> Coefficients:
        ac = schedule.alphas_cumprod.double()
        prev = torch.cat([ac.new_ones(1), ac[:-1]])
        betas = 1.0 - ac / prev
        posterior = betas * (1.0 - prev) / (1.0 - ac)
        log_posterior = torch.log(torch.cat([posterior[1:2], posterior[1:]]))
        return cls(
            ac, betas, log_posterior, betas * prev.sqrt() / (1.0 - ac), (1.0 - prev) * (1.0 - betas).sqrt() / (1.0 - ac)
        )

    def at(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """Table ``name`` at timesteps t (B,), shaped (B, 1, 1, 1) in ``like``'s dtype and device."""
        values = getattr(self, name).to(t.device)[t.long()]
        return values.to(device=like.device, dtype=like.dtype).view(-1, *([1] * (like.ndim - 1)))


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """KL(N(mean1, e^logvar1) ‖ N(mean2, e^logvar2)) per element, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _standard_normal_cdf(x: Tensor) -> Tensor:
    """The tanh approximation of Φ that the improved-DDPM code uses (and OneTrainer copies)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x: Tensor, mean: Tensor, log_scale: Tensor) -> Tensor:
    """log P(x) per element, nats, of N(mean, e^{2 log_scale}) integrated over x's 1/255-wide bin in [-1, 1]; the
    end bins take the tails."""
    inv = torch.exp(-log_scale)
    cdf_plus = _standard_normal_cdf(inv * (x - mean + 1.0 / 255.0))
    cdf_min = _standard_normal_cdf(inv * (x - mean - 1.0 / 255.0))
    log_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_plus, torch.where(x > 0.999, log_one_minus_min, log_delta))


def vb_terms(coef: Coefficients, x0: Tensor, xt: Tensor, t: Tensor, eps: Tensor, var_values: Tensor) -> Tensor:
    """The bound per element (B, C, h, w), bits: KL at t > 0, the decoder NLL at t = 0 (module docstring). ``eps`` is
    used as given: pass it detached to train only the variance."""
    true_mean = coef.at("posterior_mean_x0", t, xt) * x0 + coef.at("posterior_mean_xt", t, xt) * xt
    true_log_var = coef.at("log_posterior_variance", t, xt)
    frac = (var_values + 1.0) / 2.0
    log_var = frac * coef.at("betas", t, xt).log() + (1.0 - frac) * true_log_var
    ac = coef.at("alphas_cumprod", t, xt)
    x0_pred = xt / ac.sqrt() - (1.0 / ac - 1.0).sqrt() * eps
    mean = coef.at("posterior_mean_x0", t, xt) * x0_pred + coef.at("posterior_mean_xt", t, xt) * xt
    kl = normal_kl(true_mean, true_log_var, mean, log_var) / _BITS
    nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_var) / _BITS
    return torch.where((t == 0).view(-1, *([1] * (xt.ndim - 1))).to(xt.device), nll, kl)


@dataclass(frozen=True, eq=False)
class PixArtObjective(DDPMObjective):
    """DDPM ε with the variational bound on the learned variance (module docstring); ``vb_strength`` > 0."""

    vb_strength: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "predict_options", {"with_variance": True})  # the transformer's 8 channels

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> VBExample:  # fmt: skip
        example = VBExample(*super().example(latents, generator, timesteps=timesteps))
        example.latents = latents
        return example

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        """ε loss + ``vb_strength`` × bound per sample; a 4-channel output (no learned variance) has the ε loss."""
        target = example.target.to(pred.device)
        channels = target.shape[1]
        eps, var_values = pred[:, :channels], pred[:, channels:]
        t = example.timesteps.to(pred.device)
        huber_c = huber_c_for(t, self.loss, self.schedule) if self.loss.loss_type in ("huber", "smooth_l1") else None
        loss = weighted_loss_per_sample(eps, target, self.loss, huber_c=huber_c, loss_weights=loss_weights,
                                        mask=mask, generator=generator)  # fmt: skip
        latents = getattr(example, "latents", None)
        if var_values.shape[1] == channels and latents is not None:
            vb = vb_terms(Coefficients.of(self.schedule), latents.to(pred.device).float(),
                          example.noisy.to(pred.device).float(), t, eps.detach().float(), var_values.float())  # fmt: skip
            if mask is not None:  # --unmasked_probability is refused with the bound (options.py): no second draw
                vb = apply_mask(vb, mask, self.loss)
            vb = vb.mean(dim=(1, 2, 3))
            if loss_weights is not None:
                vb = vb * loss_weights.to(device=vb.device, dtype=vb.dtype)
            loss = loss + self.vb_strength * vb
        return apply_snr_weightings(loss, t, self.loss, self.schedule)

    def to(self, device: torch.device | str) -> PixArtObjective:
        return dataclasses.replace(self, schedule=self.schedule.to(device))


def pixart_objective(base: DDPMObjective, vb_strength: float) -> DDPMObjective:
    """``base`` (the ε objective of the run's flags) with the bound at ``vb_strength``; ``base`` itself at 0."""
    if not vb_strength:
        return base
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "predict_options"}
    return PixArtObjective(**fields, vb_strength=vb_strength)
