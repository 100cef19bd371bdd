"""FLUX.1 / Chroma's objective: rectified flow with sd-scripts' FLUX.1 meanings, its flags and their reader.

The shared flow math is ``library/objectives/flow.py`` (x_σ = (1 - σ) x0 + σ ε, target ε - x0). One example is built
in sd-scripts' order (``flux_train_network.py: get_noise_pred_and_target`` and ``library/flux_train_utils.py:
get_noisy_model_input_and_timesteps``), by :func:`sample_sigmas` and ``flow.noisy_input``:

1. ``ε ~ N(0, I)`` shaped like the latents (B, C, H, W) (no noise offset / pyramid noise: sd-scripts ignores them);
2. σ (B,) by ``--timestep_sampling`` (below), and ``timesteps = 1000 σ`` (float: what the model receives; FLUX's
   own forward divides it by 1000 again);
3. input perturbation (``--ip_noise_gamma``): ``ξ ~ N(0, I)`` (then ``γ ~ U(0, ip_noise_gamma)`` with
   ``--ip_noise_gamma_random_strength``), and ``x_σ = (1 - σ) x0 + σ (ε + γ ξ)``; the target keeps ε;
4. the model output o is turned into what is compared with the target (``--model_prediction_type``):
   ``raw``: o; ``additive``: o + x_σ; ``sigma_scaled`` (sd-scripts' default): x_σ - σ o (an x0 estimate, compared
   with the velocity target all the same: sd-scripts' docs recommend ``raw``);
5. with ``sigma_scaled`` only, a per-sample loss weight from ``--weighting_scheme`` (``flow.loss_weighting``).

``--timestep_sampling`` (σ laws; z ~ N(0, 1), u ~ U(0, 1), s = ``--sigmoid_scale``, S = ``--discrete_flow_shift``):

* ``sigma`` (default): ``u'`` from ``--weighting_scheme`` (``logit_normal``: sigmoid(N(logit_mean, logit_std));
  ``mode``: ``1 - u - mode_scale (cos²(πu/2) - 1 + u)``; else u), index ``i = floor(1000 u')``, and σ / timestep
  the i-th entry of the shifted table of ``FlowMatchEulerDiscreteScheduler(1000, shift=S)``: ``σ_i = S s_i / (1 +
  (S - 1) s_i)``, ``s_i = (1000 - i) / 1000`` (``flow.sigma_table``);
* ``uniform``: σ = u; ``sigmoid``: σ = sigmoid(s z) (x-flux);
* ``shift``: σ = S v / (1 + (S - 1) v) with v = sigmoid(s z);
* ``flux_shift``: σ = e^μ / (e^μ + 1/v - 1), v = sigmoid(s z), μ linear in the packed token count (h/2)(w/2):
  0.5 at 256 tokens, 1.15 at 4096 (FLUX.1's resolution-dependent shift).

All randomness comes from one ``torch.Generator`` argument, drawn on its device in sd-scripts' order (ε, the σ
draw, ξ, γ), so the same generator state gives sd-scripts' values on the same draws.
"""

from __future__ import annotations

import argparse
import logging
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

logger = logging.getLogger(__name__)

FLOW_TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
# FLUX.1's resolution-dependent shift: mu is linear in the image token count, through these two points
FLUX_SHIFT_POINTS = ((256, 0.5), (4096, 1.15))
SHIFT_HINT = "--timestep_sampling shift with --discrete_flow_shift (or flux_shift)"


def add_flow_matching_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' FLUX.1 objective flags on a training parser; read into :class:`FlowMatchingConfig` (same names).

    The shared ``--timestep_sampling`` flag of the noise group (SD: uniform | logit_normal | sigmoid) takes the flow
    choices and default (``sigma``); ``--sigmoid_scale``, ``--logit_mean`` and ``--logit_std`` are kept (same
    defaults as sd-scripts) or added when the parser has no noise group. Returns the parser.
    """
    existing = {action.dest: action for action in parser._actions}
    sampling = existing.get("timestep_sampling")
    helps = {
        "timestep_sampling": "σ law: sigma (the shifted scheduler table, drawn by --weighting_scheme), uniform, "
        "sigmoid (of N(0, sigmoid_scale²)), shift (sigmoid then --discrete_flow_shift), flux_shift (resolution-"
        "dependent, FLUX.1)",
        "sigmoid_scale": "scale of the normal draw for sigmoid / shift / flux_shift",
        "logit_mean": "--weighting_scheme logit_normal (with --timestep_sampling sigma): mean",
        "logit_std": "--weighting_scheme logit_normal (with --timestep_sampling sigma): standard deviation",
    }
    if sampling is not None:
        sampling.choices, sampling.default, sampling.help = list(FLOW_TIMESTEP_SAMPLINGS), "sigma", helps[sampling.dest]
    g = parser.add_argument_group("flow matching", "the flow-matching objective (sd-scripts' FLUX.1 meanings)")
    if sampling is None:
        g.add_argument("--timestep_sampling", type=str, default="sigma", choices=list(FLOW_TIMESTEP_SAMPLINGS),
                       help=helps["timestep_sampling"])  # fmt: skip
    for name, default in (("sigmoid_scale", 1.0), ("logit_mean", 0.0), ("logit_std", 1.0)):
        if name in existing:
            existing[name].help = helps[name]
        else:
            g.add_argument(f"--{name}", type=float, default=default, help=helps[name])
    g.add_argument("--discrete_flow_shift", type=float, default=3.0,
                   help="shift S of the σ table (sigma) and of --timestep_sampling shift (default 3.0)")  # fmt: skip
    g.add_argument(
        "--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES),
        help="sigma: the law of the table index (logit_normal, mode, else uniform); with sigma_scaled: loss weight "
        "per sample (sigma_sqrt σ^-2, cosmap, else 1). uniform and none are the same",
    )  # fmt: skip
    g.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")
    g.add_argument(
        "--model_prediction_type", type=str, default="sigma_scaled", choices=list(MODEL_PREDICTION_TYPES),
        help="what is compared with the target ε - x0: raw (the output), additive (output + x_σ), sigma_scaled "
        "(x_σ - σ output; sd-scripts' default, its docs recommend raw)",
    )  # fmt: skip
    return parser


@dataclass(frozen=True)
class FlowMatchingConfig:
    """FLUX.1's flow-matching settings; field names and defaults are sd-scripts' FLUX.1 flags (without ``--``).

    Raises:
        ConfigError: listing every bad field at once, each naming its flag.
    """

    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    model_prediction_type: str = "sigma_scaled"
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False

    def __post_init__(self) -> None:
        errors = _config_errors(self)
        if errors:
            raise ConfigError(errors, "flow-matching settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FlowMatchingConfig:
        """The same-named flags of a parser built with :func:`add_flow_matching_args`."""
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def _config_errors(cfg: FlowMatchingConfig) -> list[str]:
    errors = choice_error("timestep_sampling", cfg.timestep_sampling, FLOW_TIMESTEP_SAMPLINGS)
    errors += choice_error("weighting_scheme", cfg.weighting_scheme, WEIGHTING_SCHEMES)
    errors += choice_error("model_prediction_type", cfg.model_prediction_type, MODEL_PREDICTION_TYPES)
    for flag in ("sigmoid_scale", "discrete_flow_shift", "logit_std"):
        value = getattr(cfg, flag)
        if not (value > 0 and math.isfinite(value)):
            errors.append(f"--{flag} must be a finite number > 0, got {value}")
    for flag in ("logit_mean", "mode_scale"):
        if not math.isfinite(getattr(cfg, flag)):
            errors.append(f"--{flag} must be finite, got {getattr(cfg, flag)}")
    if cfg.ip_noise_gamma is not None and not cfg.ip_noise_gamma >= 0:
        errors.append(f"--ip_noise_gamma must be >= 0 (around 0.1 is usual), got {cfg.ip_noise_gamma}")
    return errors


def flux_mu(latent_height: int, latent_width: int) -> float:
    """FLUX.1's shift μ for latents of (h, w) (before 2x2 packing): linear in ``(h // 2) (w // 2)`` tokens through
    :data:`FLUX_SHIFT_POINTS` (sd-scripts ``get_lin_function``; BFL's ``get_schedule``)."""
    (x1, y1), (x2, y2) = FLUX_SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((latent_height // 2) * (latent_width // 2)) + (y1 - slope * x1)


def sample_sigmas(
    cfg: FlowMatchingConfig,
    batch_size: int,
    latent_size: tuple[int, int],
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)``, each (B,) float32 on ``device``, by ``cfg.timestep_sampling`` (module docstring).

    ``latent_size``: (h, w) of the unpacked latents (``flux_shift`` only). Table indices of ``sigma`` are clamped
    to [0, 999] (sd-scripts indexes out of range when a logit-normal draw rounds to 1.0, or for ``mode`` with a
    ``mode_scale`` that leaves [0, 1]).
    """
    draw = fm.draw_device(generator)
    kind, n = cfg.timestep_sampling, NUM_TRAIN_TIMESTEPS
    if kind == "sigma":
        sigmas_table, timesteps_table = fm.sigma_table(cfg.discrete_flow_shift)
        u = fm.table_density(cfg, batch_size, generator)
        index = (u * n).long().clamp(0, n - 1).cpu()
        sigmas, timesteps = sigmas_table[index], timesteps_table[index]
    elif kind == "uniform":
        sigmas = torch.rand((batch_size,), generator=generator, device=draw)
        timesteps = sigmas * n
    elif kind in ("sigmoid", "shift", "flux_shift"):
        sigmas = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch_size,), generator=generator, device=draw))
        if kind == "shift":
            sigmas = fm.shift_sigmas(sigmas, cfg.discrete_flow_shift)
        elif kind == "flux_shift":
            sigmas = fm.time_shift(flux_mu(*latent_size), sigmas)
        timesteps = sigmas * n
    else:
        raise ValueError(f"--timestep_sampling must be one of {', '.join(FLOW_TIMESTEP_SAMPLINGS)}, got {kind!r}")
    return sigmas.to(device), timesteps.to(device)


@dataclass(frozen=True, eq=False)
class FlowMatchingObjective:
    """Rectified flow with sd-scripts' FLUX.1 meanings (this module, ``library.objectives.flow``): x_σ = (1 - σ) x0 + σ ε, target
    ε - x0, ``timesteps`` = 1000 σ (float) for the family's ``predict``, ``--model_prediction_type`` on the output,
    ``--weighting_scheme`` per sample with sigma_scaled; the loss is ``--loss_type`` (huber schedules constant /
    exponential on 1000 σ), mask and prior weights, with no SNR weighting (sd-scripts' FLUX ``post_process_loss``)."""

    cfg: FlowMatchingConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)  # e.g. FLUX.1-dev's {"guidance": 3.5}

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """``timesteps`` given (B,): σ = timesteps / 1000 for every sample, no σ draw."""
        size = tuple(latents.shape[-2:])
        noise, sigmas, timesteps = fm.draw_noise_and_sigmas(
            latents, generator, timesteps, lambda batch, gen, device: sample_sigmas(self.cfg, batch, size, gen, device)
        )
        c = self.cfg
        noisy = fm.noisy_input(latents, noise, sigmas, generator, ip_noise_gamma=c.ip_noise_gamma,
                               ip_noise_gamma_random_strength=c.ip_noise_gamma_random_strength)  # fmt: skip
        return Example(noisy.to(latents.dtype), fm.flow_target(latents, noise), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """``--model_prediction_type``: raw o, additive o + x_σ, sigma_scaled x_σ - σ o."""
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type(self.cfg.model_prediction_type, output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        """(B, 1, 1, 1) loss weight per sample from ``--weighting_scheme`` (sigma_scaled only, as sd-scripts), or
        None for 1."""
        if self.cfg.model_prediction_type != "sigma_scaled":
            return None
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

    def validation_timesteps(self) -> list[None]:
        """Four passes, each drawing σ as in training: what sd-scripts' FLUX validation does (its loop sets
        ``min_timestep = max_timestep`` to 200/400/600/800 per pass, which only the DDPM path reads; the flow path
        ignores them). The validation generators are seeded, so the value is deterministic for given weights."""
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' FLUX objective keys (``flux_train_network.py: update_metadata``)."""
        c = self.cfg
        return {
            "ss_weighting_scheme": c.weighting_scheme,
            "ss_logit_mean": c.logit_mean,
            "ss_logit_std": c.logit_std,
            "ss_mode_scale": c.mode_scale,
            "ss_timestep_sampling": c.timestep_sampling,
            "ss_sigmoid_scale": c.sigmoid_scale,
            "ss_model_prediction_type": c.model_prediction_type,
            "ss_discrete_flow_shift": c.discrete_flow_shift,
        }

    def to(self, device: torch.device | str) -> FlowMatchingObjective:
        """Itself: its σ table is built on the host per draw (1000 entries)."""
        return self


SIGMA_SCALED_WARNING = (
    "--model_prediction_type sigma_scaled (sd-scripts' default, kept so command lines train as they did) compares "
    "x_σ - σ·output, an x0 estimate, with the velocity target ε - x0; sd-scripts' docs recommend "
    "--model_prediction_type raw"
)


def flow_matching_objective(
    title: str,
    cfg: FlowMatchingConfig,
    noise: NoiseConfig,
    loss: LossConfig,
    predict_options: dict[str, Any] | None = None,
) -> FlowMatchingObjective:
    """The FLUX.1 flow-matching objective of a run: ``cfg`` (the script's flow flags) with ``loss``;
    ``predict_options``: what every training step gives the family's ``predict`` (FLUX.1-dev's guidance).

    Warns once naming the DDPM-only flags flow matching ignores (as sd-scripts, which ignores them silently), and
    once for ``--model_prediction_type sigma_scaled``. The settings it refuses are :func:`objective_problems`'."""
    fm.warn_ignored(title, fm.ignored_flags(noise, loss))
    if cfg.model_prediction_type == "sigma_scaled":
        logger.warning(SIGMA_SCALED_WARNING)
    return FlowMatchingObjective(cfg, loss, predict_options=dict(predict_options or {}))


def objective_problems(title: str, noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """The run's noise / loss settings FLUX.1's objective cannot train with (before anything loads):
    ``--huber_schedule snr`` with a Huber loss and ``--timestep_shift`` (``flow.flow_problems``)."""
    return fm.flow_problems(title, noise, loss, SHIFT_HINT)
