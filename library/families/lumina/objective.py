"""Lumina Image 2.0's objective: sd-scripts' Lumina rectified flow (``lumina_train_network.py:
get_noise_pred_and_target``, ``library/lumina_train_util.py: get_noisy_model_input_and_timesteps``), its flags and
their reader, on the shared flow math (``library/objectives/flow.py``).

One example, in sd-scripts' order (one ``torch.Generator``): ε ~ N(0, I); σ (B,) by ``--timestep_sampling`` and
``timesteps = 1000 σ``; ξ and γ of ``--ip_noise_gamma``; x_σ = (1 − σ) x0 + σ (ε + γ ξ). The model runs on
τ = 1 − σ (sd-scripts passes ``t = 1 - timesteps / 1000``) and its output o is compared with the **target x0 − ε**
(the sign opposite to FLUX's) after ``--model_prediction_type`` (raw, sd-scripts' Lumina default: o; additive:
o + x_σ; sigma_scaled: x_σ − σ o with the ``--weighting_scheme`` loss weight). The family's ``predict`` returns the
velocity ε − x0 the shared Euler sampler integrates (−o), so :meth:`LuminaFlowObjective.prediction` negates it back
before applying the prediction type.

``--timestep_sampling`` (u ~ U(0, 1), z ~ N(0, 1), s = ``--sigmoid_scale``, S = ``--discrete_flow_shift``, default
6.0): ``shift`` (default) σ = S v / (1 + (S − 1) v), v = sigmoid(s z); ``nextdit_shift``: σ = time_shift(μ,
max(u, 1e-7)); ``flux_shift``: the same on v = sigmoid(s z); μ linear in the (h/2)(w/2) image tokens, 0.5 at 256 and
1.15 at 4096; ``uniform``: σ = u; ``sigmoid``: σ = v; ``sigma``: the i-th entry of
``FlowMatchEulerDiscreteScheduler(1000, shift=S)``'s table, i = floor(1000 u'), u' by ``--weighting_scheme``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from library.objectives import flow as fm
from library.objectives.flow import NUM_TRAIN_TIMESTEPS, ShiftLine
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig
from library.objectives.sdscripts_flow import ScriptsFlowConfig, ScriptsFlowObjective, add_scripts_flow_args

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "nextdit_shift", "flux_shift")
SHIFT_LINE = ShiftLine(((256, 0.5), (4096, 1.15)))  # μ through (image tokens, μ)
SIGMOID_HELP = "scale of the normal draw for sigmoid / shift / flux_shift"
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (or nextdit_shift)"


@dataclass(frozen=True)
class LuminaFlowConfig(ScriptsFlowConfig):
    """Lumina 2's objective settings (names and defaults = sd-scripts' flags). ``ConfigError`` lists every bad one."""

    title: ClassVar[str] = "Lumina 2"
    samplings: ClassVar[tuple[str, ...]] = TIMESTEP_SAMPLINGS

    timestep_sampling: str = "shift"
    discrete_flow_shift: float = 6.0


def add_lumina_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' Lumina objective flags (``lumina_train_util.add_lumina_train_arguments``) on a training parser;
    the shared ``--timestep_sampling`` gets Lumina's choices and default (``shift``). Returns the parser."""
    sampling_help = ("σ law: shift (sigmoid of N(0, sigmoid_scale²) then --discrete_flow_shift; default), "
                     "nextdit_shift (uniform then the resolution time-shift, sd-scripts' docs recommend it), flux_shift "
                     "(sigmoid then the resolution time-shift), uniform, sigmoid, sigma (the shifted scheduler table by "
                     "--weighting_scheme)")  # fmt: skip
    return add_scripts_flow_args(
        parser, LuminaFlowConfig, sampling_help=sampling_help, sigmoid_help=SIGMOID_HELP, target="x0 - ε"
    )


def lumina_mu(latent_height: int, latent_width: int) -> float:
    """μ of the resolution time-shift for (h, w) latents: linear in ``(h // 2) (w // 2)`` through
    :data:`SHIFT_LINE` (sd-scripts' ``get_lin_function(y1=0.5, y2=1.15)``)."""
    return SHIFT_LINE.mu(latent_height, latent_width)


def sample_sigmas(cfg: LuminaFlowConfig, batch: int, latent_size: tuple[int, int],
                  generator: torch.Generator | None = None, device: Any = "cpu") -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(sigmas, timesteps)`` (B,) float32 on ``device`` by ``cfg.timestep_sampling`` (module docstring)."""
    draw = fm.draw_device(generator)
    kind, n = cfg.timestep_sampling, NUM_TRAIN_TIMESTEPS
    if kind == "sigma":
        table_sigmas, table_timesteps = fm.sigma_table(cfg.discrete_flow_shift)
        index = (fm.table_density(cfg, batch, generator) * n).long().clamp(0, n - 1).cpu()
        return table_sigmas[index].to(device), table_timesteps[index].to(device)
    if kind in ("uniform", "nextdit_shift"):
        sigmas = torch.rand((batch,), generator=generator, device=draw)
    else:
        sigmas = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch,), generator=generator, device=draw))
    if kind == "shift":
        sigmas = fm.shift_sigmas(sigmas, cfg.discrete_flow_shift)
    elif kind in ("nextdit_shift", "flux_shift"):
        sigmas = fm.time_shift(lumina_mu(*latent_size), sigmas.clamp(min=1e-7))
    return sigmas.to(device), (sigmas * n).to(device)


class LuminaFlowObjective(ScriptsFlowObjective):
    """sd-scripts' Lumina 2 objective (module docstring): target x0 − ε, ``timesteps`` = 1000 σ for ``predict``."""

    negated = True

    def sample_sigmas(self, batch: int, size: tuple[int, int], generator: torch.Generator | None,
                      device: Any) -> tuple[Tensor, Tensor]:  # fmt: skip
        return sample_sigmas(self.cfg, batch, size, generator, device)


lumina_objective = LuminaFlowObjective.for_run


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
