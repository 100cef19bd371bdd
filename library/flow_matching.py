"""Rectified-flow (flow-matching) training examples with sd-scripts' FLUX.1 meanings (pure torch).

The forward process is the straight line between the clean latents and the noise (Liu et al. 2022, "Flow Straight
and Fast", arXiv:2209.03003; Esser et al. 2024, SD3, arXiv:2403.03206, section 2):

    x_σ = (1 - σ) x0 + σ ε,  σ in [0, 1];  target (velocity) = ε - x0.

One example is built in sd-scripts' order (``flux_train_network.py: get_noise_pred_and_target`` and
``library/flux_train_utils.py: get_noisy_model_input_and_timesteps``), by :func:`sample_sigmas` and
:func:`noisy_input`:

1. ``ε ~ N(0, I)`` shaped like the latents (B, C, H, W) (no noise offset / pyramid noise: sd-scripts ignores them);
2. σ (B,) by ``--timestep_sampling`` (below), and ``timesteps = 1000 σ`` (float: what the model receives; FLUX's
   own forward divides it by 1000 again);
3. input perturbation (``--ip_noise_gamma``): ``ξ ~ N(0, I)`` (then ``γ ~ U(0, ip_noise_gamma)`` with
   ``--ip_noise_gamma_random_strength``), and ``x_σ = (1 - σ) x0 + σ (ε + γ ξ)``; the target keeps ε;
4. the model output o is turned into what is compared with the target (``--model_prediction_type``):
   ``raw``: o; ``additive``: o + x_σ; ``sigma_scaled`` (sd-scripts' default): x_σ - σ o (an x0 estimate, compared
   with the velocity target all the same: sd-scripts' docs recommend ``raw``);
5. with ``sigma_scaled`` only, a per-sample loss weight from ``--weighting_scheme`` (:func:`loss_weighting`).

``--timestep_sampling`` (σ laws; z ~ N(0, 1), u ~ U(0, 1), s = ``--sigmoid_scale``, S = ``--discrete_flow_shift``):

* ``sigma`` (default): ``u'`` from ``--weighting_scheme`` (``logit_normal``: sigmoid(N(logit_mean, logit_std));
  ``mode``: ``1 - u - mode_scale (cos²(πu/2) - 1 + u)``; else u), index ``i = floor(1000 u')``, and σ / timestep
  the i-th entry of the shifted table of ``FlowMatchEulerDiscreteScheduler(1000, shift=S)``: ``σ_i = S s_i / (1 +
  (S - 1) s_i)``, ``s_i = (1000 - i) / 1000`` (:func:`sigma_table`);
* ``uniform``: σ = u; ``sigmoid``: σ = sigmoid(s z) (x-flux);
* ``shift``: σ = S v / (1 + (S - 1) v) with v = sigmoid(s z);
* ``flux_shift``: σ = e^μ / (e^μ + 1/v - 1), v = sigmoid(s z), μ linear in the packed token count (h/2)(w/2):
  0.5 at 256 tokens, 1.15 at 4096 (FLUX.1's resolution-dependent shift).

SD3 / SD3.5 (sd-scripts' ``sd3_train_network.py`` / ``library/sd3_train_utils.py``; :class:`SD3FlowConfig`,
:func:`sample_sd3_timesteps`): u' by ``--weighting_scheme`` as ``sigma`` above, shifted by ``--training_shift``,
integer ``t = floor(t_min + u' (t_max - t_min))`` in ``[--min_timestep, --max_timestep)``, σ = t / 1000, no input
perturbation; the output is always preconditioned ``x_σ - σ o`` and compared with x0 (the clean latents), weighted
by ``--weighting_scheme`` (sigma_sqrt, cosmap).

All randomness comes from one ``torch.Generator`` argument (``None``: torch's global RNG), drawn on its device in
sd-scripts' order (ε, the σ draw, ξ, γ), so the same generator state gives sd-scripts' values on the same draws.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from library.cli.problems import ConfigError

FLOW_TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
NUM_TRAIN_TIMESTEPS = 1000  # sd-scripts' FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
# FLUX.1's resolution-dependent shift: mu is linear in the image token count, through these two points
FLUX_SHIFT_POINTS = ((256, 0.5), (4096, 1.15))


def add_flow_matching_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' FLUX.1 noise flags on a training parser; read into :class:`FlowMatchingConfig` (same names).

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


def uses_flow_flags(args: argparse.Namespace) -> str | None:
    """Which flow-matching flags a parsed command line has: "flux" (:func:`add_flow_matching_args`), "sd3"
    (:func:`add_sd3_flow_args`) or None (an SD script; also one that merely refuses these flags, with a None
    default)."""
    if getattr(args, "model_prediction_type", None) is not None:
        return "flux"
    return "sd3" if getattr(args, "training_shift", None) is not None else None


def add_sd3_flow_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """sd-scripts' SD3 objective flags (``sd3_train_utils.add_sd3_training_arguments`` / ``add_dit_training_arguments``):
    ``--weighting_scheme --logit_mean --logit_std --mode_scale --training_shift``; read into :class:`SD3FlowConfig`
    with the shared ``--min_timestep / --max_timestep``. Returns the parser."""
    existing = {action.dest for action in parser._actions}
    g = parser.add_argument_group("flow matching (SD3)", "the SD3 flow-matching objective (sd-scripts' meanings)")
    g.add_argument("--weighting_scheme", type=str, default="uniform", choices=list(WEIGHTING_SCHEMES),
                   help="law of t (logit_normal, mode, else uniform) and loss weight (sigma_sqrt, cosmap, else 1)")  # fmt: skip
    for name, default in (("logit_mean", 0.0), ("logit_std", 1.0)):
        if name not in existing:
            g.add_argument(f"--{name}", type=float, default=default, help=f"--weighting_scheme logit_normal: {name}")
    g.add_argument("--mode_scale", type=float, default=1.29, help="--weighting_scheme mode: its scale")
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
        errors = _choice_error("weighting_scheme", self.weighting_scheme, WEIGHTING_SCHEMES)
        for flag in ("logit_std", "training_shift"):
            value = getattr(self, flag)
            if not (value > 0 and math.isfinite(value)):
                errors.append(f"--{flag} must be a finite number > 0, got {value}")
        for flag in ("logit_mean", "mode_scale"):
            if not math.isfinite(getattr(self, flag)):
                errors.append(f"--{flag} must be finite, got {getattr(self, flag)}")
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


@dataclass(frozen=True)
class FlowMatchingConfig:
    """Flow-matching settings; field names and defaults are sd-scripts' FLUX.1 flags (without ``--``).

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


def _choice_error(flag: str, value: str, choices: tuple[str, ...]) -> list[str]:
    return [] if value in choices else [f"--{flag} must be one of {', '.join(choices)}, got {value!r}"]


def _config_errors(cfg: FlowMatchingConfig) -> list[str]:
    errors = _choice_error("timestep_sampling", cfg.timestep_sampling, FLOW_TIMESTEP_SAMPLINGS)
    errors += _choice_error("weighting_scheme", cfg.weighting_scheme, WEIGHTING_SCHEMES)
    errors += _choice_error("model_prediction_type", cfg.model_prediction_type, MODEL_PREDICTION_TYPES)
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


# ----------------------------------------------------------------------------------------------------------------------
# σ laws


def _device_of(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's shift ``S σ / (1 + (S - 1) σ)`` (Esser et al. 2024, eq. 23; identity for S = 1)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_table(shift: float, n: int = NUM_TRAIN_TIMESTEPS) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)``, each (n,) float32, descending: the training table of sd-scripts'
    ``FlowMatchEulerDiscreteScheduler(n, shift)`` (and diffusers' of the same name): ``s_i = (n - i) / n``,
    ``σ_i = shift_sigmas(s_i)``, ``timestep_i = n σ_i``."""
    steps = torch.linspace(1, n, n, dtype=torch.float32).flip(0)
    sigmas = shift_sigmas(steps / n, shift)
    return sigmas, sigmas * n


def flux_mu(latent_height: int, latent_width: int) -> float:
    """FLUX.1's shift μ for latents of (h, w) (before 2x2 packing): linear in ``(h // 2) (w // 2)`` tokens through
    :data:`FLUX_SHIFT_POINTS` (sd-scripts ``get_lin_function``; BFL's ``get_schedule``)."""
    (x1, y1), (x2, y2) = FLUX_SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * ((latent_height // 2) * (latent_width // 2)) + (y1 - slope * x1)


def time_shift(mu: float, sigmas: Tensor) -> Tensor:
    """FLUX.1's shift ``e^μ / (e^μ + 1/σ - 1)`` (BFL ``time_shift`` with exponent 1)."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def table_density(
    cfg: FlowMatchingConfig | SD3FlowConfig, batch_size: int, generator: torch.Generator | None = None
) -> Tensor:
    """Unit draws (B,) float32 for ``--timestep_sampling sigma``, by ``--weighting_scheme`` (sd-scripts
    ``compute_density_for_timestep_sampling``; SD3 section 3.1): logit_normal ``sigmoid(N(logit_mean,
    logit_std²))``; mode ``1 - u - mode_scale (cos²(πu/2) - 1 + u)``; otherwise ``u ~ U(0, 1)``."""
    device = _device_of(generator)
    if cfg.weighting_scheme == "logit_normal":
        z = torch.normal(cfg.logit_mean, cfg.logit_std, size=(batch_size,), generator=generator, device=device)
        return torch.sigmoid(z)
    u = torch.rand((batch_size,), generator=generator, device=device)
    if cfg.weighting_scheme == "mode":
        return 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


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
    draw = _device_of(generator)
    kind, n = cfg.timestep_sampling, NUM_TRAIN_TIMESTEPS
    if kind == "sigma":
        sigmas_table, timesteps_table = sigma_table(cfg.discrete_flow_shift)
        u = table_density(cfg, batch_size, generator)
        index = (u * n).long().clamp(0, n - 1).cpu()
        sigmas, timesteps = sigmas_table[index], timesteps_table[index]
    elif kind == "uniform":
        sigmas = torch.rand((batch_size,), generator=generator, device=draw)
        timesteps = sigmas * n
    elif kind in ("sigmoid", "shift", "flux_shift"):
        sigmas = torch.sigmoid(cfg.sigmoid_scale * torch.randn((batch_size,), generator=generator, device=draw))
        if kind == "shift":
            sigmas = shift_sigmas(sigmas, cfg.discrete_flow_shift)
        elif kind == "flux_shift":
            sigmas = time_shift(flux_mu(*latent_size), sigmas)
        timesteps = sigmas * n
    else:
        raise ValueError(f"--timestep_sampling must be one of {', '.join(FLOW_TIMESTEP_SAMPLINGS)}, got {kind!r}")
    return sigmas.to(device), timesteps.to(device)


def sample_sd3_timesteps(
    cfg: SD3FlowConfig, batch_size: int, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)`` (B,) float32 on ``device`` for SD3 (sd-scripts ``sd3_train_utils
    .get_noisy_model_input_and_timesteps``): u' = :func:`table_density`, shifted by ``training_shift``, ``t =
    floor(u' (t_max - t_min) + t_min)`` (integer values), σ = t / 1000."""
    u = shift_sigmas(table_density(cfg, batch_size, generator), cfg.training_shift)
    lo, hi = cfg.timestep_range
    timesteps = (u * (hi - lo) + lo).long().to(device=device, dtype=torch.float32)
    return timesteps / NUM_TRAIN_TIMESTEPS, timesteps


# ----------------------------------------------------------------------------------------------------------------------
# Example, prediction type, weighting


def noisy_input(
    latents: Tensor,
    noise: Tensor,
    sigmas: Tensor,
    generator: torch.Generator | None = None,
    *,
    ip_noise_gamma: float | None = None,
    ip_noise_gamma_random_strength: bool = False,
) -> Tensor:
    """``(1 - σ) x0 + σ (ε + γ ξ)`` (B, C, H, W) in float32, γ ξ the input perturbation (``--ip_noise_gamma``, Ning
    et al. 2023, arXiv:2301.11706; ξ drawn before γ, as sd-scripts' FLUX path); ``sigmas`` (B,)."""
    s = sigmas.to(latents.device, torch.float32).view((-1,) + (1,) * (latents.ndim - 1))
    noise = noise.float()
    if ip_noise_gamma:
        draw = _device_of(generator)
        xi = torch.randn(tuple(latents.shape), generator=generator, device=draw).to(latents.device)
        gamma = ip_noise_gamma
        if ip_noise_gamma_random_strength:
            gamma = torch.rand((1,), generator=generator, device=draw).to(latents.device) * ip_noise_gamma
        noise = noise + gamma * xi
    return (1.0 - s) * latents.float() + s * noise


def flow_target(latents: Tensor, noise: Tensor) -> Tensor:
    """The velocity ``ε - x0`` (B, C, H, W) float32 (the same for every ``--model_prediction_type``)."""
    return noise.float() - latents.float()


def apply_model_prediction_type(kind: str, output: Tensor, noisy: Tensor, sigmas: Tensor) -> Tensor:
    """What is compared with the target: raw ``o``, additive ``o + x_σ``, sigma_scaled ``x_σ - σ o`` (sd-scripts
    ``apply_model_prediction_type``); output and noisy (B, C, H, W), sigmas (B,)."""
    if kind == "raw":
        return output
    if kind == "additive":
        return output + noisy
    if kind == "sigma_scaled":
        s = sigmas.to(output.device, output.dtype).view((-1,) + (1,) * (output.ndim - 1))
        return output * (-s) + noisy
    raise ValueError(f"--model_prediction_type must be one of {', '.join(MODEL_PREDICTION_TYPES)}, got {kind!r}")


def loss_weighting(scheme: str, sigmas: Tensor) -> Tensor | None:
    """Per-sample loss weight (B,) float32 (sd-scripts ``compute_loss_weighting_for_sd3``, applied only with
    ``--model_prediction_type sigma_scaled``): sigma_sqrt ``σ^-2``; cosmap ``2 / (π (1 - 2σ + 2σ²))`` (SD3 section
    3.1); None (weight 1) for the others."""
    if scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return None
