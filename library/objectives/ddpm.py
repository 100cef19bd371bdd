"""The DDPM objective: epsilon or v-prediction on a discrete schedule (SD 1.x / 2.x / SDXL), built from
:mod:`library.objectives.noising` (``make_example``) and :mod:`library.objectives.losses`
(``diffusion_loss_per_sample``), exactly as sd-scripts' ``train_network.py`` does; and the flag combinations it
cannot train with (:func:`ddpm_problems`, checked before anything loads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from library.cli.problems import ConfigError

from .base import EPSILON, NUM_VALIDATION_TIMESTEPS, V_PREDICTION, Example
from .losses import LossConfig, diffusion_loss_per_sample
from .noising import TIMESTEP_SAMPLINGS, NoiseConfig, NoiseSchedule, make_example


@dataclass(frozen=True, eq=False)
class DDPMObjective:
    """Epsilon or v-prediction on a DDPM schedule (SD 1.x / 2.x / SDXL): :func:`library.objectives.noising.make_example` and
    :func:`library.objectives.losses.diffusion_loss_per_sample` with the run's settings; ``noise`` / ``loss`` carry
    ``v_parameterization`` = (name == "v_prediction")."""

    name: str
    noise: NoiseConfig
    loss: LossConfig
    schedule: NoiseSchedule
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        if timesteps is not None:
            timesteps = timesteps.to(latents.device)
        noisy, target, t, noise = make_example(self.noise, latents, self.schedule, generator, timesteps=timesteps)
        return Example(noisy, target, t, noise)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The UNet output is the prediction (ε or v) itself."""
        return output

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """:func:`library.objectives.losses.diffusion_loss_per_sample` (loss type, mask, prior weights, SNR weightings)."""
        target = example.target.to(pred.device)
        return diffusion_loss_per_sample(pred, target, example.timesteps, self.loss, self.schedule,
                                         loss_weights=loss_weights, mask=mask, generator=generator)  # fmt: skip

    def validation_timesteps(self) -> list[int]:
        """sd-scripts' fixed validation timesteps: ``linspace(min_t, max_t, 6)[1:-1]`` (200/400/600/800 by
        default)."""
        lo = self.noise.min_timestep or 0
        hi = self.noise.max_timestep or self.schedule.num_train_timesteps
        points = torch.linspace(lo, hi, NUM_VALIDATION_TIMESTEPS + 2)[1:-1]
        return [int(v) for v in points.round().tolist()]

    def metadata(self) -> dict[str, Any]:
        """None beyond the noise/loss keys every run writes."""
        return {}

    def to(self, device: torch.device | str) -> DDPMObjective:
        return dataclasses.replace(self, schedule=self.schedule.to(device))


def ddpm_objective(title: str, prediction_type: str, scheduler_config: dict, noise: NoiseConfig,
                   loss: LossConfig) -> DDPMObjective:  # fmt: skip
    """The DDPM objective of a model whose ``prediction_type`` is "epsilon" or "v_prediction", on the schedule of
    its ``scheduler_config`` (zero-terminal-SNR rescaled with ``noise.zero_terminal_snr``). ``title`` names the
    family in errors (an objective the DDPM code cannot train)."""
    if prediction_type not in (EPSILON, V_PREDICTION):
        raise ValueError(f"{title}: training objective {prediction_type!r} is not supported on a DDPM schedule "
                         f"(epsilon and v_prediction are)")  # fmt: skip
    v = prediction_type == V_PREDICTION
    noise, loss = dataclasses.replace(noise, v_parameterization=v), dataclasses.replace(loss, v_parameterization=v)
    problems = ddpm_problems(noise, loss)  # the model's own prediction type against the v-prediction loss flags
    if problems:
        raise ConfigError(problems, "loss settings")
    schedule = NoiseSchedule.from_config(scheduler_config, zero_terminal_snr=noise.zero_terminal_snr)
    return DDPMObjective(prediction_type, noise, loss, schedule)


def ddpm_problems(noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """The noise / loss settings the DDPM objective cannot train with (before anything loads): a timestep law it
    does not have, and the v-prediction loss flags against ``--v_parameterization``."""
    problems = []
    if noise.timestep_sampling not in TIMESTEP_SAMPLINGS:
        problems.append(
            f"--timestep_sampling must be one of {', '.join(TIMESTEP_SAMPLINGS)}, got {noise.timestep_sampling!r}"
        )
    if loss.scale_v_pred_loss_like_noise_pred and not loss.v_parameterization:
        problems.append(
            "--scale_v_pred_loss_like_noise_pred needs --v_parameterization (it rescales a v-prediction loss)"
        )
    if loss.v_pred_like_loss and loss.v_parameterization:
        problems.append(
            "--v_pred_like_loss cannot be used with --v_parameterization (the loss already is v-prediction)"
        )
    return problems
