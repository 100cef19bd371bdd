"""library/objectives/noising.py against diffusers' DDPMScheduler, sd-scripts' order of draws, direct loops and closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler

from library.families.sd.tiny import SCHEDULE
from library.objectives.noising import (
    NoiseConfig,
    NoiseSchedule,
    make_example,
    pyramid_noise,
    sample_timesteps,
    shift_unit,
)

SHAPE = (3, 4, 8, 12)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def diffusers_scheduler(config: dict, zero_terminal_snr: bool = False) -> DDPMScheduler:
    return DDPMScheduler.from_config(dict(config, rescale_betas_zero_snr=zero_terminal_snr))


class Reference:
    """diffusers' add_noise / get_velocity evaluated in float64 on the float64 table.

    Our table is checked against diffusers' own (float32) table to 1e-6 in test_schedule_matches_diffusers; the
    float32 cumprod of that table is off the exact value by up to 4.7e-7, which |x| ~ 5 latents turn into ~3e-6 in
    add_noise, so the formulas are compared on the same table (test_stock_diffusers_within_its_float32_error covers
    the stock scheduler).
    """

    def __init__(self, zero_terminal_snr: bool = False):
        self.scheduler = diffusers_scheduler(SCHEDULE, zero_terminal_snr)
        self.scheduler.alphas_cumprod = NoiseSchedule.from_config(
            SCHEDULE, zero_terminal_snr=zero_terminal_snr
        ).alphas_cumprod

    def add_noise(self, x, noise, t):
        return self.scheduler.add_noise(x.double(), noise.double(), t).float()

    def get_velocity(self, x, noise, t):
        return self.scheduler.get_velocity(x.double(), noise.double(), t).float()


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(SHAPE, generator=gen(123)) * 0.8 + 0.3


# ---------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear", "squaredcos_cap_v2"])
@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_schedule_matches_diffusers(beta_schedule, zero_terminal_snr):
    config = dict(SCHEDULE, beta_schedule=beta_schedule)
    ours = NoiseSchedule.from_config(config, zero_terminal_snr=zero_terminal_snr)
    theirs = diffusers_scheduler(config, zero_terminal_snr).alphas_cumprod.double()
    assert ours.alphas_cumprod.dtype == torch.float64 and ours.num_train_timesteps == 1000
    torch.testing.assert_close(ours.alphas_cumprod, theirs, atol=1e-6, rtol=0)


def test_schedule_reads_rescale_flag_and_trained_betas():
    flagged = NoiseSchedule.from_config(dict(SCHEDULE, rescale_betas_zero_snr=True))
    assert flagged.alphas_cumprod[-1] == 0
    betas = [0.1, 0.2, 0.5]
    trained = NoiseSchedule.from_config({"trained_betas": betas})
    torch.testing.assert_close(
        trained.alphas_cumprod, torch.tensor([0.9, 0.9 * 0.8, 0.9 * 0.8 * 0.5], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match=r"beta_schedule.*'laplace'.*scaled_linear"):
        NoiseSchedule.from_config(dict(SCHEDULE, beta_schedule="laplace"))


def test_zero_terminal_snr_properties():
    plain = NoiseSchedule.from_config(SCHEDULE)
    zt = NoiseSchedule.from_config(SCHEDULE, zero_terminal_snr=True)
    assert zt.alphas_cumprod[-1].item() == 0.0
    assert zt.alphas_cumprod[0].item() == pytest.approx(plain.alphas_cumprod[0].item(), abs=1e-12)
    assert torch.all(zt.alphas_cumprod[1:] < zt.alphas_cumprod[:-1])
    snr = zt.snr(torch.arange(1000))
    assert torch.isfinite(snr).all() and snr[-1].item() == 0.0
    # the SNR is the rescaled schedule's, not the original's (sd-scripts' table would give 0.00468 at t=999)
    a = diffusers_scheduler(SCHEDULE, True).alphas_cumprod.double()
    torch.testing.assert_close(snr[:-1], (a / (1 - a))[:-1], rtol=1e-3, atol=0)  # diffusers' float32 tail
    assert plain.snr(torch.tensor([999])).item() == pytest.approx(0.00468, rel=1e-2)


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_add_noise_and_velocity_match_diffusers(latents, zero_terminal_snr):
    ours = NoiseSchedule.from_config(SCHEDULE, zero_terminal_snr=zero_terminal_snr)
    theirs = Reference(zero_terminal_snr)
    x = torch.randn(64, 4, 16, 16, generator=gen(1)) * 2
    noise = torch.randn(x.shape, generator=gen(2))
    t = torch.cat([torch.tensor([0, 1, 998, 999]), torch.randint(0, 1000, (60,), generator=gen(3))])
    torch.testing.assert_close(ours.add_noise(x, noise, t), theirs.add_noise(x, noise, t), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.velocity(x, noise, t), theirs.get_velocity(x, noise, t), atol=1e-6, rtol=0)


def test_stock_diffusers_within_its_float32_error(latents):
    ours, theirs = NoiseSchedule.from_config(SCHEDULE), diffusers_scheduler(SCHEDULE)
    noise = torch.randn(SHAPE, generator=gen(1))
    t = torch.tensor([0, 517, 999])
    torch.testing.assert_close(
        ours.add_noise(latents, noise, t), theirs.add_noise(latents, noise, t), atol=3e-6, rtol=0
    )
    torch.testing.assert_close(
        ours.velocity(latents, noise, t), theirs.get_velocity(latents, noise, t), atol=3e-6, rtol=0
    )


def test_timesteps_out_of_range_raise(latents):
    schedule = NoiseSchedule.from_config(SCHEDULE)
    with pytest.raises(ValueError, match=r"timesteps must lie in \[0, 999\]"):
        make_example(NoiseConfig(), latents, schedule, gen(), timesteps=torch.tensor([0, 5, 1000]))


# ---------------------------------------------------------------------------------------------------- full example


@pytest.mark.parametrize("v_parameterization", [False, True])
def test_default_example_repeats_sd_scripts_draws(latents, v_parameterization):
    """Defaults: noise = randn_like, then t = randint(0, 1000), noisy = add_noise, target = noise or get_velocity."""
    cfg = NoiseConfig(v_parameterization=v_parameterization)
    noisy, target, t, noise = make_example(cfg, latents, NoiseSchedule.from_config(SCHEDULE), gen(7))
    g = gen(7)
    ref_noise = torch.randn(SHAPE, generator=g)
    ref_t = torch.randint(0, 1000, (SHAPE[0],), generator=g)
    sched = Reference()
    ref_target = sched.get_velocity(latents, ref_noise, ref_t) if v_parameterization else ref_noise
    assert torch.equal(t, ref_t) and t.dtype == torch.long
    torch.testing.assert_close(noise, ref_noise, atol=0, rtol=0)
    torch.testing.assert_close(noisy, sched.add_noise(latents, ref_noise, ref_t), atol=1e-6, rtol=0)
    torch.testing.assert_close(target, ref_target, atol=1e-6, rtol=0)


def test_injected_timesteps_and_noise_are_used_as_is(latents):
    schedule = NoiseSchedule.from_config(SCHEDULE)
    noise = torch.randn(SHAPE, generator=gen(3))
    t = torch.tensor([200, 400, 600])
    cfg = NoiseConfig(noise_offset=0.1, multires_noise_iterations=4)  # skipped: the noise is given
    g = gen(0)
    state = g.get_state()
    noisy, target, t_out, noise_out = make_example(cfg, latents, schedule, g, timesteps=t, noise=noise)
    assert torch.equal(g.get_state(), state)  # nothing drawn
    assert torch.equal(t_out, t) and torch.equal(noise_out, noise) and torch.equal(target, noise)
    torch.testing.assert_close(noisy, Reference().add_noise(latents, noise, t), atol=1e-6, rtol=0)


def test_same_generator_state_repeats_the_example(latents):
    cfg = NoiseConfig(
        noise_offset=0.05, noise_offset_random_strength=True, multires_noise_iterations=3, ip_noise_gamma=0.1
    )
    schedule = NoiseSchedule.from_config(SCHEDULE)
    g = gen(11)
    make_example(cfg, latents, schedule, g)
    state = g.get_state()
    first = make_example(cfg, latents, schedule, g)
    g.set_state(state)  # as a resumed run restores it
    again = make_example(cfg, latents, schedule, g)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_low_precision_latents(latents):
    noisy, target, _, noise = make_example(
        NoiseConfig(), latents.bfloat16(), NoiseSchedule.from_config(SCHEDULE), gen()
    )
    assert noisy.dtype == torch.bfloat16 and target.dtype == torch.float32 and noise.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- noise offset


@pytest.mark.parametrize("random_strength", [False, True])
@pytest.mark.parametrize("adaptive", [None, 0.5, -2.0])
def test_noise_offset_matches_formula(latents, random_strength, adaptive):
    cfg = NoiseConfig(noise_offset=0.1, noise_offset_random_strength=random_strength, adaptive_noise_scale=adaptive)
    t = torch.full((SHAPE[0],), 500)
    _, _, _, noise = make_example(cfg, latents, NoiseSchedule.from_config(SCHEDULE), gen(5), timesteps=t)
    g = gen(5)
    expected = torch.randn(SHAPE, generator=g)
    offset = 0.1 * torch.rand(1, generator=g).item() if random_strength else 0.1
    per_channel = torch.full((SHAPE[0], SHAPE[1], 1, 1), offset)
    if adaptive is not None:  # o + a * |mean over H, W|, floored at 0, per sample and channel
        for b in range(SHAPE[0]):
            for c in range(SHAPE[1]):
                per_channel[b, c] = max(0.0, offset + adaptive * abs(latents[b, c].mean().item()))
    expected = expected + per_channel * torch.randn((SHAPE[0], SHAPE[1], 1, 1), generator=g)
    torch.testing.assert_close(noise, expected, atol=1e-6, rtol=0)


def test_noise_offset_shifts_channel_means_by_its_scale():
    """A channel mean of H*W unit normals has std 1/sqrt(HW); the offset adds an independent o * N(0, 1)."""
    big = torch.zeros(4096, 4, 8, 8)
    schedule = NoiseSchedule.from_config(SCHEDULE)
    for offset, expected_std in [(None, 1 / 8), (0.3, math.sqrt(0.3**2 + 1 / 64))]:
        noise = make_example(NoiseConfig(noise_offset=offset), big, schedule, gen(2)).noise
        means = noise.mean(dim=(2, 3))
        assert means.std().item() == pytest.approx(expected_std, rel=0.03)
        assert abs(means.mean().item()) < 4 * expected_std / math.sqrt(means.numel())


# ---------------------------------------------------------------------------------------------------- pyramid noise


def pyramid_loop(noise: torch.Tensor, iterations: int, discount: float, g: torch.Generator) -> torch.Tensor:
    """Direct transcription of sd-scripts' pyramid_noise_like, with r drawn from the same generator."""
    b, c, d2, d3 = noise.shape
    upsample = torch.nn.Upsample(size=(d2, d3), mode="bilinear")
    for i in range(iterations):
        r = torch.rand(1, generator=g).item() * 2 + 2
        n2, n3 = max(1, int(d2 / (r**i))), max(1, int(d3 / (r**i)))
        noise = noise + upsample(torch.randn(b, c, n2, n3, generator=g)) * discount**i
        if n2 == 1 or n3 == 1:
            break
    return noise / noise.std()


@pytest.mark.parametrize(("shape", "iterations", "discount"), [((2, 4, 24, 40), 6, 0.3), ((2, 4, 8, 8), 10, 0.8)])
def test_pyramid_noise_matches_direct_loop(shape, iterations, discount):
    base = torch.randn(shape, generator=gen(9))
    g_ours, g_ref = gen(4), gen(4)
    ours = pyramid_noise(base, iterations, discount, g_ours)
    ref = pyramid_loop(base.clone(), iterations, discount, g_ref)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    assert torch.equal(g_ours.get_state(), g_ref.get_state())  # same number of draws (early stop at size 1)


def test_pyramid_noise_in_example_follows_offset(latents):
    cfg = NoiseConfig(noise_offset=0.1, multires_noise_iterations=5, multires_noise_discount=0.4)
    _, _, _, noise = make_example(cfg, latents, NoiseSchedule.from_config(SCHEDULE), gen(8))
    g = gen(8)
    ref = torch.randn(SHAPE, generator=g)
    ref = ref + 0.1 * torch.randn((SHAPE[0], SHAPE[1], 1, 1), generator=g)
    torch.testing.assert_close(noise, pyramid_loop(ref, 5, 0.4, g), atol=1e-6, rtol=0)


def test_pyramid_noise_keeps_unit_variance_and_adds_low_frequencies():
    base = torch.randn(512, 4, 32, 32, generator=gen(0))
    out = pyramid_noise(base, 8, 0.8, gen(1))
    assert out.std().item() == pytest.approx(1.0, abs=1e-5)
    assert out.mean().abs().item() < 0.05
    # variance over samples, averaged over positions (it varies with the position by design: the coarse levels of
    # one call share one grid, and bilinear interpolation between grid points has less variance than on them)
    assert out.var(dim=0).mean().item() == pytest.approx(1.0, abs=0.02)

    def neighbour_corr(x):
        a, b = x[..., :, :-1].flatten(), x[..., :, 1:].flatten()
        return torch.corrcoef(torch.stack([a, b]))[0, 1].item()

    assert abs(neighbour_corr(base)) < 0.01
    assert neighbour_corr(out) > 0.2  # the coarse levels correlate neighbouring latents (0.28 here)


# ---------------------------------------------------------------------------------------------------- ip noise


@pytest.mark.parametrize("random_strength", [False, True])
def test_input_perturbation_changes_input_not_target(latents, random_strength):
    cfg = NoiseConfig(ip_noise_gamma=0.1, ip_noise_gamma_random_strength=random_strength)
    noisy, target, t, noise = make_example(cfg, latents, NoiseSchedule.from_config(SCHEDULE), gen(6))
    g = gen(6)
    ref_noise = torch.randn(SHAPE, generator=g)
    ref_t = torch.randint(0, 1000, (SHAPE[0],), generator=g)
    gamma = 0.1 * torch.rand(1, generator=g).item() if random_strength else 0.1
    perturbed = ref_noise + gamma * torch.randn(SHAPE, generator=g)
    assert torch.equal(t, ref_t) and torch.equal(target, ref_noise) and torch.equal(noise, ref_noise)
    torch.testing.assert_close(noisy, Reference().add_noise(latents, perturbed, ref_t), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------- timesteps


def test_uniform_timesteps_are_sd_scripts_randint():
    cfg = NoiseConfig(min_timestep=100, max_timestep=300)
    t = sample_timesteps(cfg, 5000, 1000, gen(3))
    assert torch.equal(t, torch.randint(100, 300, (5000,), generator=gen(3)))
    assert t.min().item() == 100 and t.max().item() == 299
    constant = sample_timesteps(NoiseConfig(min_timestep=500, max_timestep=500), 4, 1000, gen())
    assert constant.tolist() == [500] * 4  # sd-scripts: min == max trains at that timestep


def unit_draws(cfg: NoiseConfig, n: int, g: torch.Generator) -> torch.Tensor:
    """The unit draw before the shift, typed out independently of the library."""
    if cfg.timestep_sampling == "uniform":
        return torch.rand(n, generator=g, dtype=torch.float64)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    if cfg.timestep_sampling == "logit_normal":
        return 1 / (1 + torch.exp(-(cfg.logit_mean + cfg.logit_std * z)))
    return 1 / (1 + torch.exp(-cfg.sigmoid_scale * z))


CONTINUOUS = [
    NoiseConfig(timestep_sampling="logit_normal", logit_mean=-0.5, logit_std=1.3),
    NoiseConfig(timestep_sampling="sigmoid", sigmoid_scale=0.7, timestep_shift=3.0),
    NoiseConfig(timestep_sampling="uniform", timestep_shift=2.0, min_timestep=50, max_timestep=950),
    NoiseConfig(timestep_sampling="logit_normal", timestep_shift=0.5, min_timestep=200),
]


@pytest.mark.parametrize("cfg", CONTINUOUS)
def test_continuous_timestep_draws_match_formula(cfg):
    lo, hi = cfg.min_timestep or 0, cfg.max_timestep or 1000
    u = unit_draws(cfg, 2000, gen(1))
    s = cfg.timestep_shift
    shifted = s * u / (1 + (s - 1) * u)
    expected = torch.clamp(lo + torch.floor(shifted * (hi - lo)), lo, hi - 1).long()
    assert torch.equal(sample_timesteps(cfg, 2000, 1000, gen(1)), expected)


def model_cdf(cfg: NoiseConfig, k: int) -> float:
    """P(t <= k) in closed form: t <= k  <=>  shifted u < x = (k - lo + 1)/(hi - lo)  <=>  u < x / (s - (s - 1) x)."""
    lo, hi, s = cfg.min_timestep or 0, cfg.max_timestep or 1000, cfg.timestep_shift
    x = min(1.0, max(0.0, (k - lo + 1) / (hi - lo)))
    y = x / (s - (s - 1) * x)
    if cfg.timestep_sampling == "uniform" or y in (0.0, 1.0):
        return y
    mean, std = (cfg.logit_mean, cfg.logit_std) if cfg.timestep_sampling == "logit_normal" else (0.0, cfg.sigmoid_scale)
    return 0.5 * (1 + math.erf((math.log(y / (1 - y)) - mean) / (std * math.sqrt(2))))


@pytest.mark.parametrize("cfg", CONTINUOUS)
def test_timestep_distribution_matches_closed_form_cdf(cfg):
    n = 20000
    t = sample_timesteps(cfg, n, 1000, gen(2))
    counts = torch.bincount(t, minlength=1000).double().cumsum(0) / n
    worst = max(abs(counts[k].item() - model_cdf(cfg, k)) for k in range(0, 1000, 7))
    assert worst < 0.015  # Kolmogorov-Smirnov 99.9% bound for n = 20000 is 0.0138


def test_sigmoid_is_logit_normal_with_zero_mean_and_shift_pushes_to_high_noise():
    a = sample_timesteps(NoiseConfig(timestep_sampling="sigmoid", sigmoid_scale=1.7), 500, 1000, gen(4))
    b = sample_timesteps(NoiseConfig(timestep_sampling="logit_normal", logit_std=1.7), 500, 1000, gen(4))
    assert torch.equal(a, b)
    u = torch.linspace(0, 1, 11, dtype=torch.float64)
    assert torch.equal(shift_unit(u, 1.0), u)
    assert torch.all(shift_unit(u, 3.0)[1:-1] > u[1:-1]) and shift_unit(u, 3.0)[-1] == 1.0


# ---------------------------------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(multires_noise_discount=1.5), r"--multires_noise_discount must be in \(0, 1\], got 1.5"),
        (dict(multires_noise_discount=0.0), r"--multires_noise_discount must be in \(0, 1\]"),
        (dict(multires_noise_iterations=-1), r"--multires_noise_iterations must be an integer >= 0"),
        (dict(multires_noise_iterations=2.5), r"--multires_noise_iterations must be an integer"),
        (dict(ip_noise_gamma=-0.1), r"--ip_noise_gamma must be >= 0"),
        (dict(noise_offset=-0.1), r"--noise_offset must be >= 0"),
        (dict(adaptive_noise_scale=0.01), r"--adaptive_noise_scale needs --noise_offset"),
        (dict(min_timestep=600, max_timestep=400), r"--min_timestep \(600\) must not exceed --max_timestep \(400\)"),
        (dict(min_timestep=-1), r"--min_timestep must be an integer in \[0, 999\]"),
        (dict(max_timestep=1001), r"--max_timestep must be an integer in \[1, 1000\]"),
        (dict(logit_std=0.0), r"--logit_std must be a finite number > 0"),
        (dict(timestep_shift=-1.0), r"--timestep_shift must be a finite number > 0"),
    ],
)
def test_bad_noise_settings_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NoiseConfig(**kwargs)


def test_the_ddpm_objective_refuses_a_timestep_law_it_does_not_have():
    """--timestep_sampling is a shared flag whose choices a flow family's script replaces; the DDPM objective checks
    the law it reads (before anything loads)."""
    from library.objectives.ddpm import ddpm_problems
    from library.objectives.losses import LossConfig

    (problem,) = ddpm_problems(NoiseConfig(timestep_sampling="cosmap"), LossConfig())
    assert "--timestep_sampling must be one of uniform, logit_normal, sigmoid" in problem
    assert ddpm_problems(NoiseConfig(timestep_sampling="logit_normal"), LossConfig()) == []


def test_all_noise_errors_reported_at_once():
    with pytest.raises(ValueError) as info:
        NoiseConfig(multires_noise_discount=2.0, ip_noise_gamma=-1.0, min_timestep=-5, max_timestep=2000)
    text = str(info.value)
    for flag in ("--multires_noise_discount", "--ip_noise_gamma", "--min_timestep", "--max_timestep"):
        assert flag in text
