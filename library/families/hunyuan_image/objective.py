"""HunyuanImage 2.1's objective: sd-scripts' ``hunyuan_image_train_network.py: get_noise_pred_and_target`` (FLUX's
``flux_train_utils.get_noisy_model_input_and_timesteps`` + ``apply_model_prediction_type``), its flags and their
reader, on the shared flow math (``library/objectives/flow.py``).

One example, in sd-scripts' order (one ``torch.Generator``): ε ~ N(0, I); σ (B,) by ``--timestep_sampling``; ξ and
γ of ``--ip_noise_gamma``; x_σ = (1 − σ) x0 + σ (ε + γ ξ). The transformer runs on the **integer** timesteps
``int64(1000 σ)`` (sd-scripts truncates: "bfloat16 is too low precision for 0-1000") and its output o, after
``--model_prediction_type`` (raw, the default: o; additive: o + x_σ; sigma_scaled: x_σ − σ o with the
``--weighting_scheme`` loss weight), is compared with the target ε − x0 (FLUX's sign: ``predict`` returns o itself).

``--timestep_sampling`` (u ~ U(0, 1), z ~ N(0, 1), s = ``--sigmoid_scale``, S = ``--discrete_flow_shift``, default
5.0): ``sigma`` (default) the i-th entry of ``FlowMatchEulerDiscreteScheduler(1000, shift=S)``'s table, i =
floor(1000 u'), u' by ``--weighting_scheme``; ``uniform``: σ = u; ``sigmoid``: σ = sigmoid(s z); ``shift``:
σ = S v / (1 + (S − 1) v), v = sigmoid(s z); ``flux_shift``: time_shift(μ, v), μ linear in (h // 2)(w // 2) of the
64-channel latents, 0.5 at 256 and 1.15 at 4096 (sd-scripts' FLUX rule applied to HunyuanImage's unpacked latents).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

from library.objectives import flow as fm
from library.objectives.flow import NUM_TRAIN_TIMESTEPS, ShiftLine
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig
from library.objectives.sdscripts_flow import ScriptsFlowConfig, ScriptsFlowObjective, add_scripts_flow_args

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
SHIFT_LINE = ShiftLine(((256, 0.5), (4096, 1.15)))  # μ through (tokens, μ), as sd-scripts' get_lin_function defaults
SIGMOID_HELP = "scale of the normal draw for sigmoid / shift / flux_shift"
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (or sigma, the default)"


class HunyuanFlowConfig(ScriptsFlowConfig):
    """HunyuanImage 2.1's objective settings (names and defaults = sd-scripts' flags). ``ConfigError`` lists every
    bad one."""

    title = "HunyuanImage 2.1"
    samplings = TIMESTEP_SAMPLINGS


def add_hunyuan_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' HunyuanImage objective flags on a training parser; the shared ``--timestep_sampling`` gets its
    choices and default (``sigma``). Returns the parser."""
    sampling_help = ("σ law: sigma (the shifted scheduler table by --weighting_scheme; default), uniform, sigmoid, "
                     "shift (sigmoid then --discrete_flow_shift), flux_shift (sigmoid then the resolution time-shift)")  # fmt: skip
    return add_scripts_flow_args(
        parser, HunyuanFlowConfig, sampling_help=sampling_help, sigmoid_help=SIGMOID_HELP, target="ε - x0"
    )


def flux_mu(latent_height: int, latent_width: int) -> float:
    """μ of the resolution time-shift: linear in ``(h // 2) (w // 2)`` through :data:`SHIFT_LINE`."""
    return SHIFT_LINE.mu(latent_height, latent_width)


def sample_sigmas(cfg: HunyuanFlowConfig, batch: int, latent_size: tuple[int, int],
                  generator: torch.Generator | None = None, device: Any = "cpu") -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(sigmas float32, timesteps int64 = trunc(1000 σ))`` (B,) on ``device`` (module docstring)."""
    draw = fm.draw_device(generator)
    kind, n = cfg.timestep_sampling, NUM_TRAIN_TIMESTEPS
    if kind == "sigma":
        table_sigmas, _ = fm.sigma_table(cfg.discrete_flow_shift)
        index = (fm.table_density(cfg, batch, generator) * n).long().clamp(0, n - 1).cpu()
        sigmas = table_sigmas[index].to(device)
    else:
        if kind == "uniform":
            sigmas = torch.rand((batch,), generator=generator, device=draw)
        else:
            sigmas = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch,), generator=generator, device=draw))
        if kind == "shift":
            sigmas = fm.shift_sigmas(sigmas, cfg.discrete_flow_shift)
        elif kind == "flux_shift":
            sigmas = fm.time_shift(flux_mu(*latent_size), sigmas)
        sigmas = sigmas.to(device)
    return sigmas, (sigmas * n).to(torch.int64)


class HunyuanFlowObjective(ScriptsFlowObjective):
    """sd-scripts' HunyuanImage 2.1 objective (module docstring): target ε − x0, int64 ``timesteps`` = 1000 σ."""

    def sample_sigmas(self, batch: int, size: tuple[int, int], generator: torch.Generator | None,
                      device: Any) -> tuple[Tensor, Tensor]:  # fmt: skip
        return sample_sigmas(self.cfg, batch, size, generator, device)


hunyuan_objective = HunyuanFlowObjective.for_run


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
