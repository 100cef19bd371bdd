"""musubi-tuner's rectified flow (``training/trainer_base.py: get_noisy_model_input_and_timesteps`` and each
trainer's ``call_dit``), shared by the families musubi-tuner trains: the t laws, the settings and their checks, the
example and the loss, on the shared flow math (:mod:`library.objectives.flow`). A family supplies its
:class:`MusubiFlowLaws` (its title, its resolution-dependent shifts by name, the names it refuses, its hint) on a
subclass of :class:`MusubiFlowConfig`, and names its objective a subclass of :class:`MusubiFlowObjective`.

One example, in musubi-tuner's draw order: ε ~ N(0, I) shaped like the latents; t (B,) by ``--timestep_sampling``:
``uniform`` U(0, 1); ``sigmoid`` sigmoid(s·N(0, 1)); ``shift`` the sigmoid draw shifted by S = ``--discrete_flow_shift``
(t' = S t / (1 + (S − 1) t)); a family's resolution-dependent shifts (musubi-tuner's ``flux_shift``, ``qwen_shift``,
``flux2_shift``) the same with S = e^μ, μ linear in the sequence length (h/p)(w/p) through two (length, μ) points
(:class:`~library.objectives.flow.ShiftLine`); ``logsnr`` sigmoid(−λ/2), λ ~ N(``--logit_mean``, ``--logit_std``²);
then scaled into [``--min_timestep``, ``--max_timestep``] / 1000. x_t = (1 − t) x0 + t ε; target ε − x0; the timesteps the family's
``predict`` gets are 1000 t + 1, as musubi-tuner adds 1 to the timesteps before ``call_dit`` divides them by 1000.
Loss: MSE, weight 1 (``--weighting_scheme none``, musubi-tuner's default and its documented choice).

``sigma`` (musubi-tuner's default) takes its own way: u by ``--weighting_scheme`` (none / uniform: U(0, 1),
logit_normal, mode), the table index ⌊u (max − min) + min⌋ of ``--min_timestep`` / ``--max_timestep`` (default 0 /
1000), σ = (1000 − index) / 1000 from its training scheduler's table (``FlowMatchDiscreteScheduler``, whose training
table is not shifted: ``--discrete_flow_shift`` does not act here, as in musubi-tuner), and the timesteps are 1000 σ
(no + 1 on this path).

Refused with a message (not implemented here): the family's refused laws (``qinglong_*`` and others);
``--weighting_scheme sigma_sqrt / cosmap``; ``--preserve_distribution_shape``, ``--num_timestep_buckets``.
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
from .flow import ShiftLine
from .losses import LossConfig
from .noising import NoiseConfig

WEIGHTINGS = ("none", "uniform", "logit_normal", "mode")  # weight 1 (musubi-tuner's compute_loss_weighting_for_sd3)


@dataclass(frozen=True)
class MusubiFlowLaws:
    """What a family adds to musubi-tuner's shared objective: ``title`` (for messages), ``lines`` (its
    resolution-dependent shifts by ``--timestep_sampling`` name, in the order of the choices), ``refused`` (the
    laws musubi-tuner has that are refused here), ``hint`` (the flag to use instead of a refused shift) and
    ``lines_help`` (the resolution shifts' part of the ``--timestep_sampling`` help)."""

    title: str
    lines: dict[str, ShiftLine]
    refused: tuple[str, ...]
    hint: str
    lines_help: str

    @property
    def samplings(self) -> tuple[str, ...]:
        return ("sigma", "uniform", "sigmoid", "shift", *self.lines, "logsnr")

    def problems(self, title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
        """The flags no flow objective trains with (:func:`library.objectives.flow.flow_problems`)."""
        return fm.flow_problems(title, noise, loss, self.hint)

    def add_args(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """musubi-tuner's objective flags with this family's ``--timestep_sampling`` choices."""
        return add_musubi_flow_args(parser, self)


def add_musubi_flow_args(parser: argparse.ArgumentParser, laws: MusubiFlowLaws) -> argparse.ArgumentParser:
    """musubi-tuner's objective flags with its defaults; ``--timestep_sampling`` gets the family's choices."""
    existing = {action.dest: action for action in parser._actions}
    choices = list(laws.samplings + laws.refused)
    help_ = (f"t law (musubi-tuner): sigma (default: its scheduler table, unshifted), uniform, sigmoid, shift (sigmoid "
             f"then --discrete_flow_shift), {laws.lines_help}, logsnr; qinglong_* and the other shifts are refused")  # fmt: skip
    g = parser.add_argument_group(f"flow matching ({laws.title})", "musubi-tuner's rectified flow")
    if "timestep_sampling" in existing:
        a = existing["timestep_sampling"]
        a.choices, a.default, a.help = choices, "sigma", help_
    else:
        g.add_argument("--timestep_sampling", type=str, default="sigma", choices=choices, help=help_)
    if "sigmoid_scale" not in existing:
        g.add_argument("--sigmoid_scale", type=float, default=1.0, help="scale of the normal draw (default 1.0)")
    if "discrete_flow_shift" in existing:
        existing["discrete_flow_shift"].default = 1.0
    else:
        g.add_argument("--discrete_flow_shift", type=float, default=1.0, help="shift S of --timestep_sampling shift")
    if "weighting_scheme" in existing:
        existing["weighting_scheme"].default = "none"
    else:
        fm.add_weighting_args(g, set(existing), "the loss weight: none (default) / uniform / logit_normal / mode: 1")
        next(a for a in parser._actions if a.dest == "weighting_scheme").default = "none"
    if "preserve_distribution_shape" not in existing:
        g.add_argument("--preserve_distribution_shape", action="store_true",
                       help="musubi-tuner's rejection sampling; refused here")  # fmt: skip
    if "num_timestep_buckets" not in existing:
        g.add_argument("--num_timestep_buckets", type=int, default=None,
                       help="musubi-tuner's stratified draws; refused here")  # fmt: skip
    return parser


@dataclass(frozen=True)
class MusubiFlowConfig:
    """musubi-tuner's objective settings (its flag names and defaults); a family's subclass sets ``laws``.

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    laws: ClassVar[MusubiFlowLaws]

    timestep_sampling: str = "shift"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 1.0
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    min_timestep: float | None = None
    max_timestep: float | None = None
    preserve_distribution_shape: bool = False
    num_timestep_buckets: int | None = None

    def __post_init__(self) -> None:
        errors, title = [], self.laws.title
        if self.timestep_sampling in self.laws.refused:
            errors.append(f"--timestep_sampling {self.timestep_sampling} is not supported for {title} yet (musubi-"
                          f"tuner's default is sigma); use {self.laws.hint}")  # fmt: skip
        else:
            errors += fm.choice_error("timestep_sampling", self.timestep_sampling, self.laws.samplings)
        if self.weighting_scheme not in WEIGHTINGS:
            errors.append(f"--weighting_scheme {self.weighting_scheme} is not supported for {title} yet; use "
                          "--weighting_scheme none (musubi-tuner's default and documented choice)")  # fmt: skip
        for flag in ("sigmoid_scale", "discrete_flow_shift"):
            value = getattr(self, flag)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"--{flag} must be a finite number > 0, got {value}")
        lo, hi = self.t_range()
        if not 0 <= lo < hi <= 1:
            errors.append(f"--min_timestep / --max_timestep must satisfy 0 <= min < max <= 1000, got {self.min_timestep}"
                          f" / {self.max_timestep}")  # fmt: skip
        if self.preserve_distribution_shape:
            errors.append(f"--preserve_distribution_shape is not supported for {title} yet; drop it (the draws are "
                          "scaled into [--min_timestep, --max_timestep] instead)")  # fmt: skip
        if self.num_timestep_buckets not in (None, 0, 1):
            errors.append(f"--num_timestep_buckets is not supported for {title} yet; drop it")
        if errors:
            raise ConfigError(errors, f"{title} flow-matching settings")

    def t_range(self) -> tuple[float, float]:
        lo = 0.0 if self.min_timestep is None else float(self.min_timestep)
        hi = 1000.0 if self.max_timestep is None else float(self.max_timestep)
        return lo / 1000.0, hi / 1000.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MusubiFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def sample_t(cfg: MusubiFlowConfig, batch: int, size: tuple[int, int], generator: torch.Generator | None,
             device: torch.device | str = "cpu") -> Tensor:  # fmt: skip
    """t (B,) float32 by ``cfg.timestep_sampling`` (module docstring), scaled into the timestep range; ``size``: the
    latents' (h, w)."""
    draw = fm.draw_device(generator)
    kind = cfg.timestep_sampling
    if kind == "sigma":  # the scheduler table's index (module docstring), no scaling into the range afterwards
        lo, hi = (round(v * 1000) for v in cfg.t_range())
        index = (fm.table_density(cfg, batch, generator) * (hi - lo) + lo).long()
        return torch.linspace(1, 0, 1001)[index.cpu()].to(device)  # musubi-tuner's table, to the bit
    if kind == "uniform":
        t = torch.rand((batch,), generator=generator, device=draw)
    elif kind == "logsnr":
        logsnr = cfg.logit_mean + cfg.logit_std * torch.randn((batch,), generator=generator, device=draw)
        t = torch.sigmoid(-logsnr / 2)
    else:
        t = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch,), generator=generator, device=draw))
        if kind != "sigmoid":
            shift = cfg.discrete_flow_shift if kind == "shift" else math.exp(cfg.laws.lines[kind].mu(*size))
            t = (t * shift) / (1 + (shift - 1) * t)
    lo, hi = cfg.t_range()
    return (t * (hi - lo) + lo).to(device)


@dataclass(frozen=True, eq=False)
class MusubiFlowObjective:
    """The objective of a musubi-tuner family's run (module docstring); a family names its own subclass."""

    cfg: MusubiFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_run(cls, title: str, cfg: MusubiFlowConfig, noise: NoiseConfig, loss: LossConfig) -> Self:
        """The run's objective; one warning naming the DDPM-only flags it ignores (``--min_timestep`` /
        ``--max_timestep`` are read: musubi-tuner scales t into the range)."""
        names = tuple(n for n in fm.DDPM_ONLY_NOISE_FLAGS if n not in ("min_timestep", "max_timestep"))
        fm.warn_ignored(title, fm.ignored_flags(noise, loss, names))
        return cls(cfg, loss)

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> Example:  # fmt: skip
        """ε, t (drawn, or ``(timesteps − 1) / 1000``), x_t, target ε − x0; ``timesteps`` = 1000 t + 1 (what the
        family's ``predict`` divides by 1000, as musubi-tuner)."""
        size = tuple(latents.shape[-2:])
        offset = 0 if self.cfg.timestep_sampling == "sigma" else 1  # musubi-tuner adds 1 on its other path only

        def sample(b: int, gen: torch.Generator | None, device: Any) -> tuple[Tensor, Tensor]:
            t = sample_t(self.cfg, b, size, gen, device)
            return t, t * 1000 + offset

        if timesteps is not None:
            timesteps = timesteps.to(latents.device, torch.float32) - offset
        noise, sigmas, steps = fm.draw_noise_and_sigmas(latents, generator, timesteps, sample)
        if timesteps is not None:
            steps = steps + offset
        t = sigmas.view(-1, 1, 1, 1).to(latents.device)
        noisy = (1 - t) * latents.float() + t * noise
        return Example(noisy.to(latents.dtype), fm.flow_target(latents, noise), steps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        return output

    def weighting(self, example: Example) -> Tensor | None:
        return None

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        return fm.flow_loss(self.loss, None, pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[None]:
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        return fm.flow_metadata(self.cfg, *fm.FLOW_METADATA, "discrete_flow_shift")

    def to(self, device: torch.device | str) -> MusubiFlowObjective:
        return self
