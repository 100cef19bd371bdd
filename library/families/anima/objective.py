"""Anima's objective: rectified flow with sd-scripts' Anima meanings (``anima_train_network.py:
get_noise_pred_and_target``), built on the shared flow math (``library/objectives/flow.py``).

One example, in sd-scripts' draw order: ε ~ N(0, I) shaped like the latents; σ (B,) by ``--timestep_sampling``
(the same laws and flags as sd-scripts' FLUX helper ``get_noisy_model_input_and_timesteps``, which Anima calls:
``sigma`` the shifted table drawn by ``--weighting_scheme``, ``uniform``, ``sigmoid`` (Anima's default; sigmoid of
N(0, ``--sigmoid_scale``²)), ``shift`` (sigmoid then ``--discrete_flow_shift``, default 1.0 for Anima), ``flux_shift``);
then ``--ip_noise_gamma`` (ξ, then γ). x_σ = (1 − σ) x0 + σ ε; target ε − x0; the model gets t = σ ∈ [0, 1] (the
example's ``timesteps`` are 1000 σ, the family's ``predict`` divides). No prediction-type transform (sd-scripts'
Anima compares the raw output). The loss is weighted per sample by ``--weighting_scheme`` (``sigma_sqrt``: σ⁻²,
``cosmap``, else 1: ``compute_loss_weighting_for_anima``), always, as sd-scripts returns that weighting for every
step.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from library.cli.problems import ConfigError
from library.objectives import flow as fm
from library.objectives.base import FLOW_MATCHING, NUM_VALIDATION_TIMESTEPS, Example
from library.objectives.flow import NUM_TRAIN_TIMESTEPS, choice_error
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
FLUX_SHIFT_POINTS = ((256, 0.5), (4096, 1.15))  # sd-scripts' get_lin_function(y1=0.5, y2=1.15)
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift"


def add_anima_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' Anima objective flags (``anima_train_utils.add_anima_training_arguments`` and
    ``train_util.add_dit_training_arguments``' weighting flags); the shared ``--timestep_sampling`` gets Anima's
    choices and default. Read into :class:`AnimaFlowConfig`."""
    existing = {action.dest: action for action in parser._actions}
    helps = {
        "timestep_sampling": "σ law: sigmoid (default: sigmoid of N(0, sigmoid_scale²)), uniform, shift (sigmoid then "
        "--discrete_flow_shift), flux_shift (FLUX.1's resolution-dependent shift), sigma (the shifted scheduler "
        "table drawn by --weighting_scheme)",
        "sigmoid_scale": "scale of the normal draw for sigmoid / shift / flux_shift (default 1.0)",
    }
    sampling = existing.get("timestep_sampling")
    g = parser.add_argument_group("flow matching (Anima)", "sd-scripts' Anima rectified flow")
    if sampling is not None:
        sampling.choices, sampling.default, sampling.help = list(TIMESTEP_SAMPLINGS), "sigmoid", helps[sampling.dest]
    else:
        g.add_argument("--timestep_sampling", type=str, default="sigmoid", choices=list(TIMESTEP_SAMPLINGS),
                       help=helps["timestep_sampling"])  # fmt: skip
    if "sigmoid_scale" in existing:
        existing["sigmoid_scale"].help = helps["sigmoid_scale"]
    else:
        g.add_argument("--sigmoid_scale", type=float, default=1.0, help=helps["sigmoid_scale"])
    g.add_argument("--discrete_flow_shift", type=float, default=1.0,
                   help="shift S of --timestep_sampling shift and of the sigma table (default 1.0)")  # fmt: skip
    fm.add_weighting_args(g, set(existing), "sigma: the law of the table index (logit_normal, mode, else uniform); "
                          "the loss weight per sample: sigma_sqrt σ^-2, cosmap, else 1")  # fmt: skip
    return parser


@dataclass(frozen=True)
class AnimaFlowConfig:
    """Anima's objective settings (sd-scripts' flag names and Anima defaults).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    timestep_sampling: str = "sigmoid"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 1.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False

    def __post_init__(self) -> None:
        errors = choice_error("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLINGS)
        errors += fm.weighting_problems(self)
        for flag in ("sigmoid_scale", "discrete_flow_shift"):
            value = getattr(self, flag)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"--{flag} must be a finite number > 0, got {value}")
        if self.ip_noise_gamma is not None and not self.ip_noise_gamma >= 0:
            errors.append(f"--ip_noise_gamma must be >= 0, got {self.ip_noise_gamma}")
        if errors:
            raise ConfigError(errors, "Anima flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AnimaFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def _flux_mu(h: int, w: int) -> float:
    (x1, y1), (x2, y2) = FLUX_SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((h // 2) * (w // 2)) + (y1 - slope * x1)


def sample_sigmas(cfg: AnimaFlowConfig, batch: int, size: tuple[int, int], generator: torch.Generator | None,
                  device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:  # fmt: skip
    """(σ, 1000 σ), each (B,) float32 on ``device``, by ``cfg.timestep_sampling`` (module docstring); ``size``: the
    latents' (h, w) (flux_shift)."""
    draw = fm.draw_device(generator)
    kind, n = cfg.timestep_sampling, NUM_TRAIN_TIMESTEPS
    if kind == "sigma":
        table, steps = fm.sigma_table(cfg.discrete_flow_shift)
        index = (fm.table_density(cfg, batch, generator) * n).long().clamp(0, n - 1).cpu()
        return table[index].to(device), steps[index].to(device)
    if kind == "uniform":
        sigmas = torch.rand((batch,), generator=generator, device=draw)
    else:
        sigmas = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch,), generator=generator, device=draw))
        if kind == "shift":
            sigmas = fm.shift_sigmas(sigmas, cfg.discrete_flow_shift)
        elif kind == "flux_shift":
            sigmas = fm.time_shift(_flux_mu(*size), sigmas)
    return sigmas.to(device), (sigmas * n).to(device)


@dataclass(frozen=True, eq=False)
class AnimaFlowObjective:
    """The objective of an Anima run (module docstring)."""

    cfg: AnimaFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """ε, σ (drawn, or ``timesteps`` / 1000), x_σ, target ε − x0; the example's ``timesteps`` are 1000 σ."""
        size = tuple(latents.shape[-2:])
        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(
            latents, generator, timesteps, lambda b, gen, device: sample_sigmas(self.cfg, b, size, gen, device)
        )
        c = self.cfg
        noisy = fm.noisy_input(latents, noise, sigmas, generator, ip_noise_gamma=c.ip_noise_gamma,
                               ip_noise_gamma_random_strength=c.ip_noise_gamma_random_strength)  # fmt: skip
        return Example(noisy.to(latents.dtype), fm.flow_target(latents, noise), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The raw output (sd-scripts' Anima has no prediction-type transform)."""
        return output

    def weighting(self, example: Example) -> Tensor | None:
        # sd-scripts' compute_loss_weighting_for_anima is the shared rule: sigma_sqrt σ⁻², cosmap, else weight 1
        weight = fm.loss_weighting(self.cfg.weighting_scheme, example.sigmas)
        return None if weight is None else weight.view(-1, 1, 1, 1)

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        return fm.flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[None]:
        """Four passes drawing σ as in training (sd-scripts' validation on its flow path)."""
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' ``AnimaNetworkTrainer.update_metadata`` keys."""
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_timestep_sampling": c.timestep_sampling, "ss_sigmoid_scale": c.sigmoid_scale,
                "ss_discrete_flow_shift": c.discrete_flow_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> AnimaFlowObjective:
        return self


def anima_objective(title: str, cfg: AnimaFlowConfig, noise: NoiseConfig, loss: LossConfig) -> AnimaFlowObjective:
    """The run's objective; one warning naming the DDPM-only flags it does not read."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss))
    return AnimaFlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
