"""The flow-matching objective against sd-scripts' FLUX.1 formulas re-typed from its source (v0.10.1:
library/flux_train_utils.py ``get_noisy_model_input_and_timesteps``, ``compute_density_for_timestep_sampling``,
``apply_model_prediction_type``, ``compute_loss_weighting_for_sd3``; flux_train_network.py
``get_noise_pred_and_target``; library/train_util.py ``get_huber_threshold_if_needed`` / ``conditional_loss``), drawn
from torch's global RNG as sd-scripts does while ours draws from a generator with the same seed; the σ table against
diffusers' ``FlowMatchEulerDiscreteScheduler``; each σ law against its CDF (Kolmogorov-Smirnov); the flags and the
warnings for what flow matching ignores.
"""

from __future__ import annotations

import argparse
import logging
import math

import numpy as np
import pytest
import torch

from library.cli.problems import ConfigError
from library.families.flux import objective as fo
from library.families.flux.objective import SIGMA_SCALED_WARNING, FlowMatchingObjective, flow_matching_objective
from library.families.sd3 import objective as so
from library.families.sd3.objective import SD3FlowObjective, sd3_flow_objective
from library.objectives import flow as fm
from library.objectives.ddpm import ddpm_problems
from library.objectives.losses import LossConfig, add_loss_args
from library.objectives.noising import NoiseConfig, add_noise_args

LATENTS = torch.randn(3, 4, 8, 6, generator=torch.Generator().manual_seed(0))
SEED = 1234


# ------------------------------------------------------------------------------------------------ sd-scripts, re-typed
class SdScriptsScheduler:
    """sd3_train_utils.FlowMatchEulerDiscreteScheduler.__init__ (the attributes the training path reads)."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0):
        timesteps = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy()
        timesteps = torch.from_numpy(timesteps).to(dtype=torch.float32)
        sigmas = timesteps / num_train_timesteps
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = sigmas * num_train_timesteps
        self.sigmas = sigmas
        self.num_train_timesteps = num_train_timesteps


def sd_density(weighting_scheme, batch_size, logit_mean, logit_std, mode_scale):
    if weighting_scheme == "logit_normal":
        u = torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), device="cpu")
        u = torch.nn.functional.sigmoid(u)
    elif weighting_scheme == "mode":
        u = torch.rand(size=(batch_size,), device="cpu")
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    else:
        u = torch.rand(size=(batch_size,), device="cpu")
    return u


def sd_loss_weighting(weighting_scheme, sigmas):
    if weighting_scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if weighting_scheme == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    return torch.ones_like(sigmas)


def sd_time_shift(mu, sigma, t):
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def sd_lin_function(x1=256, y1=0.5, x2=4096, y2=1.15):
    m = (y2 - y1) / (x2 - x1)
    b = y1 - m * x1
    return lambda x: m * x + b


def sd_noisy_model_input_and_timesteps(args, noise_scheduler, latents, noise):
    bsz, h, w = latents.shape[0], latents.shape[-2], latents.shape[-1]
    num_timesteps = noise_scheduler.num_train_timesteps
    if args.timestep_sampling == "uniform" or args.timestep_sampling == "sigmoid":
        if args.timestep_sampling == "sigmoid":
            sigmas = torch.sigmoid(args.sigmoid_scale * torch.randn((bsz,)))
        else:
            sigmas = torch.rand((bsz,))
        timesteps = sigmas * num_timesteps
    elif args.timestep_sampling == "shift":
        shift = args.discrete_flow_shift
        sigmas = torch.randn(bsz)
        sigmas = sigmas * args.sigmoid_scale
        sigmas = sigmas.sigmoid()
        sigmas = (sigmas * shift) / (1 + (shift - 1) * sigmas)
        timesteps = sigmas * num_timesteps
    elif args.timestep_sampling == "flux_shift":
        sigmas = torch.randn(bsz)
        sigmas = sigmas * args.sigmoid_scale
        sigmas = sigmas.sigmoid()
        mu = sd_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2))
        sigmas = sd_time_shift(mu, 1.0, sigmas)
        timesteps = sigmas * num_timesteps
    else:
        u = sd_density(args.weighting_scheme, bsz, args.logit_mean, args.logit_std, args.mode_scale)
        indices = (u * num_timesteps).long()
        timesteps = noise_scheduler.timesteps[indices]
        step_indices = [(noise_scheduler.timesteps == t).nonzero().item() for t in timesteps]  # get_sigmas
        sigmas = noise_scheduler.sigmas[step_indices].flatten()
    sigmas = sigmas.view(-1, 1, 1, 1)
    if args.ip_noise_gamma:
        xi = torch.randn_like(latents)
        if args.ip_noise_gamma_random_strength:
            ip_noise_gamma = torch.rand(1) * args.ip_noise_gamma
        else:
            ip_noise_gamma = args.ip_noise_gamma
        noisy_model_input = (1.0 - sigmas) * latents + sigmas * (noise + ip_noise_gamma * xi)
    else:
        noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
    return noisy_model_input, timesteps, sigmas


def sd_apply_model_prediction_type(args, model_pred, noisy_model_input, sigmas):
    weighting = None
    if args.model_prediction_type == "additive":
        model_pred = model_pred + noisy_model_input
    elif args.model_prediction_type == "sigma_scaled":
        model_pred = model_pred * (-sigmas) + noisy_model_input
        weighting = sd_loss_weighting(args.weighting_scheme, sigmas)
    return model_pred, weighting


def sd_step(args, latents, denoise=None):
    """get_noise_pred_and_target + process_batch's loss (l2, no mask, loss_weights 1), from the global RNG."""
    noise = torch.randn_like(latents)
    noisy, timesteps, sigmas = sd_noisy_model_input_and_timesteps(args, SdScriptsScheduler(1000, args.discrete_flow_shift), latents, noise)  # fmt: skip
    pred, weighting = sd_apply_model_prediction_type(args, (denoise or model)(noisy, timesteps), noisy, sigmas)
    target = noise - latents
    loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
    if weighting is not None:
        loss = loss * weighting
    return dict(noise=noise, noisy=noisy, timesteps=timesteps, sigmas=sigmas.flatten(), target=target,
                loss=loss.mean(dim=[1, 2, 3]))  # fmt: skip


def model(noisy, timesteps):
    """A stand-in denoiser whose output depends on both inputs."""
    return torch.tanh(noisy) * 0.7 + (timesteps / 1000).view(-1, 1, 1, 1) - 0.3


def ours_step(cfg: fo.FlowMatchingConfig, latents):
    objective = FlowMatchingObjective(cfg, LossConfig())
    ex = objective.example(latents, torch.Generator().manual_seed(SEED))
    loss = objective.loss_per_sample(objective.prediction(model(ex.noisy, ex.timesteps), ex), ex)
    return dict(noise=ex.noise, noisy=ex.noisy, timesteps=ex.timesteps, sigmas=ex.sigmas, target=ex.target, loss=loss)


CASES = [
    dict(timestep_sampling="uniform"),
    dict(timestep_sampling="sigmoid", sigmoid_scale=2.5),
    dict(timestep_sampling="shift", sigmoid_scale=1.5, discrete_flow_shift=3.1582),
    dict(timestep_sampling="flux_shift", sigmoid_scale=0.8),
    dict(timestep_sampling="sigma"),  # weighting_scheme uniform: uniform index
    dict(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=0.3, logit_std=1.2),
    dict(timestep_sampling="sigma", weighting_scheme="mode", mode_scale=1.29, discrete_flow_shift=1.0),
    dict(timestep_sampling="sigma", weighting_scheme="cosmap"),
    dict(timestep_sampling="sigma", weighting_scheme="sigma_sqrt"),
    dict(timestep_sampling="shift", weighting_scheme="none", ip_noise_gamma=0.1),
    dict(timestep_sampling="sigmoid", weighting_scheme="cosmap", ip_noise_gamma=0.2, ip_noise_gamma_random_strength=True),
]  # fmt: skip


@pytest.mark.parametrize("prediction_type", fm.MODEL_PREDICTION_TYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_example_prediction_type_and_weighting_equal_sd_scripts(case, prediction_type):
    cfg = fo.FlowMatchingConfig(**case, model_prediction_type=prediction_type)
    torch.manual_seed(SEED)
    theirs = sd_step(argparse.Namespace(**vars(cfg)), LATENTS)
    ours = ours_step(cfg, LATENTS)
    for key in ("noise", "noisy", "timesteps", "sigmas", "target"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-6, atol=0)
    assert ours["timesteps"].dtype == torch.float32 and len(set(ours["sigmas"].tolist())) == 3  # drawn per sample
    if prediction_type == "sigma_scaled" and cfg.weighting_scheme in ("cosmap", "sigma_sqrt"):  # the weight matters
        unweighted = ((ours_pred(cfg) - ours["target"]) ** 2).mean(dim=(1, 2, 3))
        assert not torch.allclose(unweighted, ours["loss"])


def ours_pred(cfg):
    objective = FlowMatchingObjective(cfg, LossConfig())
    ex = objective.example(LATENTS, torch.Generator().manual_seed(SEED))
    return objective.prediction(model(ex.noisy, ex.timesteps), ex)


def test_sigma_table_equals_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (1.0, 3.0, 3.1582):
        theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        sigmas, timesteps = fm.sigma_table(shift)
        torch.testing.assert_close(sigmas, theirs.sigmas[:1000].float(), rtol=0, atol=0)
        torch.testing.assert_close(timesteps, theirs.timesteps.float(), rtol=0, atol=0)


def test_flux_mu_is_sd_scripts_lin_function_of_the_packed_token_count():
    for h, w in ((128, 128), (64, 64), (96, 160), (33, 47)):  # 1024 / 512 px, and odd sides (floor halves)
        assert fo.flux_mu(h, w) == pytest.approx(sd_lin_function(y1=0.5, y2=1.15)((h // 2) * (w // 2)), rel=1e-12)
    assert fo.flux_mu(128, 128) == pytest.approx(1.15) and fo.flux_mu(32, 32) == pytest.approx(0.5)  # 4096 / 256


# ------------------------------------------------------------------------------------------------ σ laws
def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def logit(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x) - torch.log1p(-x)


def continuous_cdf(cfg: fo.FlowMatchingConfig, h: int, w: int):
    s, shift = cfg.sigmoid_scale, cfg.discrete_flow_shift
    if cfg.timestep_sampling == "uniform":
        return lambda x: x
    if cfg.timestep_sampling == "sigmoid":
        return lambda x: normal_cdf(logit(x) / s)
    if cfg.timestep_sampling == "shift":  # invert S v / (1 + (S - 1) v)
        return lambda x: normal_cdf(logit(x / (shift - (shift - 1) * x)) / s)
    mu = fo.flux_mu(h, w)  # flux_shift: invert e^mu / (e^mu + 1/v - 1)
    return lambda x: normal_cdf(logit(1 / (1 + math.exp(mu) * (1 / x - 1))) / s)


def unit_tail(cfg: fo.FlowMatchingConfig, y: torch.Tensor) -> torch.Tensor:
    """P(u' >= y) for the table-index draw u' of --timestep_sampling sigma."""
    if cfg.weighting_scheme == "logit_normal":
        return 1 - normal_cdf((logit(y) - cfg.logit_mean) / cfg.logit_std)
    if cfg.weighting_scheme == "mode":  # u' = f(u), f decreasing from 1 to 0: P(f(u) >= y) = f^-1(y), by bisection
        lo, hi = torch.zeros_like(y), torch.ones_like(y)
        for _ in range(60):
            mid = (lo + hi) / 2
            f = 1 - mid - cfg.mode_scale * (torch.cos(math.pi * mid / 2) ** 2 - 1 + mid)
            lo, hi = torch.where(f > y, mid, lo), torch.where(f > y, hi, mid)
        return (lo + hi) / 2
    return 1 - y


LAWS = [
    dict(timestep_sampling="uniform"),
    dict(timestep_sampling="sigmoid", sigmoid_scale=1.7),
    dict(timestep_sampling="shift", sigmoid_scale=1.0, discrete_flow_shift=3.0),
    dict(timestep_sampling="flux_shift", sigmoid_scale=1.0),
    dict(timestep_sampling="sigma", weighting_scheme="uniform", discrete_flow_shift=3.0),
    dict(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=-0.5, logit_std=0.8),
    dict(timestep_sampling="sigma", weighting_scheme="mode", mode_scale=1.29),
]  # fmt: skip
KS_CRITICAL_1E3 = 1.949  # sqrt(n) D above this: p < 0.001 (asymptotic Kolmogorov law; conservative for atoms)


@pytest.mark.parametrize("law", LAWS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_each_sigma_law_follows_its_cdf(law):
    cfg, n, (h, w) = fo.FlowMatchingConfig(**law), 6000, (64, 96)
    sigmas, timesteps = fo.sample_sigmas(cfg, n, (h, w), torch.Generator().manual_seed(7))
    torch.testing.assert_close(timesteps, sigmas * 1000, rtol=0, atol=0)
    x = sigmas.double().sort().values
    if cfg.timestep_sampling != "sigma":
        cdf = continuous_cdf(cfg, h, w)(x)
        i = torch.arange(1, n + 1, dtype=torch.float64)
        d = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max()
    else:  # atoms: the table's σ_i; P(σ <= σ_i) = P(index >= i) = P(u' >= i / 1000)
        table = fm.sigma_table(cfg.discrete_flow_shift)[0]
        assert set(sigmas.tolist()) <= set(table.tolist())
        index = torch.arange(1000, dtype=torch.float64)
        cdf = torch.where(index == 0, torch.ones_like(index), unit_tail(cfg, index / 1000))
        empirical = (x.unsqueeze(0) <= table.double().unsqueeze(1)).double().mean(dim=1)
        d = (empirical - cdf).abs().max()
    assert math.sqrt(n) * float(d) < KS_CRITICAL_1E3
    other = fo.FlowMatchingConfig(**{**law, "sigmoid_scale": 3.0, "logit_std": 2.5, "discrete_flow_shift": 6.0})
    if other != cfg and cfg.timestep_sampling != "uniform" and cfg.weighting_scheme != "mode":  # the test can fail
        moved, _ = fo.sample_sigmas(other, n, (h, w), torch.Generator().manual_seed(7))
        y = moved.double().sort().values
        if cfg.timestep_sampling != "sigma":
            d_other = (torch.arange(1, n + 1) / n - continuous_cdf(cfg, h, w)(y)).abs().max()
            assert math.sqrt(n) * float(d_other) > KS_CRITICAL_1E3


def test_flux_shift_grows_with_the_resolution():
    cfg = fo.FlowMatchingConfig(timestep_sampling="flux_shift")
    small, _ = fo.sample_sigmas(cfg, 2000, (32, 32), torch.Generator().manual_seed(3))
    large, _ = fo.sample_sigmas(cfg, 2000, (128, 128), torch.Generator().manual_seed(3))
    assert bool((large > small).all())  # same draws, larger mu: every σ moves up


def test_logit_normal_index_is_clamped_to_the_table():
    """sigmoid(z) rounds to 1.0 in float32 for z > ~17: sd-scripts would index the 1001st entry; ours the last."""
    cfg = fo.FlowMatchingConfig(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=40.0)
    sigmas, timesteps = fo.sample_sigmas(cfg, 8, (8, 8), torch.Generator().manual_seed(0))
    table_sigmas, table_timesteps = fm.sigma_table(3.0)
    assert torch.equal(sigmas, table_sigmas[-1].expand(8)) and torch.equal(timesteps, table_timesteps[-1].expand(8))


# ------------------------------------------------------------------------------------------------ fixed timesteps
def test_given_timesteps_fix_sigma_and_draw_only_the_noise():
    objective = FlowMatchingObjective(fo.FlowMatchingConfig(), LossConfig())
    t = torch.tensor([250.0, 500.0, 875.0])
    ex = objective.example(LATENTS, torch.Generator().manual_seed(1), timesteps=t)
    noise = torch.randn(LATENTS.shape, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ex.sigmas, t / 1000, rtol=0, atol=0)
    torch.testing.assert_close(ex.noise, noise, rtol=0, atol=0)
    s = (t / 1000).view(-1, 1, 1, 1)
    torch.testing.assert_close(ex.noisy, (1 - s) * LATENTS + s * noise, rtol=0, atol=0)
    assert objective.validation_timesteps() == [None] * 4  # sd-scripts' FLUX validation draws σ as in training
    with pytest.raises(ValueError, match=r"timesteps must have shape \(3,\)"):
        objective.example(LATENTS, timesteps=t[:2])


# ------------------------------------------------------------------------------------------------ loss types, mask
@pytest.mark.parametrize("loss_type,schedule", [("huber", "exponential"), ("smooth_l1", "constant"), ("l1", "snr")])
def test_loss_types_use_the_float_timesteps_as_sd_scripts(loss_type, schedule):
    cfg = fo.FlowMatchingConfig(timestep_sampling="uniform", model_prediction_type="raw")
    loss_cfg = LossConfig(loss_type=loss_type, huber_schedule=schedule, huber_c=0.2, huber_scale=1.5)
    objective = FlowMatchingObjective(cfg, loss_cfg)
    ex = objective.example(LATENTS, torch.Generator().manual_seed(2))
    pred = model(ex.noisy, ex.timesteps)
    ours = objective.loss_per_sample(objective.prediction(pred, ex), ex)
    t = ex.timesteps  # get_huber_threshold_if_needed + conditional_loss, re-typed
    if schedule == "exponential":
        c = torch.exp(-(-math.log(0.2) / 1000) * t) * 1.5
    else:
        c = torch.full((3,), 0.2 * 1.5)
    c = c.view(-1, 1, 1, 1)
    if loss_type == "huber":
        theirs = 2 * c * (torch.sqrt((pred - ex.target) ** 2 + c**2) - c)
    elif loss_type == "smooth_l1":
        theirs = 2 * (torch.sqrt((pred - ex.target) ** 2 + c**2) - c)
    else:
        theirs = (pred - ex.target).abs()
    torch.testing.assert_close(ours, theirs.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-7)


def test_mask_and_prior_weights_apply_after_the_sigma_weighting():
    cfg = fo.FlowMatchingConfig(timestep_sampling="sigmoid", weighting_scheme="cosmap")
    objective = FlowMatchingObjective(cfg, LossConfig(masked_loss=True))
    ex = objective.example(LATENTS, torch.Generator().manual_seed(4))
    pred = objective.prediction(model(ex.noisy, ex.timesteps), ex)
    mask = (torch.arange(6) < 3).float().expand(3, 1, 8, 6)
    weights = torch.tensor([1.0, 0.5, 2.0])
    ours = objective.loss_per_sample(pred, ex, mask=mask, loss_weights=weights)
    s = ex.sigmas.view(-1, 1, 1, 1)
    theirs = ((pred - ex.target) ** 2 * (2 / (math.pi * (1 - 2 * s + 2 * s**2))) * mask).mean(dim=(1, 2, 3))
    torch.testing.assert_close(ours, theirs * weights, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="--masked_loss is set but the batch has no mask"):
        objective.loss_per_sample(pred, ex)


# ------------------------------------------------------------------------------------------------ flags and warnings
def flow_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_noise_args(parser)
    add_loss_args(parser)
    return fo.add_flow_matching_args(parser)


def test_flow_flags_replace_the_shared_timestep_sampling_and_read_into_the_config():
    args = flow_parser().parse_args([])
    assert args.timestep_sampling == "sigma" and args.model_prediction_type == "sigma_scaled"
    assert fo.FlowMatchingConfig.from_args(args) == fo.FlowMatchingConfig()  # sd-scripts' defaults
    argv = ["--timestep_sampling", "flux_shift", "--sigmoid_scale", "1.5", "--discrete_flow_shift", "3.1582",
            "--weighting_scheme", "logit_normal", "--logit_mean", "0.5", "--logit_std", "2", "--mode_scale", "1.1",
            "--model_prediction_type", "raw", "--ip_noise_gamma", "0.05", "--ip_noise_gamma_random_strength"]  # fmt: skip
    args = flow_parser().parse_args(argv)
    assert fo.FlowMatchingConfig.from_args(args) == fo.FlowMatchingConfig(
        "flux_shift", 1.5, 3.1582, "logit_normal", 0.5, 2.0, 1.1, "raw", 0.05, True
    )
    assert NoiseConfig.from_args(args).timestep_sampling == "flux_shift"  # the shared flag holds the flow law
    with pytest.raises(SystemExit):  # an SD law is not a flow law
        flow_parser().parse_args(["--timestep_sampling", "logit_normal"])
    sd = argparse.ArgumentParser()
    add_noise_args(sd)
    assert NoiseConfig.from_args(sd.parse_args([])).timestep_sampling == "uniform"  # SD scripts: unchanged
    # sd-scripts ignores these for flow matching: no v-prediction cross-check (a warning when the objective is built);
    # the DDPM objective (an SD script) refuses the pair before anything loads
    args = flow_parser().parse_args(["--scale_v_pred_loss_like_noise_pred"])
    flow_loss = LossConfig.from_args(args)
    assert flow_loss.scale_v_pred_loss_like_noise_pred
    assert fo.objective_problems("Toy", NoiseConfig.from_args(args), flow_loss) == []
    sd_loss = argparse.ArgumentParser()
    add_loss_args(sd_loss)
    problems = ddpm_problems(
        NoiseConfig(), LossConfig.from_args(sd_loss.parse_args(["--scale_v_pred_loss_like_noise_pred"]))
    )
    assert any("needs --v_parameterization" in p for p in problems)
    shifted = flow_parser().parse_args(["--timestep_shift", "3"])
    problems = fo.objective_problems("Toy", NoiseConfig.from_args(shifted), LossConfig.from_args(shifted))
    assert any("--discrete_flow_shift" in p for p in problems)
    with pytest.raises(ConfigError, match="--logit_std must be a finite number > 0"):
        fo.FlowMatchingConfig(logit_std=0.0)


def test_flags_flow_matching_ignores_warn_once_and_change_nothing(caplog):
    argv = ["--model_prediction_type", "raw", "--timestep_sampling", "shift"]
    ignored = ["--noise_offset", "0.1", "--multires_noise_iterations", "6", "--min_snr_gamma", "5",
               "--debiased_estimation_loss", "--zero_terminal_snr", "--v_pred_like_loss", "0.2",
               "--min_timestep", "100", "--scale_v_pred_loss_like_noise_pred"]  # fmt: skip
    parser = flow_parser()
    plain, with_ignored = parser.parse_args(argv), parser.parse_args(argv + ignored)
    with caplog.at_level(logging.WARNING):
        a = flow_matching_objective("Toy", fo.FlowMatchingConfig.from_args(plain), NoiseConfig.from_args(plain),
                                    LossConfig.from_args(plain))  # fmt: skip
    assert caplog.records == []  # raw: nothing to say
    with caplog.at_level(logging.WARNING):
        b = flow_matching_objective("Toy", fo.FlowMatchingConfig.from_args(with_ignored),
                                    NoiseConfig.from_args(with_ignored), LossConfig.from_args(with_ignored))  # fmt: skip
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    for flag in ("--noise_offset", "--multires_noise_iterations", "--zero_terminal_snr", "--min_timestep",
                 "--min_snr_gamma", "--debiased_estimation_loss", "--v_pred_like_loss",
                 "--scale_v_pred_loss_like_noise_pred"):  # fmt: skip
        assert flag in message
    results = []
    for objective in (a, b):
        ex = objective.example(LATENTS, torch.Generator().manual_seed(9))
        results.append((ex, objective.loss_per_sample(objective.prediction(model(ex.noisy, ex.timesteps), ex), ex)))
    for x, y in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_sigma_scaled_warns_once_and_huber_snr_is_refused(caplog):
    args = flow_parser().parse_args([])
    noise, cfg = NoiseConfig.from_args(args), fo.FlowMatchingConfig.from_args(args)
    with caplog.at_level(logging.WARNING):
        flow_matching_objective("Toy", cfg, noise, LossConfig())
    assert [r.getMessage() for r in caplog.records] == [SIGMA_SCALED_WARNING]
    (problem,) = fo.objective_problems("Toy", noise, LossConfig(loss_type="huber", huber_schedule="snr"))
    assert "--huber_schedule snr needs a DDPM schedule" in problem and "constant or exponential" in problem
    assert fo.objective_problems("Toy", noise, LossConfig(loss_type="l2", huber_schedule="snr")) == []  # unread


# ------------------------------------------------------------------------------------------------ SD3's variant
def sd3_step(args, latents):
    """sd3_train_network.get_noise_pred_and_target + sd3_train_utils.get_noisy_model_input_and_timesteps, re-typed,
    with process_batch's l2 loss."""
    noise = torch.randn_like(latents)
    bsz = latents.shape[0]
    u = sd_density(args.weighting_scheme, bsz, args.logit_mean, args.logit_std, args.mode_scale)
    t_min = args.min_timestep if args.min_timestep is not None else 0
    t_max = args.max_timestep if args.max_timestep is not None else 1000
    shift = args.training_shift
    u = (u * shift) / (1 + (shift - 1) * u)
    indices = (u * (t_max - t_min) + t_min).long()
    timesteps = indices.to(dtype=torch.float32)
    sigmas = timesteps / 1000
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = sigmas * noise + (1.0 - sigmas) * latents
    model_pred = model(noisy_model_input, timesteps) * (-sigmas) + noisy_model_input
    weighting = sd_loss_weighting(args.weighting_scheme, sigmas)
    loss = torch.nn.functional.mse_loss(model_pred.float(), latents.float(), reduction="none") * weighting
    return dict(noise=noise, noisy=noisy_model_input, timesteps=timesteps, sigmas=sigmas.flatten(), target=latents,
                loss=loss.mean(dim=[1, 2, 3]))  # fmt: skip


SD3_CASES = [
    dict(weighting_scheme="uniform"),
    dict(weighting_scheme="logit_normal", logit_mean=0.2, logit_std=1.3, training_shift=3.0),
    dict(weighting_scheme="mode", mode_scale=1.29, min_timestep=100, max_timestep=900),
    dict(weighting_scheme="cosmap", training_shift=2.0),
    dict(weighting_scheme="sigma_sqrt", min_timestep=200),
]  # fmt: skip


@pytest.mark.parametrize("case", SD3_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_sd3_variant_equals_sd_scripts(case):
    cfg = so.SD3FlowConfig(**case)
    torch.manual_seed(SEED)
    theirs = sd3_step(argparse.Namespace(**vars(cfg)), LATENTS)
    objective = SD3FlowObjective(cfg, LossConfig())
    ex = objective.example(LATENTS, torch.Generator().manual_seed(SEED))
    ours = dict(noise=ex.noise, noisy=ex.noisy, timesteps=ex.timesteps, sigmas=ex.sigmas, target=ex.target,
                loss=objective.loss_per_sample(objective.prediction(model(ex.noisy, ex.timesteps), ex), ex))  # fmt: skip
    for key in ("noise", "noisy", "timesteps", "sigmas", "target"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-6, atol=0)
    assert torch.equal(ex.timesteps, ex.timesteps.round())  # integer timesteps, as floats
    lo, hi = cfg.timestep_range
    assert objective.validation_timesteps() == [round(lo + (hi - lo) * k / 5) for k in range(1, 5)]


@pytest.mark.parametrize("law", [dict(weighting_scheme="logit_normal", logit_mean=0.3, training_shift=3.0),
                                 dict(weighting_scheme="mode", min_timestep=100, max_timestep=700)],
                         ids=["logit_normal-shift3", "mode-100-700"])  # fmt: skip
def test_sd3_timestep_law_follows_its_cdf(law):
    cfg, n = so.SD3FlowConfig(**law), 6000
    _, timesteps = so.sample_sd3_timesteps(cfg, n, torch.Generator().manual_seed(11))
    lo, hi = cfg.timestep_range
    assert lo <= int(timesteps.min()) and int(timesteps.max()) < hi
    k = torch.arange(lo, hi, dtype=torch.float64)  # P(t <= k) = P(u' < (k + 1 - lo) / (hi - lo)), u' = shift(u)
    y = ((k + 1 - lo) / (hi - lo)).clamp(max=1 - 1e-12)
    s = cfg.training_shift
    cdf = 1 - unit_tail(fo.FlowMatchingConfig(weighting_scheme=cfg.weighting_scheme, logit_mean=cfg.logit_mean,
                                              logit_std=cfg.logit_std, mode_scale=cfg.mode_scale),
                        y / (s - (s - 1) * y))  # fmt: skip
    empirical = (timesteps.double().unsqueeze(0) <= k.unsqueeze(1)).double().mean(dim=1)
    assert math.sqrt(n) * float((empirical - cdf).abs().max()) < KS_CRITICAL_1E3


def test_sd3_flags_read_into_its_config_and_ignore_ip_noise(caplog):
    parser = argparse.ArgumentParser()
    add_noise_args(parser)
    add_loss_args(parser)
    so.add_sd3_flow_args(parser)
    args = parser.parse_args(["--weighting_scheme", "logit_normal", "--training_shift", "3", "--min_timestep",
                              "100", "--ip_noise_gamma", "0.1"])  # fmt: skip
    noise = NoiseConfig.from_args(args)
    cfg = so.SD3FlowConfig.from_args(args)
    assert cfg == so.SD3FlowConfig("logit_normal", 0.0, 1.0, 1.29, 3.0, 100, None)
    with caplog.at_level(logging.WARNING):
        objective = sd3_flow_objective("SD3", cfg, noise, LossConfig.from_args(args))
    assert isinstance(objective, SD3FlowObjective) and len(caplog.records) == 1
    assert "--ip_noise_gamma" in caplog.records[0].getMessage()
    assert "--min_timestep" not in caplog.records[0].getMessage()  # SD3 reads it
    sigmoid = NoiseConfig.from_args(parser.parse_args(["--timestep_sampling", "sigmoid"]))
    assert any("not read by SD3" in p for p in so.objective_problems("SD3", sigmoid, LossConfig()))


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", ["sigma", "flux_shift"])
def test_cuda_with_a_cpu_generator_repeats_the_cpu_run(sampling):
    """Every draw comes from the generator's device: a CUDA run with a CPU generator gives the CPU run's example and
    loss, on the GPU."""
    cfg = fo.FlowMatchingConfig(timestep_sampling=sampling, weighting_scheme="logit_normal", ip_noise_gamma=0.1,
                                ip_noise_gamma_random_strength=True)  # fmt: skip
    loss_cfg = LossConfig(loss_type="huber", huber_schedule="exponential")
    out = []
    for device in ("cpu", "cuda"):
        objective = FlowMatchingObjective(cfg, loss_cfg).to(device)
        ex = objective.example(LATENTS.to(device), torch.Generator().manual_seed(3))
        out.append((ex, objective.loss_per_sample(objective.prediction(model(ex.noisy, ex.timesteps), ex), ex)))
    (cpu_ex, cpu_loss), (gpu_ex, gpu_loss) = out
    for a, b in zip(cpu_ex, gpu_ex):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, atol=1e-5, rtol=1e-5)


def test_the_shared_readers_know_no_objective_and_the_family_reads_its_own_flags():
    """The shared noise / loss readers read the same values from a flow script's command line as from an SD
    script's (no flag tells them which objective runs); the flow settings are the family's options' (training only)."""
    from library.families.flux.options import FluxOptions

    sd = argparse.ArgumentParser()
    add_noise_args(sd)
    add_loss_args(sd)
    argv = ["--noise_offset", "0.1", "--min_snr_gamma", "5"]
    sd_args, flow_args = sd.parse_args(argv), flow_parser().parse_args(argv)
    assert LossConfig.from_args(flow_args) == LossConfig.from_args(sd_args)
    shared = {k: v for k, v in vars(NoiseConfig.from_args(sd_args)).items() if k != "timestep_sampling"}
    assert {k: v for k, v in vars(NoiseConfig.from_args(flow_args)).items() if k != "timestep_sampling"} == shared
    assert FluxOptions.from_args(flow_args, training=True).flow == fo.FlowMatchingConfig()
    assert FluxOptions.from_args(flow_args, training=False).flow is None
