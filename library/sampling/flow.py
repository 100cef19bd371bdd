"""Flow-matching sampling (FLUX.1 dev / schnell, Chroma, SD3 / SD3.5): the sigma schedules, Euler steps on the
velocity, true classifier-free guidance, and sd-scripts' initial noise. Pure torch.

A rectified-flow model predicts the velocity ``v = noise - x0`` of ``x_σ = (1 - σ)·x0 + σ·noise`` (σ in [0, 1],
σ = 1 is pure noise; Liu et al. 2022, arXiv:2209.03003; Esser et al. 2024, arXiv:2403.03206). Sampling integrates
``dx/dσ = v`` from σ = 1 down to 0 with Euler steps ``x ← x + (σ_{i+1} - σ_i)·v(x, σ_i)``
(sd-scripts ``flux_train_utils.denoise``, diffusers ``FlowMatchEulerDiscreteScheduler.step``).

Schedule (sd-scripts ``flux_train_utils.get_schedule``, diffusers ``FluxPipeline`` with its dynamic shifting):
``σ = linspace(1, 0, steps + 1)``, then with the shift ``σ ← time_shift(μ, 1, σ) = e^μ / (e^μ + (1/σ - 1))``, where
μ is linear in the packed image sequence length L = (H/16)·(W/16): μ(256) = ``base_shift`` (0.5), μ(4096) =
``max_shift`` (1.15). A 1024² image has L = 4096 (μ = 1.15); 512² has L = 1024 (μ ≈ 0.63). The shift keeps more
steps at high noise for large images; schnell samples unshifted. SD3 / SD3.5 use a static shift instead
(:func:`discrete_flow_sigmas`: ``σ ← s·σ / (1 + (s - 1)·σ)``, s = 3.0, on diffusers' discrete scheduler grid).

Guidance. Embedded guidance (FLUX.1 dev, a prompt's ``--g``) is an input of the model, handled by the caller's
velocity function. True CFG (a prompt's ``--l`` with its negative prompt ``--n``) runs the model on ``[x; x]`` with
the negative conditioning first and combines ``v = v_neg + scale·(v_pos - v_neg)`` (:func:`with_cfg`, as sd-scripts
does in one batch; diffusers' ``true_cfg_scale`` runs two passes, the same numbers up to float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

BASE_SEQ_LEN = 256  # packed tokens where μ = base_shift (256² px)
MAX_SEQ_LEN = 4096  # packed tokens where μ = max_shift (1024² px)
BASE_SHIFT = 0.5
MAX_SHIFT = 1.15
PIXELS_PER_TOKEN = 16  # an 8x VAE, then 2x2 latent patches per token: image sides are multiples of 16

Velocity = Callable[[Tensor, Tensor], Tensor]
"""``velocity(x (B, C, h, w), sigma (B,)) -> v (B, C, h, w)``: the model's velocity at noise level sigma."""


def shift_mu(
    image_seq_len: int,
    base_shift: float = BASE_SHIFT,
    max_shift: float = MAX_SHIFT,
    base_seq_len: int = BASE_SEQ_LEN,
    max_seq_len: int = MAX_SEQ_LEN,
) -> float:
    """μ = the line through (``base_seq_len``, ``base_shift``) and (``max_seq_len``, ``max_shift``) at
    ``image_seq_len`` (sd-scripts ``get_lin_function``, diffusers ``calculate_shift``); not clamped beyond the ends."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def time_shift(mu: float, sigma: float, t: Tensor) -> Tensor:
    """``e^μ / (e^μ + (1/t - 1)^sigma)``: 1 stays 1, 0 stays 0 (1/0 = inf), values in between move towards 1."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def flow_sigmas(
    steps: int,
    image_seq_len: int,
    *,
    shift: bool = True,
    base_shift: float = BASE_SHIFT,
    max_shift: float = MAX_SHIFT,
) -> Tensor:
    """The (steps + 1,) float32 noise levels from 1 to 0 (module docstring): ``steps`` Euler steps, the last to σ = 0.

    ``image_seq_len``: packed tokens of the image, (H/16)·(W/16) (:func:`image_seq_len`); only read with ``shift``.
    """
    if steps < 1:
        raise ValueError(f"flow_sigmas: steps must be >= 1, got {steps}")
    sigmas = torch.linspace(1, 0, steps + 1)
    if shift:
        sigmas = time_shift(shift_mu(image_seq_len, base_shift, max_shift), 1.0, sigmas)
    return sigmas


def discrete_flow_sigmas(steps: int, shift: float, num_train_timesteps: int = 1000) -> Tensor:
    """The (steps + 1,) float32 noise levels of SD3 / SD3.5 (a static ``shift`` s, 3.0 for SD3): diffusers'
    ``FlowMatchEulerDiscreteScheduler.set_timesteps`` without dynamic shifting (what ``StableDiffusion3Pipeline``
    samples with) and sd-scripts' ``sd3_train_utils.get_all_sigmas``.

    With ``f(σ) = s·σ / (1 + (s - 1)·σ)`` and T = ``num_train_timesteps``: the training grid f(k/T), k = 1..T, ends
    at σ_max = f(1) = 1 and σ_min = f(1/T) (float32, as the scheduler keeps them); the ``steps`` levels are
    f(t/T) for t linear from T·σ_max to T·σ_min (the shift is applied to the already shifted σ_min, as both
    references do), then 0. Computed in float64 and rounded to float32, as diffusers does."""
    if steps < 1:
        raise ValueError(f"discrete_flow_sigmas: steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"discrete_flow_sigmas: shift must be positive, got {shift}")

    def f(sigma: Tensor) -> Tensor:
        return shift * sigma / (1 + (shift - 1) * sigma)

    grid_end = torch.tensor([1.0 / num_train_timesteps], dtype=torch.float32)
    sigma_max, sigma_min = 1.0, float(f(grid_end))
    t = torch.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, steps, dtype=torch.float64)
    sigmas = f(t / num_train_timesteps).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def shifted_linear_sigmas(steps: int, shift: float) -> Tensor:
    """The (steps + 1,) float32 noise levels ``s·σ / (1 + (s - 1)·σ)`` of ``σ = linspace(1, 0, steps + 1)`` (a static
    shift s on the plain grid, ending at 0): sd-scripts' HunyuanImage ``get_timesteps_sigmas``."""
    if steps < 1:
        raise ValueError(f"shifted_linear_sigmas: steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shifted_linear_sigmas: shift must be positive, got {shift}")
    sigmas = torch.linspace(1, 0, steps + 1)
    return ((shift * sigmas) / (1 + (shift - 1) * sigmas)).to(torch.float32)


def linear_flow_sigmas(steps: int, shift: float) -> Tensor:
    """The (steps + 1,) float32 noise levels of Z-Image: ``f(linspace(1, 1/steps, steps))`` with the static shift
    ``f(σ) = s·σ / (1 + (s - 1)·σ)``, then 0 (diffusers' ``ZImagePipeline`` through ``FlowMatchEulerDiscreteScheduler``;
    musubi-tuner's ``zimage_utils.get_timesteps_sigmas`` spaces them as ``linspace(1000, 1, steps + 1)[:-1] / 1000``,
    at most 0.001 apart)."""
    if steps < 1 or shift <= 0:
        raise ValueError(f"linear_flow_sigmas: steps must be >= 1 and shift positive, got {steps}, {shift}")
    sigmas = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float32)  # in float32, as diffusers computes them
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.cat([sigmas, torch.zeros(1)])


def image_seq_len(height: int, width: int, downscale: int = 8, patch: int = 2) -> int:
    """Packed 2x2 latent tokens of an H x W image for a VAE that downscales by ``downscale``:
    (H/(2·downscale))·(W/(2·downscale)), (H/16)·(W/16) for an 8x VAE; raises ValueError unless both sides are
    multiples of 2·downscale (``patch``·downscale for another patch side: the tokens are then
    (H/(patch·downscale))·(W/(patch·downscale)))."""
    step = patch * downscale
    bad = [f"{name} {value}" for name, value in (("height", height), ("width", width)) if value % step]
    if bad or min(height, width) < step:
        side = min(height, width)
        raise ValueError(
            f"flow-matching sampling: {', '.join(bad) or f'side {side}'} must be a multiple of {step} (a "
            f"{downscale}x VAE and {patch}x{patch} latent patches); try {max(step, side - side % step)}"
        )
    return (height // step) * (width // step)


def sample_euler(
    velocity: Velocity, x: Tensor, sigmas: Tensor, *, callback: Callable[[int, Tensor], None] | None = None
) -> Tensor:
    """Integrate ``dx/dσ = velocity(x, σ)`` along ``sigmas`` (from :func:`flow_sigmas`) with Euler steps
    ``x ← x + (σ_{i+1} - σ_i)·v`` (module docstring). ``x``: the noise (B, C, h, w) at ``sigmas[0]``; the step is
    computed in ``x``'s dtype (pass float32 noise to accumulate in float32 whatever the model's dtype).
    ``callback(i, x)`` after step i. Returns the sample at ``sigmas[-1]``."""
    sigmas = sigmas.to(x.device, torch.float32)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(x.shape[0])
        v = velocity(x, sigma)
        x = x + (sigmas[i + 1] - sigmas[i]).to(x.dtype) * v.to(x.dtype)
        if callback is not None:
            callback(i, x)
    return x


def with_cfg(velocity: Velocity, scale: float) -> Velocity:
    """True classifier-free guidance: ``velocity`` must run on the doubled batch ``[x; x]`` conditioned on the
    negative prompts in its first half and the prompts in its second (sd-scripts' batch order); returns the guided
    ``v = v_neg + scale·(v_pos - v_neg)`` for the batch ``x``."""

    def guided(x: Tensor, sigma: Tensor) -> Tensor:
        v_neg, v_pos = velocity(torch.cat([x, x]), torch.cat([sigma, sigma])).chunk(2)
        return v_neg + scale * (v_pos - v_neg)

    return guided


def with_truncated_cfg(
    velocity: Velocity, conditional: Velocity, scale: float, trunc_ratio: float | None, renorm: float
) -> Velocity:
    """True CFG as :func:`with_cfg` (``velocity`` on the doubled batch [negatives; prompts]) only while the model
    time ``1 - σ`` is below ``trunc_ratio`` (None: always), ``conditional`` (the prompts alone) otherwise; with
    ``renorm`` > 0 each guided image's velocity norm is capped at ``renorm`` times its conditional one (sd-scripts'
    Lumina 2 ``lumina_train_util.denoise``: ``--ctr`` / ``--rcfg``; the same on velocities as on its x0 - ε
    outputs, which are their negation)."""

    def guided(x: Tensor, sigma: Tensor) -> Tensor:
        if trunc_ratio is not None and not float(1 - sigma[0]) < trunc_ratio:
            return conditional(x, sigma)
        v_neg, v_pos = velocity(torch.cat([x, x]), torch.cat([sigma, sigma])).chunk(2)
        v = v_neg + scale * (v_pos - v_neg)
        if renorm > 0:
            dims = tuple(range(1, v.ndim))
            cap = torch.linalg.vector_norm(v_pos, dim=dims, keepdim=True) * renorm
            norm = torch.linalg.vector_norm(v, dim=dims, keepdim=True)
            v = torch.where(norm >= cap, v * (cap / norm), v)
        return v

    return guided


def unpack_latents(packed: Tensor, height: int, width: int) -> Tensor:
    """(B, (h/2)·(w/2), 4C) packed 2x2 patches -> (B, C, h, w) latents, for latent height h and width w (BFL's
    ``b (h w) (c ph pw) -> b c (h ph) (w pw)``, the layout of diffusers' ``FluxPipeline._pack_latents``)."""
    batch, tokens, features = packed.shape
    if height % 2 or width % 2 or tokens != (height // 2) * (width // 2) or features % 4:
        raise ValueError(f"unpack_latents: {tuple(packed.shape)} is not a 2x2 packing of {height}x{width} latents")
    x = packed.view(batch, height // 2, width // 2, features // 4, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, features // 4, height, width)


def latent_noise(
    generators: Sequence[torch.Generator],
    height: int,
    width: int,
    channels: int = 16,
    downscale: int = 8,
    patch: int = 2,
) -> Tensor:
    """The initial noise of sd-scripts' SD3 samples (``sd3_train_utils.do_sample``) and of diffusers'
    ``StableDiffusion3Pipeline`` given one generator per image: each image draws ``randn(1, channels, H/f, W/f)``
    (f = ``downscale``, the VAE's: 8) from its generator (on the generator's device) in float32; returned as
    (B, channels, H/f, W/f). ``height`` and ``width`` must be multiples of ``patch``·f (:func:`image_seq_len`)."""
    image_seq_len(height, width, downscale, patch)
    shape = (1, channels, height // downscale, width // downscale)
    return torch.cat([torch.randn(shape, generator=g, device=g.device, dtype=torch.float32) for g in generators])


def packed_noise(
    generators: Sequence[torch.Generator], height: int, width: int, channels: int = 16, downscale: int = 8
) -> Tensor:
    """The initial noise drawn in the packed 2x2 layout (sd-scripts' FLUX samples) for an H x W image, one image per
    generator: each image draws ``randn(1, (H/16)·(W/16), 4·channels)`` in its packed layout from its generator (on
    the generator's device), as ``flux_train_utils.sample_image_inference`` and ``flux_minimal_inference.py`` do;
    returned unpacked as float32 (B, channels, H/8, W/8) (``downscale``: the VAE's factor, 8). A seeded CPU generator
    gives the same noise on every device (sd-scripts draws on the training device, in the model dtype)."""
    image_seq_len(height, width, downscale)
    h, w = height // downscale, width // downscale
    packed = [
        torch.randn(1, (h // 2) * (w // 2), 4 * channels, generator=g, device=g.device, dtype=torch.float32)
        for g in generators
    ]
    return unpack_latents(torch.cat(packed), h, w)
