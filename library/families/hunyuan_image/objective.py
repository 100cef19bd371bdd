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

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
SHIFT_POINTS = ((256, 0.5), (4096, 1.15))  # μ through (tokens, μ), as sd-scripts' get_lin_function defaults
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (or sigma, the default)"
DEFAULT_SHIFT = 5.0


def add_hunyuan_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' HunyuanImage objective flags on a training parser; the shared ``--timestep_sampling`` gets its
    choices and default (``sigma``). Returns the parser."""
    existing = {action.dest: action for action in parser._actions}
    helps = {
        "timestep_sampling": "σ law: sigma (the shifted scheduler table by --weighting_scheme; default), uniform, "
        "sigmoid, shift (sigmoid then --discrete_flow_shift), flux_shift (sigmoid then the resolution time-shift)",
        "sigmoid_scale": "scale of the normal draw for sigmoid / shift / flux_shift",
        "logit_mean": "--weighting_scheme logit_normal (with --timestep_sampling sigma): mean",
        "logit_std": "--weighting_scheme logit_normal (with --timestep_sampling sigma): standard deviation",
    }
    sampling = existing.get("timestep_sampling")
    if sampling is not None:
        sampling.choices, sampling.default, sampling.help = list(TIMESTEP_SAMPLINGS), "sigma", helps[sampling.dest]
    g = parser.add_argument_group("flow matching (HunyuanImage 2.1)", "sd-scripts' HunyuanImage 2.1 objective")
    if sampling is None:
        g.add_argument("--timestep_sampling", type=str, default="sigma", choices=list(TIMESTEP_SAMPLINGS),
                       help=helps["timestep_sampling"])  # fmt: skip
    for name, default in (("sigmoid_scale", 1.0), ("logit_mean", 0.0), ("logit_std", 1.0)):
        if name in existing:
            existing[name].help = helps[name]
        else:
            g.add_argument(f"--{name}", type=float, default=default, help=helps[name])
    if "discrete_flow_shift" not in existing:
        g.add_argument("--discrete_flow_shift", type=float, default=DEFAULT_SHIFT,
                       help="shift S of --timestep_sampling shift and of the σ table (default 5.0)")  # fmt: skip
    if "weighting_scheme" not in existing:
        g.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES),
                       help="sigma: the law of the table index; with sigma_scaled: the loss weight per sample")  # fmt: skip
    if "mode_scale" not in existing:
        g.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")
    if "model_prediction_type" not in existing:
        g.add_argument("--model_prediction_type", type=str, default="raw", choices=list(MODEL_PREDICTION_TYPES),
                       help="what is compared with the target ε - x0: raw (the output; default), additive (output + "
                       "x_σ), sigma_scaled (x_σ - σ output)")  # fmt: skip
    return parser


@dataclass(frozen=True)
class HunyuanFlowConfig:
    """HunyuanImage 2.1's objective settings (names and defaults = sd-scripts' flags). ``ConfigError`` lists every
    bad one."""

    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = DEFAULT_SHIFT
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
            raise ConfigError(errors, "HunyuanImage 2.1 flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HunyuanFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def flux_mu(latent_height: int, latent_width: int) -> float:
    """μ of the resolution time-shift: linear in ``(h // 2) (w // 2)`` through :data:`SHIFT_POINTS`."""
    (x1, y1), (x2, y2) = SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((latent_height // 2) * (latent_width // 2)) + (y1 - slope * x1)


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


@dataclass(frozen=True, eq=False)
class HunyuanFlowObjective:
    """sd-scripts' HunyuanImage 2.1 objective (module docstring): target ε − x0, int64 ``timesteps`` = 1000 σ."""

    cfg: HunyuanFlowConfig
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
        return Example(noisy.to(latents.dtype), fm.flow_target(latents, noise), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type(self.cfg.model_prediction_type, output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        if self.cfg.model_prediction_type != "sigma_scaled":
            return None
        weight = fm.loss_weighting(self.cfg.weighting_scheme, example.sigmas)
        return None if weight is None else weight.view(-1, 1, 1, 1)

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        return fm.flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[None]:
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_timestep_sampling": c.timestep_sampling, "ss_sigmoid_scale": c.sigmoid_scale,
                "ss_model_prediction_type": c.model_prediction_type,
                "ss_discrete_flow_shift": c.discrete_flow_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> HunyuanFlowObjective:
        return self


def hunyuan_objective(title: str, cfg: HunyuanFlowConfig, noise: NoiseConfig, loss: LossConfig) -> HunyuanFlowObjective:
    """The run's objective; one warning naming the DDPM-only flags it ignores (as sd-scripts ignores them)."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss))
    return HunyuanFlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
