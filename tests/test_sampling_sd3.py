"""SD3 / SD3.5 sampling with the flow-matching sampler: the static-shift schedule against diffusers'
FlowMatchEulerDiscreteScheduler and sd-scripts' get_all_sigmas (re-typed), the initial noise against sd-scripts'
do_sample, and our latents against diffusers' StableDiffusion3Pipeline(output_type="latent") for the same seed,
weights, prompt embeddings and CFG scale; SD3's prompt defaults (30 steps, CFG 7.5, empty negative prompt).

The sampler reads only the family's ``FlowSampling``: a toy family here wraps a tiny diffusers
SD3Transformer2DModel (the family contract's ``predict``: (B, 16, h, w) latents, t = σ·1000)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sampling_flow import ToyFlowFamily

from library.families.base import FlowSampling, Parts
from library.sampling import generate_batch, parse_prompt_line, resolve
from library.sampling.flow import discrete_flow_sigmas, latent_noise

SD3 = FlowSampling(embedded_guidance=False, shift=False, static_shift=3.0, packed_noise=False, default_steps=30,
                   default_scale=7.5)  # fmt: skip
PROMPTS = ("a red cat", "a dog", "blurry", "")


# sd-scripts v0.10.1 library/sd3_utils.py ModelSamplingDiscreteFlow and sd3_train_utils.get_all_sigmas, re-typed
class SdModelSamplingDiscreteFlow:
    def __init__(self, shift=1.0):
        self.shift = shift
        self.sigmas = self.sigma(torch.arange(1, 1000 + 1, 1))

    @property
    def sigma_min(self):
        return self.sigmas[0]

    @property
    def sigma_max(self):
        return self.sigmas[-1]

    def timestep(self, sigma):
        return sigma * 1000

    def sigma(self, timestep):
        timestep = timestep / 1000.0
        if self.shift == 1.0:
            return timestep
        return self.shift * timestep / (1 + (self.shift - 1) * timestep)


def sd_get_all_sigmas(sampling, steps):
    start = sampling.timestep(sampling.sigma_max)
    end = sampling.timestep(sampling.sigma_min)
    timesteps = torch.linspace(start, end, steps)
    sigs = [sampling.sigma(ts) for ts in timesteps]
    sigs += [0.0]
    return torch.FloatTensor(sigs)


@pytest.mark.parametrize("shift", [3.0, 1.0, 6.0])
@pytest.mark.parametrize("steps", [1, 2, 7, 30])
def test_discrete_schedule_equals_diffusers_and_sd_scripts(steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    ours = discrete_flow_sigmas(steps, shift)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)  # SD3's released config: shift 3.0
    scheduler.set_timesteps(steps)
    assert ours.shape == (steps + 1,) and ours.dtype == torch.float32 and ours[0] == 1 and ours[-1] == 0
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours, sd_get_all_sigmas(SdModelSamplingDiscreteFlow(shift), steps), rtol=0, atol=1e-6)
    if shift > 1 and steps > 1:  # the shift keeps more steps at high noise than the unshifted grid
        assert (ours[1:-1] > discrete_flow_sigmas(steps, 1.0)[1:-1]).all()


def test_latent_noise_equals_sd_scripts_do_sample():
    """sd-scripts' do_sample: torch.manual_seed(seed), then randn((1, 16, H/8, W/8)) in float32 on the CPU."""
    ours = latent_noise([torch.Generator().manual_seed(s) for s in (3, 11)], 64, 96)
    theirs = []
    for seed in (3, 11):
        torch.manual_seed(seed)
        theirs.append(torch.randn(1, 16, 8, 12, dtype=torch.float32, device="cpu"))
    assert torch.equal(ours, torch.cat(theirs))
    with pytest.raises(ValueError, match="multiple of 16"):
        latent_noise([torch.Generator()], 72, 64)


def test_static_shift_needs_dynamic_shift_off():
    with pytest.raises(ValueError, match="static_shift=3.0 needs shift=False"):
        FlowSampling(embedded_guidance=False, static_shift=3.0)


# ----------------------------------------------------------------------------------------------------------------------
# A toy SD3 family around a tiny diffusers SD3Transformer2DModel


class ToySD3(ToyFlowFamily):
    """The toy flow family with SD3's predict: the transformer on unpacked latents with the joint text embeddings and
    the pooled CLIP-L|CLIP-G embedding, timestep t = σ·1000 as StableDiffusion3Pipeline gives."""

    name = "toysd3"

    def predict(self, denoiser, noisy, t, cond, **options):
        self.predict_calls.append((noisy.shape[0], t.clone(), options))
        return denoiser(
            hidden_states=noisy, timestep=t, encoder_hidden_states=cond.hidden_states,
            pooled_projections=cond.pooled, return_dict=False,
        )[0]  # fmt: skip


@pytest.fixture(scope="module")
def sd3():
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16,
        qk_norm="rms_norm", dual_attention_layers=(0,),
    ).eval()  # fmt: skip
    vae = AutoencoderKL(
        block_out_channels=[8, 16, 16, 16], layers_per_block=1, latent_channels=16, norm_num_groups=8,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    embeds = {p: (torch.randn(1, 12, 32, generator=g), torch.randn(1, 64, generator=g)) for p in PROMPTS}
    return Parts(transformer, vae, [], [], {"shift": 3.0}, "toysd3"), embeds


def _pipeline(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=parts.denoiser, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=parts.vae,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
        tokenizer_3=None,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(family, parts, line, seeds, monkeypatch):
    """generate_batch (the public entry, dispatching on the objective) with the latents to decode captured."""
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    spec = parse_prompt_line(line)
    specs = [resolve(dataclasses.replace(spec, prompt=p), family, parts) for p in ("a red cat", "a dog")[: len(seeds)]]
    images = generate_batch(family, parts, specs, [torch.Generator().manual_seed(s) for s in seeds])
    assert [im.size for im in images] == [(specs[0].width, specs[0].height)] * len(seeds)
    return seen[0], specs


def _theirs(pipe, embeds, specs, seeds, output_type="latent"):
    """StableDiffusion3Pipeline on the same embeddings and per-image CPU generators (its own noise draw)."""
    spec = specs[0]
    neg = embeds[spec.negative_prompt or ""]
    scale = spec.scale
    return pipe(
        prompt_embeds=torch.cat([embeds[s.prompt][0] for s in specs]),
        pooled_prompt_embeds=torch.cat([embeds[s.prompt][1] for s in specs]),
        negative_prompt_embeds=neg[0].expand(len(specs), -1, -1),
        negative_pooled_prompt_embeds=neg[1].expand(len(specs), -1),
        height=spec.height, width=spec.width, num_inference_steps=spec.steps, guidance_scale=scale,
        generator=[torch.Generator().manual_seed(s) for s in seeds], output_type=output_type,
    ).images  # fmt: skip


@pytest.mark.parametrize(
    "line,seeds",
    [
        ("p --s 4", (5,)),  # SD3's defaults: CFG 7.5 with the empty negative prompt
        ("p --s 3 --l 4.0 --n blurry --w 96 --h 64", (5, 9)),  # a batch of two, a negative prompt, 96x64
        ("p --s 3 --l 1.0", (7,)),  # no CFG
    ],
)
def test_latents_equal_stable_diffusion3_pipeline(sd3, line, seeds, monkeypatch):
    parts, embeds = sd3
    family = ToySD3(SD3, embeds)
    ours, specs = _ours(family, parts, line, seeds, monkeypatch)
    theirs = _theirs(_pipeline(parts), embeds, specs, seeds)
    assert ours.shape == theirs.shape == (len(seeds), 16, specs[0].height // 8, specs[0].width // 8)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-6, f"max |ours - StableDiffusion3Pipeline| = {diff}"  # measured: 0 (bit-identical)
    cfg = specs[0].scale != 1.0
    assert [b for b, _, _ in family.predict_calls] == [len(seeds) * (2 if cfg else 1)] * specs[0].steps
    assert all(options == {} for _, _, options in family.predict_calls)  # no embedded guidance for SD3
    expected_t = discrete_flow_sigmas(specs[0].steps, 3.0)[:-1] * 1000
    torch.testing.assert_close(torch.stack([t[0] for _, t, _ in family.predict_calls]), expected_t)


def test_sd3_prompt_defaults(sd3):
    """SD3's sample defaults (sd-scripts' sd3_train_utils.sample_image_inference: 30 steps, scale 7.5); --g is
    noted and dropped (no embedded guidance), the sampler is always the Euler sampler."""
    parts, embeds = sd3
    family = ToySD3(SD3, embeds)
    spec = resolve(parse_prompt_line("a cat --g 3 --ss ddim"), family, parts)
    assert (spec.steps, spec.scale, spec.guidance, spec.sampler, spec.width) == (30, 7.5, None, "euler", 64)
    spec = resolve(parse_prompt_line("a cat --s 8 --l 2"), family, parts)
    assert (spec.steps, spec.scale) == (8, 2.0)
