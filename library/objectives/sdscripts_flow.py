"""sd-scripts' rectified flow with ``--model_prediction_type`` and ``--ip_noise_gamma`` (its HunyuanImage 2.1 and Lumina
2 trainers: ``get_noise_pred_and_target`` over ``get_noisy_model_input_and_timesteps`` and
``apply_model_prediction_type``), shared by the families that train it: the flags, the settings and their checks, the
example, the prediction type, the loss weight and the metadata, on the shared flow math
(:mod:`library.objectives.flow`). A family subclasses :class:`ScriptsFlowConfig` (its title, σ laws and defaults) and
:class:`ScriptsFlowObjective` (its σ draw, and whether its target is x0 − ε).

One example, in sd-scripts' order (one ``torch.Generator``): ε ~ N(0, I); σ (B,) and the timesteps by the family's
law; ξ and γ of ``--ip_noise_gamma``; x_σ = (1 − σ) x0 + σ (ε + γ ξ); target ε − x0 (or x0 − ε). The output o,
after ``--model_prediction_type`` (raw: o; additive: o + x_σ; sigma_scaled: x_σ − σ o with the
``--weighting_scheme`` loss weight), is compared with the target.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from torch import Tensor

from library.cli.problems import ConfigError

from . import flow as fm
from .base import FLOW_MATCHING, NUM_VALIDATION_TIMESTEPS, Example
from .losses import LossConfig
from .noising import NoiseConfig


def add_scripts_flow_args(parser: argparse.ArgumentParser, cfg: type[ScriptsFlowConfig], *, sampling_help: str,
                          sigmoid_help: str, target: str) -> argparse.ArgumentParser:  # fmt: skip
    """sd-scripts' flow flags on a training parser with ``cfg``'s choices and defaults (the shared
    ``--timestep_sampling`` gets them); ``sigmoid_help``: ``--sigmoid_scale``'s (the laws it acts in); ``target``:
    the target's formula, for the help. Returns the parser."""
    existing = {action.dest: action for action in parser._actions}
    helps = {
        "timestep_sampling": sampling_help,
        "sigmoid_scale": sigmoid_help,
        "logit_mean": "--weighting_scheme logit_normal (with --timestep_sampling sigma): mean",
        "logit_std": "--weighting_scheme logit_normal (with --timestep_sampling sigma): standard deviation",
    }
    default_sampling, shift = cfg.timestep_sampling, cfg.discrete_flow_shift
    sampling = existing.get("timestep_sampling")
    if sampling is not None:
        sampling.choices, sampling.default, sampling.help = list(cfg.samplings), default_sampling, sampling_help
    g = parser.add_argument_group(f"flow matching ({cfg.title})", f"sd-scripts' {cfg.title} objective")
    if sampling is None:
        g.add_argument("--timestep_sampling", type=str, default=default_sampling, choices=list(cfg.samplings),
                       help=sampling_help)  # fmt: skip
    for name, default in (("sigmoid_scale", 1.0), ("logit_mean", 0.0), ("logit_std", 1.0)):
        if name in existing:
            existing[name].help = helps[name]
        else:
            g.add_argument(f"--{name}", type=float, default=default, help=helps[name])
    if "discrete_flow_shift" not in existing:
        g.add_argument("--discrete_flow_shift", type=float, default=shift,
                       help=f"shift S of --timestep_sampling shift and of the σ table (default {shift})")  # fmt: skip
    if "weighting_scheme" not in existing:
        g.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(fm.WEIGHTING_SCHEMES),
                       help="sigma: the law of the table index; with sigma_scaled: the loss weight per sample")  # fmt: skip
    if "mode_scale" not in existing:
        g.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")
    if "model_prediction_type" not in existing:
        g.add_argument("--model_prediction_type", type=str, default="raw", choices=list(fm.MODEL_PREDICTION_TYPES),
                       help=f"what is compared with the target {target}: raw (the output; default), additive "
                       "(output + x_σ), sigma_scaled (x_σ - σ output)")  # fmt: skip
    return parser


@dataclass(frozen=True)
class ScriptsFlowConfig:
    """sd-scripts' flow settings (names and defaults = its flags); a family's subclass sets ``title``,
    ``samplings`` and its defaults. ``ConfigError`` lists every bad one."""

    title: ClassVar[str]
    samplings: ClassVar[tuple[str, ...]]

    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 5.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    model_prediction_type: str = "raw"
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False

    def __post_init__(self) -> None:
        errors = fm.choice_error("timestep_sampling", self.timestep_sampling, self.samplings)
        errors += fm.choice_error("model_prediction_type", self.model_prediction_type, fm.MODEL_PREDICTION_TYPES)
        errors += fm.weighting_problems(self)
        for flag in ("sigmoid_scale", "discrete_flow_shift"):
            value = getattr(self, flag)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"--{flag} must be a finite number > 0, got {value}")
        if self.ip_noise_gamma is not None and not self.ip_noise_gamma >= 0:
            errors.append(f"--ip_noise_gamma must be >= 0 (around 0.1 is usual), got {self.ip_noise_gamma}")
        if errors:
            raise ConfigError(errors, f"{self.title} flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


@dataclass(frozen=True, eq=False)
class ScriptsFlowObjective:
    """sd-scripts' flow objective (module docstring); a family's subclass draws σ (:meth:`sample_sigmas`) and sets
    ``negated`` where its target is x0 − ε (the network's output is then −(``predict``'s velocity))."""

    negated: ClassVar[bool] = False

    cfg: ScriptsFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_run(cls, title: str, cfg: ScriptsFlowConfig, noise: NoiseConfig, loss: LossConfig) -> Self:
        """The run's objective; one warning naming the DDPM-only flags it ignores (as sd-scripts ignores them)."""
        fm.warn_ignored(title, fm.ignored_flags(noise, loss))
        return cls(cfg, loss)

    def sample_sigmas(self, batch: int, size: tuple[int, int], generator: torch.Generator | None,
                      device: Any) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(sigmas, timesteps)`` (B,) on ``device`` by the family's law; ``size``: the latents' (h, w)."""
        raise NotImplementedError

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> Example:  # fmt: skip
        size = tuple(latents.shape[-2:])
        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(
            latents, generator, timesteps, lambda b, gen, device: self.sample_sigmas(b, size, gen, device)
        )
        c = self.cfg
        noisy = fm.noisy_input(latents, noise, sigmas, generator, ip_noise_gamma=c.ip_noise_gamma,
                               ip_noise_gamma_random_strength=c.ip_noise_gamma_random_strength)  # fmt: skip
        target = fm.flow_target(latents, noise)
        return Example(noisy.to(latents.dtype), -target if self.negated else target, timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The network's own output (negated where the target is), then ``--model_prediction_type``."""
        noisy = example.noisy.to(output.device, output.dtype)
        own = -output if self.negated else output
        return fm.apply_model_prediction_type(self.cfg.model_prediction_type, own, noisy, example.sigmas)

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
        """sd-scripts' objective keys (its trainers' ``update_metadata``)."""
        return fm.flow_metadata(self.cfg, *fm.FLOW_METADATA, "model_prediction_type", "discrete_flow_shift")

    def to(self, device: torch.device | str) -> Self:
        return self
