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
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from library.cli.problems import ConfigError
from library.objectives import flow as fm
from library.objectives.base import FLOW_MATCHING, NUM_VALIDATION_TIMESTEPS, Example
from library.objectives.flow import MODEL_PREDICTION_TYPES, NUM_TRAIN_TIMESTEPS, WEIGHTING_SCHEMES, choice_error
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "nextdit_shift", "flux_shift")
SHIFT_POINTS = ((256, 0.5), (4096, 1.15))  # μ through (image tokens, μ)
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (or nextdit_shift)"


def add_lumina_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' Lumina objective flags (``lumina_train_util.add_lumina_train_arguments``) on a training parser;
    the shared ``--timestep_sampling`` gets Lumina's choices and default (``shift``). Returns the parser."""
    existing = {action.dest: action for action in parser._actions}
    helps = {
        "timestep_sampling": "σ law: shift (sigmoid of N(0, sigmoid_scale²) then --discrete_flow_shift; default), "
        "nextdit_shift (uniform then the resolution time-shift, sd-scripts' docs recommend it), flux_shift (sigmoid "
        "then the resolution time-shift), uniform, sigmoid, sigma (the shifted scheduler table by --weighting_scheme)",
        "sigmoid_scale": "scale of the normal draw for sigmoid / shift / flux_shift",
        "logit_mean": "--weighting_scheme logit_normal (with --timestep_sampling sigma): mean",
        "logit_std": "--weighting_scheme logit_normal (with --timestep_sampling sigma): standard deviation",
    }
    sampling = existing.get("timestep_sampling")
    if sampling is not None:
        sampling.choices, sampling.default, sampling.help = list(TIMESTEP_SAMPLINGS), "shift", helps[sampling.dest]
    g = parser.add_argument_group("flow matching (Lumina 2)", "sd-scripts' Lumina 2 objective")
    if sampling is None:
        g.add_argument("--timestep_sampling", type=str, default="shift", choices=list(TIMESTEP_SAMPLINGS),
                       help=helps["timestep_sampling"])  # fmt: skip
    for name, default in (("sigmoid_scale", 1.0), ("logit_mean", 0.0), ("logit_std", 1.0)):
        if name in existing:
            existing[name].help = helps[name]
        else:
            g.add_argument(f"--{name}", type=float, default=default, help=helps[name])
    g.add_argument("--discrete_flow_shift", type=float, default=6.0,
                   help="shift S of --timestep_sampling shift and of the σ table (default 6.0)")  # fmt: skip
    if "weighting_scheme" not in existing:
        g.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES),
                       help="sigma: the law of the table index; with sigma_scaled: the loss weight per sample")  # fmt: skip
    if "mode_scale" not in existing:
        g.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")
    g.add_argument("--model_prediction_type", type=str, default="raw", choices=list(MODEL_PREDICTION_TYPES),
                   help="what is compared with the target x0 - ε: raw (the output; default), additive (output + x_σ), "
                   "sigma_scaled (x_σ - σ output)")  # fmt: skip
    return parser


@dataclass(frozen=True)
class LuminaFlowConfig:
    """Lumina 2's objective settings (names and defaults = sd-scripts' flags). ``ConfigError`` lists every bad one."""

    timestep_sampling: str = "shift"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 6.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    model_prediction_type: str = "raw"
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False

    def __post_init__(self) -> None:
        errors = choice_error("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLINGS)
        errors += choice_error("model_prediction_type", self.model_prediction_type, MODEL_PREDICTION_TYPES)
        errors += fm.weighting_problems(self)
        for flag in ("sigmoid_scale", "discrete_flow_shift"):
            value = getattr(self, flag)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"--{flag} must be a finite number > 0, got {value}")
        if self.ip_noise_gamma is not None and not self.ip_noise_gamma >= 0:
            errors.append(f"--ip_noise_gamma must be >= 0 (around 0.1 is usual), got {self.ip_noise_gamma}")
        if errors:
            raise ConfigError(errors, "Lumina 2 flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LuminaFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def lumina_mu(latent_height: int, latent_width: int) -> float:
    """μ of the resolution time-shift for (h, w) latents: linear in ``(h // 2) (w // 2)`` through
    :data:`SHIFT_POINTS` (sd-scripts' ``get_lin_function(y1=0.5, y2=1.15)``)."""
    (x1, y1), (x2, y2) = SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((latent_height // 2) * (latent_width // 2)) + (y1 - slope * x1)


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


@dataclass(frozen=True, eq=False)
class LuminaFlowObjective:
    """sd-scripts' Lumina 2 objective (module docstring): target x0 − ε, ``timesteps`` = 1000 σ for ``predict``."""

    cfg: LuminaFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> Example:  # fmt: skip
        size = tuple(latents.shape[-2:])
        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(
            latents, generator, timesteps, lambda b, gen, device: sample_sigmas(self.cfg, b, size, gen, device)
        )
        c = self.cfg
        noisy = fm.noisy_input(latents, noise, sigmas, generator, ip_noise_gamma=c.ip_noise_gamma,
                               ip_noise_gamma_random_strength=c.ip_noise_gamma_random_strength)  # fmt: skip
        return Example(noisy.to(latents.dtype), -fm.flow_target(latents, noise), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The network's own output o = −(``predict``'s velocity), then ``--model_prediction_type``."""
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type(self.cfg.model_prediction_type, -output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        if self.cfg.model_prediction_type != "sigma_scaled":
            return None
        weight = fm.loss_weighting(self.cfg.weighting_scheme, example.sigmas)
        return None if weight is None else weight.view(-1, 1, 1, 1)

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        return fm.flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[None]:
        """Four passes drawing σ as in training (sd-scripts' flow validation)."""
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' Lumina objective keys (``lumina_train_network.py: update_metadata``)."""
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_timestep_sampling": c.timestep_sampling, "ss_sigmoid_scale": c.sigmoid_scale,
                "ss_model_prediction_type": c.model_prediction_type,
                "ss_discrete_flow_shift": c.discrete_flow_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> LuminaFlowObjective:
        return self


def lumina_objective(title: str, cfg: LuminaFlowConfig, noise: NoiseConfig, loss: LossConfig) -> LuminaFlowObjective:
    """The run's objective; one warning naming the DDPM-only flags it ignores (as sd-scripts ignores them)."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss))
    return LuminaFlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
