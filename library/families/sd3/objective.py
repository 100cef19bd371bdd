"""SD3 / SD3.5's objective: sd-scripts' SD3 flow matching (``sd3_train_network.py``, ``library/sd3_train_utils.py``),
its flags and their reader.

The shared flow math is ``library/objectives/flow.py``. A unit draw u' by ``--weighting_scheme`` (logit_normal,
mode, else uniform: ``flow.table_density``), shifted by ``--training_shift``, gives the integer timestep ``t =
floor(t_min + u' (t_max - t_min))`` in ``[--min_timestep, --max_timestep)`` and σ = t / 1000; no input perturbation;
the output is always preconditioned ``x_σ - σ o`` and compared with x0 (the clean latents), weighted by
``--weighting_scheme`` (sigma_sqrt, cosmap).
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
from library.objectives.flow import NUM_TRAIN_TIMESTEPS
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

# sd-scripts' SD3 path reads --min/max_timestep and ignores the input perturbation
IGNORED_NOISE_FLAGS = tuple(n for n in fm.DDPM_ONLY_NOISE_FLAGS if n not in ("min_timestep", "max_timestep")) + (
    "ip_noise_gamma", "ip_noise_gamma_random_strength")  # fmt: skip


def add_sd3_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' SD3 objective flags (``sd3_train_utils.add_sd3_training_arguments`` / ``add_dit_training_arguments``):
    ``--weighting_scheme --logit_mean --logit_std --mode_scale --training_shift``; read into :class:`SD3FlowConfig`
    with the shared ``--min_timestep / --max_timestep``. Returns the parser."""
    existing = {action.dest for action in parser._actions}
    g = parser.add_argument_group("flow matching (SD3)", "the SD3 flow-matching objective (sd-scripts' meanings)")
    fm.add_weighting_args(g, existing, "law of t (logit_normal, mode, else uniform) and loss weight (sigma_sqrt, "
                          "cosmap, else 1)")  # fmt: skip
    g.add_argument("--training_shift", type=float, default=1.0,
                   help="shift S u / (1 + (S - 1) u) of the timestep draw; > 1 trains more at high noise")  # fmt: skip
    return parser


@dataclass(frozen=True)
class SD3FlowConfig:
    """SD3's flow-matching settings; field names and defaults are sd-scripts' flags (without ``--``).

    Raises:
        ConfigError: listing every bad field at once, each naming its flag.
    """

    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    training_shift: float = 1.0
    min_timestep: int | None = None
    max_timestep: int | None = None

    def __post_init__(self) -> None:
        errors = fm.weighting_problems(self)
        if not (self.training_shift > 0 and math.isfinite(self.training_shift)):
            errors.append(f"--training_shift must be a finite number > 0, got {self.training_shift}")
        lo, hi = self.timestep_range
        if not 0 <= lo <= hi <= NUM_TRAIN_TIMESTEPS:
            errors.append(f"--min_timestep / --max_timestep must satisfy 0 <= min <= max <= 1000, got ({lo}, {hi})")
        if errors:
            raise ConfigError(errors, "SD3 flow-matching settings")

    @property
    def timestep_range(self) -> tuple[int, int]:
        """``(t_min, t_max)``: 0 and 1000 unless given."""
        lo = 0 if self.min_timestep is None else self.min_timestep
        return lo, NUM_TRAIN_TIMESTEPS if self.max_timestep is None else self.max_timestep

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SD3FlowConfig:
        """The same-named flags of a parser built with :func:`add_sd3_flow_args`."""
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def sample_sd3_timesteps(
    cfg: SD3FlowConfig, batch_size: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)`` (B,) float32 on ``device`` for SD3 (sd-scripts ``sd3_train_utils
    .get_noisy_model_input_and_timesteps``): u' = :func:`table_density`, shifted by ``training_shift``, ``t =
    floor(u' (t_max - t_min) + t_min)`` (integer values), σ = t / 1000."""
    u = fm.shift_sigmas(fm.table_density(cfg, batch_size, generator), cfg.training_shift)
    lo, hi = cfg.timestep_range
    timesteps = (u * (hi - lo) + lo).long().to(device=device, dtype=torch.float32)
    return timesteps / NUM_TRAIN_TIMESTEPS, timesteps


@dataclass(frozen=True, eq=False)
class SD3FlowObjective:
    """SD3's flow matching (sd-scripts' ``sd3_train_network.py``; this module): integer timesteps
    t in [min_timestep, max_timestep) by ``--weighting_scheme`` and ``--training_shift``, σ = t / 1000, x_σ = (1 - σ)
    x0 + σ ε, the output preconditioned ``x_σ - σ o`` (Karras et al. 2022, arXiv:2206.00364, section 5) and
    compared with x0, weighted by ``--weighting_scheme`` (sigma_sqrt, cosmap); no input perturbation and no SNR
    weighting (sd-scripts' SD3 path reads neither)."""

    cfg: SD3FlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """``timesteps`` given (B,): σ = timesteps / 1000 for every sample, no timestep draw."""
        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(
            latents, generator, timesteps, lambda batch, gen, device: sample_sd3_timesteps(self.cfg, batch, gen, device)
        )
        noisy = fm.noisy_input(latents, noise, sigmas).to(latents.dtype)
        return Example(noisy, latents.float(), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The x0 estimate ``x_σ - σ o``."""
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type("sigma_scaled", output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        """(B, 1, 1, 1) loss weight from ``--weighting_scheme`` (sigma_sqrt, cosmap), or None for 1."""
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
        """:func:`library.objectives.losses.weighted_loss_per_sample` with :meth:`weighting` per element."""
        return fm.flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[int]:
        """sd-scripts' fixed validation timesteps ``linspace(t_min, t_max, 6)[1:-1]`` (its SD3 path reads the
        min/max_timestep its validation loop sets)."""
        lo, hi = self.cfg.timestep_range
        points = torch.linspace(lo, hi, NUM_VALIDATION_TIMESTEPS + 2)[1:-1]
        return [int(v) for v in points.round().tolist()]

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' SD3 objective keys (``sd3_train_network.py: update_metadata``) and ``ss_training_shift``."""
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_training_shift": c.training_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> SD3FlowObjective:
        return self


def sd3_flow_objective(title: str, cfg: SD3FlowConfig, noise: NoiseConfig, loss: LossConfig) -> SD3FlowObjective:
    """SD3's flow-matching objective of a run: ``cfg`` (the script's SD3 flags, :func:`add_sd3_flow_args`) with
    ``loss``; warns once naming the DDPM-only flags it ignores (as sd-scripts, silently)."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss, IGNORED_NOISE_FLAGS))
    return SD3FlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """The run's noise / loss settings SD3's objective cannot train with (before anything loads): a
    ``--timestep_sampling`` other than the default (SD3 draws by ``--weighting_scheme`` and ``--training_shift``),
    ``--huber_schedule snr`` with a Huber loss and ``--timestep_shift`` (``flow.flow_problems``)."""
    problems = []
    if noise.timestep_sampling != "uniform":
        problems.append(
            f"--timestep_sampling {noise.timestep_sampling} is not read by SD3's flow matching: its timesteps follow "
            "--weighting_scheme (logit_normal, mode, uniform) and --training_shift"
        )
    return problems + fm.flow_problems(title, noise, loss, "--training_shift")
