"""Z-Image's objective: rectified flow with musubi-tuner's meanings (``training/trainer_base.py:
get_noisy_model_input_and_timesteps`` and ``zimage_train_network.py: call_dit``), on the shared flow math.

One example, in musubi-tuner's draw order: ε ~ N(0, I) shaped like the latents; t (B,) by ``--timestep_sampling``
(the laws musubi-tuner's trainer shares across its families, as Z-Image's objective draws them): ``uniform`` U(0,
1); ``sigmoid`` sigmoid(s·N(0, 1)); ``shift`` the sigmoid draw shifted by S = ``--discrete_flow_shift`` (t' = S t /
(1 + (S − 1) t)); ``flux_shift`` / ``qwen_shift`` the same with S = e^μ, μ linear in the packed sequence length
(FLUX.1: (256, 0.5)–(4096, 1.15); Z-Image: (256, 0.5)–(8192, 0.9)); ``logsnr`` sigmoid(−λ/2), λ ~
N(``--logit_mean``, ``--logit_std``²); then scaled into [``--min_timestep``, ``--max_timestep``] / 1000. x_t = (1 − t)
x0 + t ε; timesteps 1000 t + 1 (musubi-tuner adds 1); the DiT is given τ = (1000 − timesteps) / 1000 (Z-Image's time
runs from noise 0 to image 1) and predicts x0 − ε (musubi-tuner's target ``latents - noise``). The family's
``predict`` negates it, so the target here is the usual velocity ε − x0: the loss (MSE, weight 1 with
``--weighting_scheme none``) is musubi-tuner's.

``sigma`` (musubi-tuner's default): u by ``--weighting_scheme``, the index ⌊u (max − min) + min⌋ into its scheduler's
unshifted table, σ = (1000 − index) / 1000, timesteps 1000 σ (no + 1 on this path).

Copied from library/families/qwen_image/objective.py (the t laws, the config and the example: musubi-tuner's one
shared trainer code; family folders cannot import each other): keep the two equal, or move them into
library/objectives/ together.

Refused with a message (not implemented here): ``qinglong_*``, ``flux2_shift``, ``krea2_shift``, ``ideogram4_shift``;
``--weighting_scheme sigma_sqrt / cosmap``; ``--preserve_distribution_shape``, ``--num_timestep_buckets``.
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
from library.objectives.flow import choice_error
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "logsnr")
NOT_DONE_SAMPLINGS = ("qinglong_flux", "qinglong_qwen", "flux2_shift", "krea2_shift", "ideogram4_shift")
WEIGHTINGS = ("none", "uniform", "logit_normal", "mode")  # weight 1 (musubi-tuner's compute_loss_weighting_for_sd3)
FLUX_POINTS = ((256, 0.5), (4096, 1.15))
QWEN_POINTS = ((256, 0.5), (8192, 0.9))
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (musubi-tuner's documented 2.0)"


def add_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """musubi-tuner's objective flags with its defaults; ``--timestep_sampling`` gets its choices."""
    existing = {action.dest: action for action in parser._actions}
    choices = list(TIMESTEP_SAMPLINGS + NOT_DONE_SAMPLINGS)
    help_ = ("t law (musubi-tuner): sigma (default: its scheduler table, unshifted), uniform, sigmoid, shift (sigmoid "
             "then --discrete_flow_shift), flux_shift, qwen_shift (resolution-dependent shift), logsnr; qinglong_* "
             "and the other shifts are refused")  # fmt: skip
    g = parser.add_argument_group("flow matching (Z-Image)", "musubi-tuner's rectified flow")
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
    for flag, kind, default, text in (
        ("--preserve_distribution_shape", "store_true", None, "musubi-tuner's rejection sampling; refused here"),
        ("--num_timestep_buckets", None, None, "musubi-tuner's stratified draws; refused here"),
    ):  # fmt: skip
        if flag[2:] not in existing:
            if kind:
                g.add_argument(flag, action=kind, help=text)
            else:
                g.add_argument(flag, type=int, default=default, help=text)
    return parser


@dataclass(frozen=True)
class ZImageFlowConfig:
    """Z-Image's objective settings (musubi-tuner's flag names and defaults).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

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
        errors = []
        if self.timestep_sampling in NOT_DONE_SAMPLINGS:
            errors.append(f"--timestep_sampling {self.timestep_sampling} is not supported for Z-Image yet (musubi-"
                          f"tuner's default is sigma); use {SHIFT_HINT}")  # fmt: skip
        else:
            errors += choice_error("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLINGS)
        if self.weighting_scheme not in WEIGHTINGS:
            errors.append(f"--weighting_scheme {self.weighting_scheme} is not supported for Z-Image yet; use "
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
            errors.append("--preserve_distribution_shape is not supported for Z-Image yet; drop it (the draws are "
                          "scaled into [--min_timestep, --max_timestep] instead)")  # fmt: skip
        if self.num_timestep_buckets not in (None, 0, 1):
            errors.append("--num_timestep_buckets is not supported for Z-Image yet; drop it")
        if errors:
            raise ConfigError(errors, "Z-Image flow-matching settings")

    def t_range(self) -> tuple[float, float]:
        lo = 0.0 if self.min_timestep is None else float(self.min_timestep)
        hi = 1000.0 if self.max_timestep is None else float(self.max_timestep)
        return lo / 1000.0, hi / 1000.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ZImageFlowConfig:
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def _mu(points: tuple[tuple[int, float], tuple[int, float]], h: int, w: int) -> float:
    (x1, y1), (x2, y2) = points
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((h // 2) * (w // 2)) + (y1 - slope * x1)


def sample_t(cfg: ZImageFlowConfig, batch: int, size: tuple[int, int], generator: torch.Generator | None,
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
            shift = (
                cfg.discrete_flow_shift
                if kind == "shift"
                else math.exp(_mu(FLUX_POINTS if kind == "flux_shift" else QWEN_POINTS, *size))
            )
            t = (t * shift) / (1 + (shift - 1) * t)
    lo, hi = cfg.t_range()
    return (t * (hi - lo) + lo).to(device)


@dataclass(frozen=True, eq=False)
class ZImageFlowObjective:
    """The objective of a Z-Image run (module docstring)."""

    cfg: ZImageFlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

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
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_timestep_sampling": c.timestep_sampling, "ss_sigmoid_scale": c.sigmoid_scale,
                "ss_discrete_flow_shift": c.discrete_flow_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> ZImageFlowObjective:
        return self


def zimage_objective(title: str, cfg: ZImageFlowConfig, noise: NoiseConfig, loss: LossConfig) -> ZImageFlowObjective:
    read_here = ("min_timestep", "max_timestep")  # read by ZImageFlowConfig (musubi-tuner scales t into the range)
    names = tuple(n for n in fm.DDPM_ONLY_NOISE_FLAGS if n not in read_here)
    fm.warn_ignored(title, fm.ignored_flags(noise, loss, names))
    return ZImageFlowObjective(cfg, loss)


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
