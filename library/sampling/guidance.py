"""Guidance beyond plain CFG for flow sampling: adaptive projected guidance (APG; Sadat et al. 2024, "Eliminating
Oversaturation and Artifacts of High Guidance Scales in Diffusion Models", arXiv:2410.02416) and the guidance
rescale of Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed", arXiv:2305.08891, §3.4).
Pure torch; the settings are a family's :class:`~library.families.base.ProjectedGuidance`.

With the conditional and unconditional predictions c and u (per image, norms over every dimension but the batch):

* the difference d = c − u is averaged with momentum β: a ← d + β·a (a starts at 0; β < 0 cancels the last
  step's direction), then its norm is capped: d ← a·min(1, r / ‖a‖) (``norm_threshold`` r; 0: no cap);
* d is split against the conditional prediction: d∥ = (d·ĉ) ĉ with ĉ = c / ‖c‖ (in float64), d⊥ = d − d∥;
* the guided prediction is u + s·(d⊥ + η·d∥) (scale s, ``eta`` η). With η = 1, no momentum and no cap it is
  plain CFG u + s·(c − u);
* rescale φ: g ← φ·g·std(c)/std(g) + (1 − φ)·g (std over every dimension but the batch).

sd-scripts' HunyuanImage sampler (``hunyuan_image_utils.apply_classifier_free_guidance``) runs plain CFG (with the
rescale ``--guidance_rescale``) up to and including the start step and APG after it; the momentum is updated at
every step, CFG steps included (:func:`with_apg`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from library.families.base import ProjectedGuidance

from .flow import Velocity


def _dims(x: Tensor) -> list[int]:
    return list(range(1, x.ndim))


def rescale_guidance(guided: Tensor, conditional: Tensor, factor: float) -> Tensor:
    """``factor``·guided·std(conditional)/std(guided) + (1 − factor)·guided, per image (module docstring); 0:
    ``guided`` itself."""
    if factor == 0.0:
        return guided
    dims = _dims(conditional)
    ratio = conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True)
    return factor * (guided * ratio) + (1.0 - factor) * guided


class Momentum:
    """The running average a ← d + β·a of the guidance differences (β = ``momentum``; a starts at 0)."""

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.average: Tensor | float = 0.0

    def update(self, difference: Tensor) -> Tensor:
        self.average = difference + self.momentum * self.average
        return self.average


def projected_guidance(
    conditional: Tensor,
    unconditional: Tensor,
    scale: float,
    *,
    momentum: Momentum | None = None,
    eta: float = 1.0,
    norm_threshold: float = 0.0,
) -> Tensor:
    """APG's guided prediction u + s·(d⊥ + η·d∥) (module docstring); ``momentum`` is updated with this step's
    difference."""
    difference = conditional - unconditional
    dims = _dims(difference)
    if momentum is not None:
        difference = momentum.update(difference)
    if norm_threshold > 0:
        norm = difference.norm(p=2, dim=dims, keepdim=True)
        difference = difference * torch.minimum(torch.ones_like(norm), norm_threshold / norm)
    d, unit = difference.double(), torch.nn.functional.normalize(conditional.double(), dim=dims)
    parallel = (d * unit).sum(dim=dims, keepdim=True) * unit
    orthogonal = (d - parallel).type_as(difference)
    return unconditional + scale * (orthogonal + eta * parallel.type_as(difference))


def with_apg(velocity: Velocity, scale: float, settings: ProjectedGuidance, renders_text: Sequence[bool]) -> Velocity:
    """True CFG that turns into APG after the start step (sd-scripts' HunyuanImage sampler, module docstring).
    ``velocity`` runs on the doubled batch [negatives; prompts] as :func:`flow.with_cfg`'s; step i is the i-th call
    (use a new guided velocity per image batch). ``renders_text[b]``: image b's start step is
    ``settings.text_start_step``. ``scale`` is the CFG scale (``--l``); APG uses ``settings.scale``."""
    momentum = Momentum(settings.momentum) if settings.momentum is not None else None
    starts = [settings.text_start_step if text else settings.start_step for text in renders_text]
    step = 0

    def guided(x: Tensor, sigma: Tensor) -> Tensor:
        nonlocal step
        v_neg, v_pos = velocity(torch.cat([x, x]), torch.cat([sigma, sigma])).chunk(2)
        cfg = rescale_guidance(v_neg + scale * (v_pos - v_neg), v_pos, settings.rescale)
        apg = projected_guidance(v_pos, v_neg, settings.scale, momentum=momentum, eta=settings.eta,
                                 norm_threshold=settings.norm_threshold)  # fmt: skip
        apg = rescale_guidance(apg, v_pos, settings.rescale_apg)
        after = torch.tensor([step > start for start in starts], device=x.device).view(-1, *[1] * (x.ndim - 1))
        step += 1
        return torch.where(after, apg, cfg)

    return guided
