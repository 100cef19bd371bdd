"""library/objectives/losses.py against torch's losses, sd-scripts' formulas typed out here, and the papers' closed forms."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from library.families.sd.tiny import SCHEDULE
from library.objectives.losses import (
    LossConfig,
    apply_mask,
    debiased_weight,
    diffusion_loss_per_sample,
    elementwise_loss,
    huber_c_for,
    min_snr_weight,
    resize_mask,
)
from library.objectives.noising import NoiseConfig, NoiseSchedule

B, C, H, W = 4, 4, 8, 8
T = torch.tensor([0, 250, 700, 999])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def schedule() -> NoiseSchedule:
    return NoiseSchedule.from_config(SCHEDULE)


@pytest.fixture(scope="module")
def ztsnr() -> NoiseSchedule:
    return NoiseSchedule.from_config(SCHEDULE, zero_terminal_snr=True)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, C, H, W, generator=gen(1)), torch.randn(B, C, H, W, generator=gen(2)) * 1.5


def table_snr(schedule: NoiseSchedule, t: torch.Tensor) -> list[float]:
    """SNR per sample straight from the table, in python floats."""
    return [schedule.alphas_cumprod[i].item() / (1 - schedule.alphas_cumprod[i].item()) for i in t.tolist()]


# ---------------------------------------------------------------------------------------------------- per element


def test_default_loss_is_plain_mse(pair, schedule):
    pred, target = pair
    loss = diffusion_loss_per_sample(pred.half(), target, T, LossConfig(), schedule).mean()
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, F.mse_loss(pred.half().float(), target), atol=1e-6, rtol=0)


def test_l2_l1_match_torch(pair):
    pred, target = pair
    torch.testing.assert_close(elementwise_loss(pred, target, "l2"), F.mse_loss(pred, target, reduction="none"))
    torch.testing.assert_close(elementwise_loss(pred, target, "l1"), F.l1_loss(pred, target, reduction="none"))


@pytest.mark.parametrize("loss_type", ["huber", "smooth_l1"])
def test_pseudo_huber_closed_form_and_limits(pair, loss_type):
    pred, target = pair
    c = torch.tensor([0.05, 0.1, 0.5, 1.0])
    out = elementwise_loss(pred, target, loss_type, c)
    for b in range(B):
        d, cb = (pred[b] - target[b]).double(), c[b].item()
        ref = 2 * (torch.sqrt(d * d + cb * cb) - cb) * (cb if loss_type == "huber" else 1.0)
        torch.testing.assert_close(out[b].double(), ref, atol=1e-6, rtol=1e-6)
    # huber: ~ d^2 where |d| << c and ~ 2c|d| where |d| >> c
    d = torch.tensor([[1e-3, 50.0]]).view(2, 1, 1, 1)
    near = elementwise_loss(d, torch.zeros_like(d), "huber", torch.tensor([1.0, 1e-3]))
    assert near[0].item() == pytest.approx(1e-6, rel=1e-3) and near[1].item() == pytest.approx(2e-3 * 50, rel=1e-3)


@pytest.mark.parametrize("huber_schedule", ["constant", "exponential", "snr"])
def test_huber_c_schedules_match_sd_scripts(schedule, huber_schedule):
    cfg = LossConfig(loss_type="huber", huber_schedule=huber_schedule, huber_c=0.2, huber_scale=1.5)
    got = huber_c_for(T, cfg, schedule)
    expected = []
    for t in T.tolist():
        if huber_schedule == "constant":
            expected.append(0.2 * 1.5)
        elif huber_schedule == "exponential":
            expected.append(math.exp(math.log(0.2) / 1000 * t) * 1.5)
        else:
            a = schedule.alphas_cumprod[t].item()
            expected.append((1 - 0.2) / (1 + math.sqrt((1 - a) / a)) ** 2 + 0.2)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_huber_snr_schedule_finite_at_zero_terminal_snr(ztsnr):
    c = huber_c_for(torch.tensor([999]), LossConfig(loss_type="huber", huber_c=0.1), ztsnr)
    assert c.item() == pytest.approx(0.1)  # sigma -> inf, so c -> huber_c


# ---------------------------------------------------------------------------------------------------- SNR weights


def reference_weights(snr: float, cfg: LossConfig) -> float:
    """sd-scripts' custom_train_functions, typed out per sample (with the SNR of the schedule in use)."""
    w = 1.0
    clamped = min(max(snr, 1e-3), 1000.0)
    if cfg.min_snr_gamma is not None:
        w *= min(snr, cfg.min_snr_gamma) / ((snr + 1) if cfg.v_parameterization else snr)
    if cfg.scale_v_pred_loss_like_noise_pred:
        w *= clamped / (clamped + 1)
    if cfg.v_pred_like_loss:
        w *= 1 + cfg.v_pred_like_loss * (clamped + 1) / clamped
    if cfg.debiased_estimation_loss:
        w *= 1 / (clamped + 1) if cfg.v_parameterization else 1 / math.sqrt(clamped)
    return w


WEIGHTED = [
    LossConfig(min_snr_gamma=5.0),
    LossConfig(min_snr_gamma=1.0, v_parameterization=True),
    LossConfig(debiased_estimation_loss=True),
    LossConfig(debiased_estimation_loss=True, v_parameterization=True),
    LossConfig(scale_v_pred_loss_like_noise_pred=True, v_parameterization=True, min_snr_gamma=5.0),
    LossConfig(v_pred_like_loss=0.3, min_snr_gamma=3.0, debiased_estimation_loss=True),
    LossConfig(loss_type="smooth_l1", huber_schedule="exponential", min_snr_gamma=5.0, prior_loss_weight=0.5),
]


@pytest.mark.parametrize("cfg", WEIGHTED)
def test_per_sample_loss_matches_direct_computation(pair, schedule, cfg):
    pred, target = pair
    is_reg = torch.tensor([False, True, False, True])
    weights = torch.where(is_reg, cfg.prior_loss_weight, 1.0)  # what the loader puts in Batch.loss_weights
    got = diffusion_loss_per_sample(pred, target, T, cfg, schedule, loss_weights=weights)
    c = huber_c_for(T, cfg, schedule)
    for b, snr in enumerate(table_snr(schedule, T)):
        d = (pred[b] - target[b]).double()
        if cfg.loss_type == "l2":
            element = d * d
        else:
            element = 2 * (torch.sqrt(d * d + c[b].double() ** 2) - c[b].double())
        prior = cfg.prior_loss_weight if is_reg[b] else 1.0
        expected = element.mean().item() * prior * reference_weights(snr, cfg)
        assert got[b].item() == pytest.approx(expected, rel=1e-5)


def test_min_snr_and_debiased_closed_forms():
    snr = torch.tensor([1e-4, 0.5, 5.0, 40.0, 1175.0], dtype=torch.float64)
    torch.testing.assert_close(min_snr_weight(snr, 5.0, False), torch.minimum(snr, torch.tensor(5.0)) / snr)
    torch.testing.assert_close(min_snr_weight(snr, 5.0, True), torch.minimum(snr, torch.tensor(5.0)) / (snr + 1))
    clamped = snr.clamp(1e-3, 1e3)
    torch.testing.assert_close(debiased_weight(snr, False), clamped.rsqrt())
    torch.testing.assert_close(debiased_weight(snr, True), 1 / (clamped + 1))


@pytest.mark.parametrize("cfg", WEIGHTED)
def test_snr_weights_finite_under_zero_terminal_snr(pair, ztsnr, cfg):
    pred, target = pair
    t = torch.tensor([0, 990, 998, 999])
    loss = diffusion_loss_per_sample(pred, target, t, cfg, ztsnr)
    assert torch.isfinite(loss).all()
    assert ztsnr.snr(t)[-1].item() == 0.0  # the rescaled schedule's SNR, as the model is trained on it
    if (
        cfg.loss_type == "l2"
        and cfg.min_snr_gamma is not None
        and not cfg.v_parameterization
        and not cfg.v_pred_like_loss
    ):
        # min(SNR, g)/SNR -> 1 as SNR -> 0: the terminal step keeps the plain epsilon loss
        assert loss[-1].item() == pytest.approx(F.mse_loss(pred[-1], target[-1]).item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------- masks


def test_resize_mask_is_block_mean():
    mask = torch.rand(2, 1, 64, 48, generator=gen(3))
    resized = resize_mask(mask, (8, 6))
    expected = mask.view(2, 1, 8, 8, 6, 8).mean(dim=(3, 5))
    torch.testing.assert_close(resized, expected)
    torch.testing.assert_close(resize_mask(mask[:, 0], (64, 48)), mask)  # (B, H, W) and already latent-sized


def image_mask(batch: int = B) -> torch.Tensor:
    """Image-resolution masks (8x larger than the latents): left part of each image, a different width per sample."""
    mask = torch.zeros(batch, 1, H * 8, W * 8)
    for b in range(batch):
        mask[b, :, :, : 8 * (b + 1)] = 1.0
    return mask


def test_masked_loss_is_sd_scripts_loss_times_mask(pair, schedule):
    pred, target = pair
    got = diffusion_loss_per_sample(pred, target, T, LossConfig(masked_loss=True), schedule, mask=image_mask())
    for b in range(B):
        element = (pred[b] - target[b]) ** 2
        expected = element[:, :, : b + 1].sum() / element.numel()  # latent columns 0..b, mean over all pixels
        assert got[b].item() == pytest.approx(expected.item(), rel=1e-5)


def test_unmasked_weight_and_normalisation(pair, schedule):
    pred, target = pair
    cfg = LossConfig(unmasked_weight=0.25, normalize_masked_area_loss=True)
    got = diffusion_loss_per_sample(pred, target, T, cfg, schedule, mask=image_mask())
    for b in range(B):
        element = (pred[b] - target[b]) ** 2
        weight = torch.full((H, W), 0.25)
        weight[:, : b + 1] = 1.0
        expected = (element * weight).sum() / (weight.sum() * C)  # weighted mean of the loss
        assert got[b].item() == pytest.approx(expected.item(), rel=1e-5)
    # a constant loss stays that constant whatever the mask, once normalised
    constant = torch.full((B, C, H, W), 3.0)
    masked = apply_mask(constant, image_mask(), LossConfig(normalize_masked_area_loss=True))
    torch.testing.assert_close(masked.mean(dim=(1, 2, 3)), torch.full((B,), 3.0))


def test_unmasked_probability(pair, schedule):
    pred, target = pair
    mask = image_mask()
    plain = diffusion_loss_per_sample(pred, target, T, LossConfig(), schedule)
    masked = diffusion_loss_per_sample(pred, target, T, LossConfig(), schedule, mask=mask)
    always = diffusion_loss_per_sample(
        pred, target, T, LossConfig(unmasked_probability=1.0), schedule, mask=mask, generator=gen()
    )
    torch.testing.assert_close(always, plain)
    g = gen(5)
    state = g.get_state()
    diffusion_loss_per_sample(pred, target, T, LossConfig(), schedule, mask=mask, generator=g)
    assert torch.equal(g.get_state(), state)  # probability 0 draws nothing
    half = diffusion_loss_per_sample(
        pred, target, T, LossConfig(unmasked_probability=0.5), schedule, mask=mask, generator=gen(5)
    )
    dropped = torch.rand(B, generator=gen(5)) < 0.5
    torch.testing.assert_close(half, torch.where(dropped, plain, masked))


def test_unmasked_probability_frequency():
    n, p = 20000, 0.3
    loss = torch.ones(n, 1, 2, 2)
    out = apply_mask(loss, torch.zeros(n, 1, 2, 2), LossConfig(unmasked_probability=p), gen(7))
    frequency = out.mean(dim=(1, 2, 3)).mean().item()  # 1 where unmasked, 0 where masked
    assert frequency == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / n))


def test_masked_loss_without_mask_raises(pair, schedule):
    with pytest.raises(ValueError, match="--masked_loss is set but the batch has no mask"):
        diffusion_loss_per_sample(*pair, T, LossConfig(masked_loss=True), schedule)


def test_loss_backpropagates(pair, schedule):
    pred = pair[0].clone().requires_grad_()
    cfg = LossConfig(loss_type="huber", min_snr_gamma=5.0, unmasked_weight=0.1, normalize_masked_area_loss=True)
    diffusion_loss_per_sample(pred, pair[1], T, cfg, schedule, mask=image_mask()).mean().backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and pred.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(min_snr_gamma=-1.0), r"--min_snr_gamma must be a finite number > 0"),
        (dict(min_snr_gamma=0.0), r"--min_snr_gamma must be a finite number > 0"),
        (dict(huber_c=0.0), r"--huber_c must be a finite number > 0"),
        (dict(huber_c=-0.1), r"--huber_c must be a finite number > 0"),
        (dict(huber_scale=0.0), r"--huber_scale must be a finite number > 0"),
        (dict(loss_type="mse"), r"--loss_type must be one of l2, l1, huber, smooth_l1, got 'mse'"),
        (dict(huber_schedule="linear"), r"--huber_schedule must be one of constant, exponential, snr"),
        (dict(v_pred_like_loss=-0.1), r"--v_pred_like_loss must be >= 0"),
        (dict(unmasked_probability=1.5), r"--unmasked_probability must be in \[0, 1\]"),
        (dict(unmasked_weight=-0.5), r"--unmasked_weight must be in \[0, 1\]"),
        (dict(prior_loss_weight=-1.0), r"--prior_loss_weight must be a finite number >= 0"),
    ],
)
def test_bad_loss_settings_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(scale_v_pred_loss_like_noise_pred=True),
            "--scale_v_pred_loss_like_noise_pred needs --v_parameterization",
        ),
        (
            dict(v_pred_like_loss=0.1, v_parameterization=True),
            "--v_pred_like_loss cannot be used with --v_parameterization",
        ),
    ],
)
def test_the_ddpm_objective_refuses_v_prediction_flags_that_contradict_it(kwargs, message):
    """The v-prediction loss flags against --v_parameterization are the DDPM objective's check (flow matching ignores
    them, as sd-scripts): made before anything loads, and again against the loaded model's own prediction type."""
    from library.objectives.ddpm import ddpm_objective, ddpm_problems

    (problem,) = ddpm_problems(NoiseConfig(), LossConfig(**kwargs))
    assert message in problem
    prediction = "v_prediction" if kwargs.get("v_parameterization") else "epsilon"
    with pytest.raises(ValueError, match=message):
        ddpm_objective("SD", prediction, {"num_train_timesteps": 1000}, NoiseConfig(), LossConfig(**kwargs))


def test_all_loss_errors_reported_at_once():
    with pytest.raises(ValueError) as info:
        LossConfig(huber_c=0.0, min_snr_gamma=-5.0, loss_type="l3")
    assert all(flag in str(info.value) for flag in ("--huber_c", "--min_snr_gamma", "--loss_type"))


def test_debiased_weight_has_no_lower_bound_without_zero_terminal_snr():
    """PixArt's linear schedule (β 1e-4 .. 0.02) reaches SNR 4e-5 at t = 999: the debiased weight there is sd-scripts'
    and OneTrainer's 1 / sqrt(SNR) (about 157), not the zero-terminal schedules' bounded 1 / sqrt(1e-3)."""
    from library.objectives.losses import snr_floor

    linear = NoiseSchedule.from_config(
        {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear"}
    )
    t = torch.tensor([500, 900, 999])
    snr = linear.snr(t)
    assert snr[-1].item() < 1e-4 and snr_floor(linear) == 0.0
    pred, target = torch.zeros(3, 4, 2, 2), torch.ones(3, 4, 2, 2)
    got = diffusion_loss_per_sample(pred, target, t, LossConfig(debiased_estimation_loss=True), linear)
    torch.testing.assert_close(got.double(), snr.rsqrt(), rtol=1e-6, atol=0)
    assert got[-1].item() > 100
    ztsnr = NoiseSchedule.from_config(
        {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"},
        zero_terminal_snr=True,
    )
    assert snr_floor(ztsnr) == 1e-3
    last = diffusion_loss_per_sample(pred[:1], target[:1], t[-1:], LossConfig(debiased_estimation_loss=True), ztsnr)
    assert last.item() == pytest.approx(1e-3**-0.5)  # SNR 0 there: the bounded weight
