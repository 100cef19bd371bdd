"""Noise schedule, noise schemes, timestep sampling and training targets for SD 1.x / 2.x / SDXL (pure torch).

One training example is built in sd-scripts' order (``library/train_util.py: get_noise_noisy_latents_and_timesteps``
and ``train_network.py: NetworkTrainer.get_noise_pred_and_target``), by :func:`make_example`:

1. ``noise ~ N(0, I)`` shaped like the latents (B, C, H, W);
2. noise offset (``--noise_offset``, ``--noise_offset_random_strength``, ``--adaptive_noise_scale``);
3. multi-resolution (pyramid) noise (``--multires_noise_iterations``, ``--multires_noise_discount``);
4. timesteps in ``[min_timestep, max_timestep)`` (uniform as sd-scripts, or logit-normal / sigmoid, with a shift);
5. noisy latents ``sqrt(a_t) x0 + sqrt(1 - a_t) (noise + ip)``, ``ip`` the input perturbation (``--ip_noise_gamma``);
6. target: ``noise`` (epsilon-prediction) or ``v = sqrt(a_t) noise - sqrt(1 - a_t) x0`` (``--v_parameterization``).

All randomness comes from one ``torch.Generator`` argument (``None``: torch's global RNG), drawn in a fixed order, so a
resumed run that restores the generator state repeats the same draws. Draws are made on the generator's device and
moved to the latents' device, so a CPU generator gives the same noise whatever device trains. Noise and targets are
float32 whatever the latents' dtype; the noisy latents come back in the latents' dtype (the UNet's input dtype).

``a_t`` is ``alphas_cumprod[t]`` throughout, held in float64 by :class:`NoiseSchedule`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from library.cli.problems import ConfigError

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "sigmoid")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
DEFAULT_NUM_TRAIN_TIMESTEPS = 1000  # every released SD 1.x / 2.x / SDXL model


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def add_noise_args(parser: argparse.ArgumentParser) -> None:
    """Noise and timestep flags; read into ``library.objectives.noising.NoiseConfig`` (same field names)."""
    g = parser.add_argument_group("noise")
    g.add_argument("--noise_offset", type=float, default=None, help="offset noise strength (around 0.1 is usual)")
    g.add_argument("--noise_offset_random_strength", action="store_true", help="offset strength ~ U(0, offset)")
    g.add_argument("--adaptive_noise_scale", type=float, default=None, help="add |latent mean| x this to the offset")
    g.add_argument("--multires_noise_iterations", type=int, default=None, help="pyramid noise levels (6-10 usual)")
    g.add_argument("--multires_noise_discount", type=float, default=0.3, help="pyramid noise discount per level")
    g.add_argument("--ip_noise_gamma", type=float, default=None, help="input perturbation noise (around 0.1)")
    g.add_argument("--ip_noise_gamma_random_strength", action="store_true", help="gamma ~ U(0, ip_noise_gamma)")
    g.add_argument("--zero_terminal_snr", action="store_true", help="rescale betas to zero terminal SNR")
    g.add_argument("--min_timestep", type=int, default=None, help="lowest training timestep (0-999)")
    g.add_argument("--max_timestep", type=int, default=None, help="highest training timestep, exclusive (1-1000)")
    g.add_argument(
        "--timestep_sampling",
        type=str,
        default="uniform",
        choices=["uniform", "logit_normal", "sigmoid"],
        help="timestep distribution (uniform = sd-scripts)",
    )
    g.add_argument("--logit_mean", type=float, default=0.0, help="logit_normal: mean")
    g.add_argument("--logit_std", type=float, default=1.0, help="logit_normal: standard deviation")
    g.add_argument("--sigmoid_scale", type=float, default=1.0, help="sigmoid: scale")
    g.add_argument(
        "--timestep_shift",
        type=float,
        default=1.0,
        help="shift s·u / (1 + (s - 1)·u) of the timestep draw; > 1 trains more at high noise",
    )


@dataclass(frozen=True)
class NoiseConfig:
    """Noise and timestep settings; field names and defaults are sd-scripts' flags (without ``--``).

    ``timestep_sampling`` (new; none of the SD trainers but OneTrainer offers it for SD/SDXL) picks the timestep
    distribution: ``uniform`` (sd-scripts' ``randint``, the default), ``logit_normal`` (``sigmoid(logit_mean +
    logit_std * z)``, Esser et al. 2024, SD3, arXiv:2403.03206 section 3.1) or ``sigmoid`` (``sigmoid(sigmoid_scale
    * z)``, the spelling of sd-scripts' SD3/FLUX ``--timestep_sampling sigmoid``; the same law as logit-normal with
    mean 0). ``timestep_shift`` s maps the unit draw u to ``s u / (1 + (s - 1) u)`` (SD3's shift; > 1 trains more at
    high noise, as OneTrainer's "timestep shift"). With the defaults the draws are exactly sd-scripts'.

    These are the shared noise flags every training script has (sd-scripts' names). The DDPM objective reads them
    all (:mod:`library.objectives.ddpm`, whose :func:`~library.objectives.ddpm.ddpm_problems` checks the timestep law
    against :data:`TIMESTEP_SAMPLINGS`); a flow-matching family's objective reads the ones it shares and says which it
    ignores (its script may give ``--timestep_sampling`` other choices).

    Raises:
        ValueError: listing every bad field at once, each naming its flag.
    """

    noise_offset: float | None = None
    noise_offset_random_strength: bool = False
    adaptive_noise_scale: float | None = None
    multires_noise_iterations: int | None = None
    multires_noise_discount: float = 0.3
    ip_noise_gamma: float | None = None
    ip_noise_gamma_random_strength: bool = False
    zero_terminal_snr: bool = False
    min_timestep: int | None = None
    max_timestep: int | None = None
    timestep_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    sigmoid_scale: float = 1.0
    timestep_shift: float = 1.0
    v_parameterization: bool = False

    def __post_init__(self) -> None:
        errors = _noise_config_errors(self)
        if errors:
            raise ConfigError(errors, "noise/timestep settings")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NoiseConfig:
        """The same-named flags."""
        from library.cli.parse import from_namespace

        return from_namespace(cls, args)


def _noise_config_errors(cfg: NoiseConfig) -> list[str]:
    errors = []
    if cfg.noise_offset is not None and not cfg.noise_offset >= 0:
        errors.append(f"--noise_offset must be >= 0 (around 0.1 is usual), got {cfg.noise_offset}")
    if cfg.adaptive_noise_scale is not None and cfg.noise_offset is None:
        errors.append("--adaptive_noise_scale needs --noise_offset (the scale is added to the offset); set both")
    its = cfg.multires_noise_iterations
    if its is not None and (not _is_int(its) or its < 0):
        errors.append(f"--multires_noise_iterations must be an integer >= 0 (6-10 is usual), got {its!r}")
    if not 0 < cfg.multires_noise_discount <= 1:
        errors.append(f"--multires_noise_discount must be in (0, 1], got {cfg.multires_noise_discount}")
    if cfg.ip_noise_gamma is not None and not cfg.ip_noise_gamma >= 0:
        errors.append(f"--ip_noise_gamma must be >= 0 (around 0.1 is usual), got {cfg.ip_noise_gamma}")
    errors += _timestep_errors(cfg)
    return errors


def _timestep_errors(cfg: NoiseConfig) -> list[str]:
    errors = []
    lo, hi, n = cfg.min_timestep, cfg.max_timestep, DEFAULT_NUM_TRAIN_TIMESTEPS
    lo_ok = lo is None or (_is_int(lo) and 0 <= lo <= n - 1)
    hi_ok = hi is None or (_is_int(hi) and 1 <= hi <= n)
    if not lo_ok:
        errors.append(f"--min_timestep must be an integer in [0, {n - 1}], got {lo!r}")
    if not hi_ok:
        errors.append(f"--max_timestep must be an integer in [1, {n}] (exclusive bound), got {hi!r}")
    if lo_ok and hi_ok and lo is not None and hi is not None and lo > hi:
        errors.append(
            f"--min_timestep ({lo}) must not exceed --max_timestep ({hi}); equal values train at that one timestep"
        )
    for flag in ("logit_std", "sigmoid_scale", "timestep_shift"):
        value = getattr(cfg, flag)
        if not (value > 0 and math.isfinite(value)):
            errors.append(f"--{flag} must be a finite number > 0, got {value}")
    if not math.isfinite(cfg.logit_mean):
        errors.append(f"--logit_mean must be finite, got {cfg.logit_mean}")
    return errors


# ----------------------------------------------------------------------------------------------------------------------
# Noise schedule


def _base_betas(config: dict) -> Tensor:
    """Betas (T,) float64 from a diffusers scheduler config, with diffusers' formulas (DDPMScheduler.__init__)."""
    if config.get("trained_betas") is not None:
        return torch.tensor(config["trained_betas"], dtype=torch.float64)
    n = int(config.get("num_train_timesteps", DEFAULT_NUM_TRAIN_TIMESTEPS))
    start, end = float(config.get("beta_start", 0.0001)), float(config.get("beta_end", 0.02))
    kind = config.get("beta_schedule", "linear")
    if kind == "linear":
        return torch.linspace(start, end, n, dtype=torch.float64)
    if kind == "scaled_linear":
        return torch.linspace(start**0.5, end**0.5, n, dtype=torch.float64) ** 2
    if kind == "squaredcos_cap_v2":  # Nichol & Dhariwal 2021, eq. 17, betas capped at 0.999

        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        return torch.tensor(
            [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)], dtype=torch.float64
        )
    raise ValueError(
        f"scheduler_config['beta_schedule'] = {kind!r} is not supported for training; use one of {', '.join(BETA_SCHEDULES)}"
    )


def rescale_zero_terminal_snr(alphas_cumprod: Tensor) -> Tensor:
    """Shift and scale ``sqrt(alphas_cumprod)`` so the last value is 0 and the first unchanged.

    Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", arXiv:2305.08891, Algorithm 1
    (applied to ``sqrt(a)`` directly instead of going back through betas; the result is the same schedule).

    Args:
        alphas_cumprod: (T,) decreasing values in (0, 1].
    Returns:
        (T,) same dtype, with ``[-1] == 0`` exactly and ``[0]`` unchanged.
    """
    s = alphas_cumprod.sqrt()
    first, last = s[0].clone(), s[-1].clone()
    s = (s - last) * (first / (first - last))
    return s**2


@dataclass(frozen=True, eq=False)
class NoiseSchedule:
    """The discrete DDPM forward process ``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps`` (Ho et al. 2020, arXiv:2006.11239).

    ``alphas_cumprod`` is a (T,) float64 tensor (computed in float64 on the CPU, so it matches diffusers' float32
    table to ~1e-7); :meth:`to` puts a copy on the training device, so that a step gathers its coefficients there
    without a round trip through the host. Coefficients are gathered in float64 and cast to float32 on the data's
    device.
    """

    alphas_cumprod: Tensor
    # whether the last ᾱ is exactly 0 (a zero-terminal-SNR schedule): read from the table once, where it is built (on
    # the host), and carried by :meth:`to`, so that no training step reads the device for it
    reaches_zero_snr: bool | None = None

    def __post_init__(self) -> None:
        if self.reaches_zero_snr is None:
            object.__setattr__(self, "reaches_zero_snr", bool(self.alphas_cumprod[-1] == 0))

    @classmethod
    def from_config(cls, scheduler_config: dict, *, zero_terminal_snr: bool = False) -> NoiseSchedule:
        """Build from the diffusers scheduler config dict ``Parts.scheduler_config`` carries.

        Supports ``beta_schedule`` linear / scaled_linear (all released SD models) / squaredcos_cap_v2 and
        ``trained_betas``. Zero-terminal-SNR is applied when ``zero_terminal_snr`` (``--zero_terminal_snr``) or the
        config's ``rescale_betas_zero_snr`` is true; equals ``DDPMScheduler(..., rescale_betas_zero_snr=True)``.
        """
        alphas_cumprod = torch.cumprod(1.0 - _base_betas(scheduler_config), dim=0)
        if zero_terminal_snr or scheduler_config.get("rescale_betas_zero_snr", False):
            alphas_cumprod = rescale_zero_terminal_snr(alphas_cumprod)
        return cls(alphas_cumprod)

    def to(self, device: torch.device | str) -> NoiseSchedule:
        """The same schedule with its table on ``device`` (itself when it is there already)."""
        device = torch.device(device)
        if self.alphas_cumprod.device == device:
            return self
        return NoiseSchedule(self.alphas_cumprod.to(device), self.reaches_zero_snr)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.alphas_cumprod.shape[0])

    def gather(self, timesteps: Tensor) -> Tensor:
        """``a_t`` for integer timesteps (B,) -> (B,) float64 on the table's device. Timesteps given on the host are
        range-checked (ValueError); on a device they are the loop's own draws, which lie in range by construction,
        and checking them would make the host wait for the device at every step."""
        t = timesteps.detach()
        if t.device.type == "cpu" and t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_train_timesteps):
            raise ValueError(f"timesteps must lie in [0, {self.num_train_timesteps - 1}], got {t.tolist()}")
        return self.alphas_cumprod[t.to(self.alphas_cumprod.device, torch.long)]

    def snr(self, timesteps: Tensor) -> Tensor:
        """Signal-to-noise ratio ``a_t / (1 - a_t)`` of the schedule actually used (after any zero-terminal-SNR
        rescale), (B,) float64 on the table's device; exactly 0 at the terminal step of a zero-terminal-SNR
        schedule."""
        a = self.gather(timesteps)
        return a / (1.0 - a)

    def _coefficients(self, timesteps: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        a = self.gather(timesteps)
        shape = (-1,) + (1,) * (like.ndim - 1)
        cast = dict(device=like.device, dtype=torch.float32)
        return a.sqrt().to(**cast).view(shape), (1.0 - a).sqrt().to(**cast).view(shape)

    def add_noise(self, latents: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor:
        """``sqrt(a_t) x0 + sqrt(1 - a_t) noise``; latents and noise (B, ...), timesteps (B,) -> (B, ...) float32.

        Same as diffusers ``DDPMScheduler.add_noise``."""
        signal, sigma = self._coefficients(timesteps, latents)
        return signal * latents.float() + sigma * noise.float()

    def velocity(self, latents: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor:
        """v-prediction target ``sqrt(a_t) noise - sqrt(1 - a_t) x0`` (Salimans & Ho 2022, arXiv:2202.00512, sec. 4),
        (B, ...) float32. Same as diffusers ``DDPMScheduler.get_velocity``."""
        signal, sigma = self._coefficients(timesteps, latents)
        return signal * noise.float() - sigma * latents.float()


# ----------------------------------------------------------------------------------------------------------------------
# Random draws


def draw_device(generator: torch.Generator | None, fallback: torch.device | str = "cpu") -> torch.device:
    """Where a draw from ``generator`` is made: the generator's device (its state lives there), else ``fallback``
    (torch's global RNG of that device)."""
    return generator.device if generator is not None else torch.device(fallback)


def _to(tensor: Tensor, device: torch.device | str) -> Tensor:
    """A draw moved to the training device; host -> GPU copies do not wait for the device's queue."""
    device = torch.device(device)
    return tensor.to(device, non_blocking=tensor.device.type == "cpu" and device.type == "cuda")


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    out = torch.randn(shape, generator=generator, device=draw_device(generator, device), dtype=torch.float32)
    return _to(out, device)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    out = torch.rand(shape, generator=generator, device=draw_device(generator, device), dtype=torch.float32)
    return _to(out, device)


def _random_strength(value: float, random_strength: bool, generator: torch.Generator | None, device) -> Tensor | float:
    """``value`` or ``value * U(0, 1)`` (one scalar per step, shape (1,)), as sd-scripts' ``*_random_strength``."""
    return _rand((1,), generator, device) * value if random_strength else value


# ----------------------------------------------------------------------------------------------------------------------
# Noise schemes


def apply_noise_offset(
    noise: Tensor,
    latents: Tensor,
    offset: float | Tensor,
    adaptive_noise_scale: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Offset noise: add a per-(sample, channel) constant ``o * N(0, 1)`` to the noise.

    Guttenberg 2023, "Diffusion with Offset Noise" (crosslabs.org); sd-scripts ``apply_noise_offset``. With
    ``adaptive_noise_scale`` a: ``o = max(0, o + a * |mean_{H,W}(latents)|)`` per sample and channel.

    Args:
        noise: (B, C, H, W) float32.
        latents: (B, C, H, W) clean latents (only read with ``adaptive_noise_scale``).
        offset: python float or a (1,) tensor (random strength).
    Returns:
        (B, C, H, W) float32; consumes one (B, C, 1, 1) normal draw.
    """
    b, c = noise.shape[:2]
    o = offset
    if adaptive_noise_scale is not None:
        mean_abs = latents.float().mean(dim=(2, 3), keepdim=True).abs()
        o = torch.clamp(o + adaptive_noise_scale * mean_abs, min=0.0)
    return noise + o * _randn((b, c, 1, 1), generator, noise.device)


def pyramid_noise(noise: Tensor, iterations: int, discount: float, generator: torch.Generator | None = None) -> Tensor:
    """Multi-resolution ("pyramid") noise, normalised back to unit standard deviation.

    Whitaker 2023, "Multi-Resolution Noise for Diffusion Model Training" (wandb report); sd-scripts
    ``pyramid_noise_like``. For i = 0 .. iterations-1: draw ``r ~ U(2, 4)``, add ``bilinear_upsample(N(0, 1) at
    (max(1, int(H / r^i)), max(1, int(W / r^i)))) * discount^i`` (i = 0 is a full-resolution draw with weight 1) and
    stop after a level whose height or width is 1; finally divide by the standard deviation of the whole tensor.
    Draw order per level: one uniform (r), then the level's normals.

    Args:
        noise: (B, C, H, W) float32.
    Returns:
        (B, C, H, W) float32 with ``std() == 1``.
    """
    b, c, h, w = noise.shape
    out = noise
    for i in range(iterations):
        r = 2.0 + 2.0 * float(_rand((1,), generator, torch.device("cpu")))
        hn, wn = max(1, int(h / r**i)), max(1, int(w / r**i))
        level = _randn((b, c, hn, wn), generator, noise.device)
        out = out + F.interpolate(level, size=(h, w), mode="bilinear") * discount**i
        if hn == 1 or wn == 1:
            break
    return out / out.std()


def make_noise(cfg: NoiseConfig, latents: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Steps 1-3: ``N(0, I)``, then noise offset, then pyramid noise, as configured. (B, C, H, W) -> float32."""
    noise = _randn(tuple(latents.shape), generator, latents.device)
    if cfg.noise_offset:
        offset = _random_strength(cfg.noise_offset, cfg.noise_offset_random_strength, generator, latents.device)
        noise = apply_noise_offset(noise, latents, offset, cfg.adaptive_noise_scale, generator)
    if cfg.multires_noise_iterations:
        noise = pyramid_noise(noise, cfg.multires_noise_iterations, cfg.multires_noise_discount, generator)
    return noise


# ----------------------------------------------------------------------------------------------------------------------
# Timesteps


def timestep_range(cfg: NoiseConfig, num_train_timesteps: int = DEFAULT_NUM_TRAIN_TIMESTEPS) -> tuple[int, int]:
    """``(low, high)``: timesteps are drawn from ``[low, high)``; ``low == high`` means every timestep is ``low``."""
    low = 0 if cfg.min_timestep is None else cfg.min_timestep
    high = num_train_timesteps if cfg.max_timestep is None else cfg.max_timestep
    if high > num_train_timesteps or low >= num_train_timesteps:
        raise ValueError(
            f"--min_timestep/--max_timestep ({low}, {high}) exceed the schedule's {num_train_timesteps} timesteps"
        )
    return low, high


def shift_unit(u: Tensor, shift: float) -> Tensor:
    """SD3 timestep shift ``s u / (1 + (s - 1) u)`` on unit draws u in [0, 1] (Esser et al. 2024, eq. 23)."""
    return u if shift == 1.0 else shift * u / (1.0 + (shift - 1.0) * u)


def sample_timesteps(
    cfg: NoiseConfig,
    batch_size: int,
    num_train_timesteps: int = DEFAULT_NUM_TRAIN_TIMESTEPS,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Integer timesteps (B,) long in ``[min_timestep, max_timestep)``.

    ``uniform`` without shift is sd-scripts' ``torch.randint(min, max)`` (same draws). Otherwise a unit draw u is
    made (uniform, ``sigmoid(logit_mean + logit_std z)`` or ``sigmoid(sigmoid_scale z)``, z ~ N(0, 1)), shifted by
    :func:`shift_unit`, and mapped to ``min + floor(u (max - min))`` (clamped to ``max - 1``), as OneTrainer maps
    its continuous distributions onto the discrete schedule.
    """
    low, high = timestep_range(cfg, num_train_timesteps)
    device = torch.device(device)
    if low == high:
        return torch.full((batch_size,), low, dtype=torch.long, device=device)
    draw = draw_device(generator)
    if cfg.timestep_sampling == "uniform" and cfg.timestep_shift == 1.0:
        t = torch.randint(low, high, (batch_size,), generator=generator, device=draw)
        return _to(t, device)
    if cfg.timestep_sampling == "uniform":
        u = torch.rand((batch_size,), generator=generator, device=draw, dtype=torch.float64)
    else:
        z = torch.randn((batch_size,), generator=generator, device=draw, dtype=torch.float64)
        mean, std = (
            (cfg.logit_mean, cfg.logit_std) if cfg.timestep_sampling == "logit_normal" else (0.0, cfg.sigmoid_scale)
        )
        u = torch.sigmoid(mean + std * z)
    u = shift_unit(u, cfg.timestep_shift)
    t = (low + torch.floor(u * (high - low))).long().clamp(low, high - 1)
    return _to(t, device)


# ----------------------------------------------------------------------------------------------------------------------
# The composite


class TrainingExample(NamedTuple):
    """What :func:`make_example` returns; unpacks as ``noisy, target, timesteps, noise``.

    noisy: (B, C, H, W) in the latents' dtype (UNet input); target: (B, C, H, W) float32; timesteps: (B,) long;
    noise: (B, C, H, W) float32, the epsilon of the target (without the input perturbation).
    """

    noisy: Tensor
    target: Tensor
    timesteps: Tensor
    noise: Tensor


def make_example(
    cfg: NoiseConfig,
    latents: Tensor,
    schedule: NoiseSchedule,
    generator: torch.Generator | None = None,
    *,
    timesteps: Tensor | None = None,
    noise: Tensor | None = None,
) -> TrainingExample:
    """Build one diffusion training example in sd-scripts' order (module docstring, steps 1-6).

    Args:
        cfg: noise settings.
        latents: (B, C, H, W) clean, VAE-scaled latents (any float dtype).
        schedule: the training schedule (already zero-terminal-SNR-rescaled when ``cfg.zero_terminal_snr``).
        generator: source of every random draw (``None``: torch's global RNG).
        timesteps: (B,) integer timesteps to use instead of sampling (validation at fixed timesteps).
        noise: (B, C, H, W) epsilon to use as-is instead of steps 1-3.
    Returns:
        :class:`TrainingExample`. Input perturbation (Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in
        Diffusion Models", arXiv:2301.11706, eq. 9) perturbs only the noisy input; the target keeps ``noise``.
    """
    if latents.ndim != 4:
        raise ValueError(f"latents must be (B, C, H, W), got shape {tuple(latents.shape)}")
    if noise is None:
        noise = make_noise(cfg, latents, generator)
    elif noise.shape != latents.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} must equal latents shape {tuple(latents.shape)}")
    noise = noise.float()
    batch = latents.shape[0]
    if timesteps is None:
        timesteps = sample_timesteps(cfg, batch, schedule.num_train_timesteps, generator, latents.device)
    elif timesteps.shape != (batch,):
        raise ValueError(f"timesteps must have shape ({batch},), got {tuple(timesteps.shape)}")
    timesteps = timesteps.to(latents.device, torch.long)
    model_noise = noise
    if cfg.ip_noise_gamma:
        gamma = _random_strength(cfg.ip_noise_gamma, cfg.ip_noise_gamma_random_strength, generator, latents.device)
        model_noise = noise + gamma * _randn(tuple(latents.shape), generator, latents.device)
    noisy = schedule.add_noise(latents, model_noise, timesteps).to(latents.dtype)
    target = schedule.velocity(latents, noise, timesteps) if cfg.v_parameterization else noise
    return TrainingExample(noisy, target, timesteps, noise)
