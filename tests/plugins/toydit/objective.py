"""ToyDiT's objective: a rectified flow with the reversed target, its own σ law and flags, built on the shared flow math
(``library/objectives/flow.py``).

x_σ = (1 − σ) x0 + σ ε as every rectified flow (``flow.noisy_input``), but the network runs on the model time
τ = 1 − σ and is trained to predict x0 − ε, the velocity towards the data (the reversed target: Lumina-Next's
convention, arXiv:2406.18583). σ is drawn by ``--toy_sigma_law`` (``uniform``: u ~ U(0, 1); ``logit_normal``:
sigmoid(N(0, 1))) then shifted by ``--toy_shift`` S (``flow.shift_sigmas``: S u / (1 + (S − 1) u)). The family's
``predict`` returns the velocity ε − x0 the shared Euler sampler integrates (the network's output negated), so
:meth:`ReversedFlowObjective.prediction` negates it back before the loss compares it with x0 − ε. Draw order: ε,
then u (one generator).
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
from library.objectives.base import FLOW_MATCHING, Example
from library.objectives.flow import NUM_TRAIN_TIMESTEPS
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

SIGMA_LAWS = ("logit_normal", "uniform")
VALIDATION_TIMESTEPS = (250.0, 500.0, 750.0)  # 1000 σ of the validation passes
IGNORED_NOISE_FLAGS = fm.DDPM_ONLY_NOISE_FLAGS + ("ip_noise_gamma", "ip_noise_gamma_random_strength")


def add_toy_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--toy_sigma_law`` and ``--toy_shift`` (read by :class:`ToyFlowConfig`). Returns the parser."""
    g = parser.add_argument_group("flow matching (ToyDiT)", "ToyDiT's reversed-target rectified flow")
    g.add_argument("--toy_sigma_law", choices=SIGMA_LAWS, default="logit_normal",
                   help="law of the noise level σ before the shift (default logit_normal)")  # fmt: skip
    g.add_argument("--toy_shift", type=float, default=1.0,
                   help="shift S σ / (1 + (S - 1) σ) of the σ draw; > 1 trains more at high noise (default 1)")  # fmt: skip
    return parser


@dataclass(frozen=True)
class ToyFlowConfig:
    """ToyDiT's objective flags (names = flags without ``--``).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    toy_sigma_law: str = "logit_normal"
    toy_shift: float = 1.0

    def __post_init__(self) -> None:
        problems = fm.choice_error("toy_sigma_law", self.toy_sigma_law, SIGMA_LAWS)
        if not (self.toy_shift > 0 and math.isfinite(self.toy_shift)):
            problems.append(f"--toy_shift must be a finite number > 0, got {self.toy_shift}")
        if problems:
            raise ConfigError(problems, "ToyDiT flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ToyFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def draw_sigmas(cfg: ToyFlowConfig, batch: int, generator: torch.Generator | None) -> Tensor:
    """σ (B,) float32 on the generator's device: the law's unit draw, then the shift."""
    device = fm.draw_device(generator)
    if cfg.toy_sigma_law == "logit_normal":
        u = torch.sigmoid(torch.randn((batch,), generator=generator, device=device))
    else:
        u = torch.rand((batch,), generator=generator, device=device)
    return fm.shift_sigmas(u, cfg.toy_shift)


@dataclass(frozen=True, eq=False)
class ReversedFlowObjective:
    """The objective of a ToyDiT run (module docstring)."""

    cfg: ToyFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """ε, σ (drawn, or ``timesteps`` / 1000: the shared :func:`fm.draw_noise_and_sigmas`), x_σ, target x0 − ε;
        ``timesteps`` of the example = 1000 σ."""

        def sample(batch: int, gen: torch.Generator | None, device: torch.device) -> tuple[Tensor, Tensor]:
            sigmas = draw_sigmas(self.cfg, batch, gen).to(device)
            return sigmas, sigmas * NUM_TRAIN_TIMESTEPS

        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(latents, generator, timesteps, sample)
        noisy = fm.noisy_input(latents, noise, sigmas).to(latents.dtype)
        target = -fm.flow_target(latents, noise)  # x0 - ε
        return Example(noisy, target, timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The network's own estimate of x0 − ε: ``predict`` gave the velocity ε − x0, its negation."""
        return -output

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The shared flow loss (``--loss_type``, masks, prior weights), unweighted per σ."""
        return fm.flow_loss(self.loss, None, pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[float]:
        return list(VALIDATION_TIMESTEPS)

    def metadata(self) -> dict[str, Any]:
        return {"ss_toy_sigma_law": self.cfg.toy_sigma_law, "ss_toy_shift": self.cfg.toy_shift}

    def to(self, device: torch.device | str) -> ReversedFlowObjective:
        return self


def toy_objective(title: str, cfg: ToyFlowConfig, noise: NoiseConfig, loss: LossConfig) -> ReversedFlowObjective:
    """The run's objective; warns once naming the shared noise / loss flags it does not read."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss, IGNORED_NOISE_FLAGS))
    return ReversedFlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """A ``--timestep_sampling`` other than the default (σ follows ``--toy_sigma_law``), and what no flow objective
    trains with (``flow.flow_problems``)."""
    problems = []
    if noise.timestep_sampling != "uniform":
        problems.append(f"--timestep_sampling {noise.timestep_sampling} is not read by {title}'s flow matching: its σ "
                        "follows --toy_sigma_law and --toy_shift")  # fmt: skip
    return problems + fm.flow_problems(title, noise, loss, "--toy_shift")
