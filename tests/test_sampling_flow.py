"""Flow-matching sampling (FLUX.1 dev / schnell): the schedule against sd-scripts' get_schedule, our sampler's latents
against diffusers' FluxPipeline (embedded guidance, no shift for schnell, true CFG), sd-scripts' initial noise, the
prompt options --g / --l / --ss for a flow family vs SD, and the dispatch by objective.

The FLUX family is not in this module's reach: a toy flow family wraps a tiny diffusers FluxTransformer2DModel with
the pipeline's own packing helpers (the FLUX family's ``predict`` contract: (B, 16, h, w) latents, t = σ·1000)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch

from library.families.base import FlowSampling, Parts
from library.sampling import PromptSpec, generate_batch, generate_flow_latents, parse_prompt_line, resolve
from library.sampling.flow import flow_sigmas, packed_noise, sample_euler, unpack_latents, with_cfg

DEV = FlowSampling(embedded_guidance=True, shift=True)
SCHNELL = FlowSampling(embedded_guidance=False, shift=False)
PROMPTS = ("a red cat", "a dog", "blurry", "")


# sd-scripts v0.10.1 library/flux_train_utils.py, re-typed from its source (time_shift, get_lin_function, get_schedule)
def sd_time_shift(mu, sigma, t):
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def sd_get_lin_function(x1=256, y1=0.5, x2=4096, y2=1.15):
    m = (y2 - y1) / (x2 - x1)
    b = y1 - m * x1
    return lambda x: m * x + b


def sd_get_schedule(num_steps, image_seq_len, base_shift=0.5, max_shift=1.15, shift=True):
    timesteps = torch.linspace(1, 0, num_steps + 1)
    if shift:
        mu = sd_get_lin_function(y1=base_shift, y2=max_shift)(image_seq_len)
        timesteps = sd_time_shift(mu, 1.0, timesteps)
    return timesteps.tolist()


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("steps,seq_len", [(1, 16), (4, 256), (20, 1024), (28, 4096), (50, 6144)])
def test_schedule_equals_sd_scripts_get_schedule(steps, seq_len, shift):
    ours = flow_sigmas(steps, seq_len, shift=shift)
    theirs = torch.tensor(sd_get_schedule(steps, seq_len, shift=shift))
    assert ours.shape == (steps + 1,) and ours[0] == 1 and ours[-1] == 0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    if shift and steps > 1:  # the shift moves every inner sigma up (towards noise), more for longer sequences
        assert (ours[1:-1] > torch.linspace(1, 0, steps + 1)[1:-1]).all()


def test_euler_integrates_a_known_flow_exactly():
    """For a constant velocity field v = noise - x0 the flow is a straight line: Euler reaches x0 exactly from any
    schedule (the rectified-flow property); and with_cfg combines the halves of the doubled batch."""
    x0, noise = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    out = sample_euler(lambda x, s: noise - x0, noise, flow_sigmas(5, 1024))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    seen = []

    def doubled(x, sigma):
        seen.append((x.shape[0], sigma.shape[0]))
        return torch.cat([torch.full_like(x[:2], 1.0), torch.full_like(x[2:], 3.0)])

    assert torch.equal(with_cfg(doubled, 4.0)(noise, torch.ones(2)), torch.full_like(noise, 1 + 4 * (3 - 1)))
    assert seen == [(4, 4)]


# ----------------------------------------------------------------------------------------------------------------------
# A toy flow family around tiny diffusers models


@dataclasses.dataclass
class ToyCond:
    """Like ``Cond`` with the T5 attention mask the FLUX family adds (the sampler handles any tensor fields)."""

    hidden_states: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def to(self, *args, **kwargs):
        fields = (self.hidden_states, self.pooled, self.mask)
        return ToyCond(*(t.to(*args, **kwargs) if t is not None else None for t in fields))


class ToyFlowFamily:
    """What sampling asks of a flow-matching family, but ``predict``: objective, flow_sampling, encode_prompt (looked
    up in ``embeds``: caption -> (hidden states, pooled)), decode_latents (scale and shift), default_resolution."""

    def __init__(self, settings: FlowSampling, embeds: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.settings, self.embeds, self.predict_calls = settings, embeds, []

    def objective(self, parts):
        return "flow_matching"

    def flow_sampling(self, parts):
        return self.settings

    def default_resolution(self, prediction_type="epsilon"):
        return 64

    def encode_prompt(self, parts, captions, clip_skip=None, max_token_length=None):
        hidden, pooled = zip(*(self.embeds[c] for c in captions))
        return ToyCond(torch.cat(hidden), torch.cat(pooled))

    def decode_latents(self, parts, latents):
        vae = parts.vae
        return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample


class ToyFlux(ToyFlowFamily):
    """The toy flow family with FLUX's predict: packed 2x2 tokens, ids and guidance, as FluxPipeline builds them."""

    name = "toyflux"

    def predict(self, denoiser, noisy, t, cond, **options):
        from diffusers import FluxPipeline

        self.predict_calls.append((noisy.shape[0], t.clone(), options.get("guidance")))
        b, c, h, w = noisy.shape
        packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
        txt_ids = torch.zeros(cond.hidden_states.shape[1], 3)
        out = denoiser(
            hidden_states=packed, timestep=t / 1000, guidance=options.get("guidance"),
            pooled_projections=cond.pooled, encoder_hidden_states=cond.hidden_states, txt_ids=txt_ids,
            img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        return FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)


def _tiny(guidance_embeds: bool):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip
    vae = AutoencoderKL(
        block_out_channels=[8, 16, 16, 16], layers_per_block=1, latent_channels=16, norm_num_groups=8,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    embeds = {p: (torch.randn(1, 8, 32, generator=g), torch.randn(1, 32, generator=g)) for p in PROMPTS}
    parts = Parts(transformer, vae, [], [], {}, "toyflux")
    return parts, embeds


@pytest.fixture(scope="module")
def dev():
    return _tiny(guidance_embeds=True)


@pytest.fixture(scope="module")
def schnell():
    return _tiny(guidance_embeds=False)


def _pipeline(parts, settings):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    scheduler = (  # FLUX.1-dev's and FLUX.1-schnell's released scheduler configs
        FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
        if settings.shift
        else FlowMatchEulerDiscreteScheduler()
    )
    pipe = FluxPipeline(scheduler, parts.vae, None, None, None, None, parts.denoiser)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(family, parts, spec, seeds, monkeypatch):
    """generate_batch (the public entry, dispatching on the objective) with the decoded latents captured."""
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    specs = [dataclasses.replace(spec, prompt=p) for p in ("a red cat", "a dog")[: len(seeds)]]
    specs = [resolve(s, family, parts) for s in specs]
    images = generate_batch(family, parts, specs, [torch.Generator().manual_seed(s) for s in seeds])
    assert [im.size for im in images] == [(spec.width or 64, spec.height or 64)] * len(seeds)
    return seen[0], specs[0]


def _theirs(pipe, embeds, spec, seed, *, true_cfg=None, guidance=3.5):
    """FluxPipeline on the same embeddings, with sd-scripts' packed noise for ``seed`` handed over as ``latents``."""
    h, w = spec.height // 8, spec.width // 8
    packed = torch.randn(1, (h // 2) * (w // 2), 64, generator=torch.Generator().manual_seed(seed))
    kwargs = {}
    if true_cfg is not None:
        kwargs = dict(true_cfg_scale=true_cfg, negative_prompt_embeds=embeds[spec.negative_prompt][0],
                      negative_pooled_prompt_embeds=embeds[spec.negative_prompt][1])  # fmt: skip
    out = pipe(
        prompt_embeds=embeds[spec.prompt][0], pooled_prompt_embeds=embeds[spec.prompt][1], height=spec.height,
        width=spec.width, num_inference_steps=spec.steps, guidance_scale=guidance, latents=packed,
        output_type="latent", **kwargs,
    ).images  # fmt: skip
    return pipe._unpack_latents(out, spec.height, spec.width, 8)


def test_noise_is_sd_scripts_packed_draw():
    """sd-scripts draws randn(1, (H/16)(W/16), 64) from the seed in the packed layout; unpacked with diffusers'
    helper it is our (B, 16, H/8, W/8) noise, one generator per image."""
    from diffusers import FluxPipeline

    ours = packed_noise([torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)], 64, 96)
    assert ours.shape == (2, 16, 8, 12)
    for row, seed in enumerate((5, 6)):
        packed = torch.randn(1, 4 * 6, 64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ours[row : row + 1], FluxPipeline._unpack_latents(packed, 64, 96, 8))
        assert torch.equal(unpack_latents(packed, 8, 12), ours[row : row + 1])
    with pytest.raises(ValueError, match="multiple of 16"):
        packed_noise([torch.Generator()], 72, 64)


def test_dev_latents_equal_flux_pipeline_with_embedded_guidance(dev, monkeypatch):
    """FLUX.1 dev: shifted schedule, --g as the guidance input, no CFG: our latents == FluxPipeline's (unpacked),
    same seed, weights and prompt embeddings; every image of a batch equals its own pipeline run."""
    parts, embeds = dev
    family = ToyFlux(DEV, embeds)
    spec = parse_prompt_line("a red cat --n blurry --g 2.5 --s 3 --w 64 --h 96")
    latents, resolved = _ours(family, parts, spec, (11, 12), monkeypatch)
    assert resolved.guidance == 2.5 and resolved.scale == 1.0 and resolved.sampler == "euler"
    assert latents.shape == (2, 16, 12, 8)
    pipe = _pipeline(parts, DEV)
    for row, (prompt, seed) in enumerate((("a red cat", 11), ("a dog", 12))):
        theirs = _theirs(pipe, embeds, dataclasses.replace(resolved, prompt=prompt), seed, guidance=2.5)
        torch.testing.assert_close(latents[row : row + 1], theirs, rtol=0, atol=2e-5)
    # one model call per step (no CFG at --l 1), t = sigma * 1000 of the shifted schedule, guidance per sample
    calls = family.predict_calls
    assert [c[0] for c in calls] == [2, 2, 2]
    sigmas = flow_sigmas(3, 4 * 6, shift=True)
    assert torch.allclose(torch.stack([c[1][0] for c in calls]), sigmas[:-1] * 1000)
    assert all(torch.equal(c[2], torch.full((2,), 2.5)) for c in calls)
    # the guidance input matters: another --g gives other latents
    other, _ = _ours(ToyFlux(DEV, embeds), parts, dataclasses.replace(spec, guidance=1.0), (11, 12), monkeypatch)
    assert (other - latents).abs().max() > 1e-3


def test_schnell_latents_equal_flux_pipeline_without_shift(schnell, monkeypatch):
    """FLUX.1 schnell: unshifted schedule, no guidance input (a --g is noted and dropped): == FluxPipeline with
    schnell's scheduler config."""
    parts, embeds = schnell
    family = ToyFlux(SCHNELL, embeds)
    spec = PromptSpec("a red cat", width=64, height=64, steps=4, guidance=3.0)
    latents, resolved = _ours(family, parts, spec, (3,), monkeypatch)
    assert resolved.guidance is None
    assert all(c[2] is None for c in family.predict_calls)
    theirs = _theirs(_pipeline(parts, SCHNELL), embeds, resolved, 3)
    torch.testing.assert_close(latents, theirs, rtol=0, atol=2e-5)
    torch.testing.assert_close(family.predict_calls[1][1], torch.full((1,), 750.0))  # linspace(1, 0, 5)[1] * 1000


def test_true_cfg_equals_flux_pipeline_true_cfg_scale(dev, monkeypatch):
    """--l 4 with --n: v = v_neg + 4 (v_pos - v_neg), the negative first in one doubled batch (sd-scripts) ==
    FluxPipeline's true_cfg_scale with the negative embeddings (two passes)."""
    parts, embeds = dev
    family = ToyFlux(DEV, embeds)
    spec = parse_prompt_line("a red cat --n blurry --l 4 --s 2 --w 64 --h 64")
    latents, resolved = _ours(family, parts, spec, (7,), monkeypatch)
    assert resolved.guidance == 3.5 and [c[0] for c in family.predict_calls] == [2, 2]
    theirs = _theirs(_pipeline(parts, DEV), embeds, resolved, 7, true_cfg=4.0)
    torch.testing.assert_close(latents, theirs, rtol=0, atol=2e-5)
    no_cfg = _theirs(_pipeline(parts, DEV), embeds, resolved, 7)
    assert (latents - no_cfg).abs().max() > 1e-3  # CFG changed the result


# ----------------------------------------------------------------------------------------------------------------------
# Prompt options and defaults: flow family vs SD


def test_g_is_parsed_and_read_by_embedded_guidance_families_only(dev, schnell, tiny_parts, caplog):
    from library.families import get_family
    from library.sampling.prompts import parse_prompt_table

    spec = parse_prompt_line("a cat --g 2.0 --l 3 --ss euler_a")
    assert spec.guidance == 2.0 and spec.scale == 3.0
    assert parse_prompt_table({"prompt": "a cat", "guidance_scale": 0}, where="x").guidance == 0.0
    with pytest.raises(ValueError, match="--g"):
        parse_prompt_line("a cat --g -1")
    with caplog.at_level(logging.INFO):
        sd = resolve(spec, get_family("sd1"), tiny_parts["sd1"])
        assert sd.guidance is None and sd.sampler == "euler_a" and "embedded guidance (--g)" in caplog.text
        caplog.clear()
        flux = resolve(spec, ToyFlux(DEV, dev[1]), dev[0], sampler="dpmsolver++")
        assert (flux.guidance, flux.scale, flux.sampler) == (2.0, 3.0, "euler")
        assert "sampler 'euler_a' ignored" in caplog.text
        caplog.clear()
        flux = resolve(PromptSpec("a cat", guidance=2.0), ToyFlux(SCHNELL, schnell[1]), schnell[0])
        assert flux.guidance is None and "--g 2.0 ignored" in caplog.text
    # defaults: sd-scripts' FLUX sample defaults (20 steps, --g 3.5, --l 1.0) vs SD's (30 steps, 7.5)
    flux = resolve(PromptSpec("a cat"), ToyFlux(DEV, dev[1]), dev[0], sampler="ddim")
    assert (flux.steps, flux.guidance, flux.scale, flux.sampler, flux.width) == (20, 3.5, 1.0, "euler", 64)
    sd = resolve(PromptSpec("a cat"), get_family("sd1"), tiny_parts["sd1"])
    assert (sd.steps, sd.guidance, sd.scale, sd.sampler) == (30, None, 7.5, "ddim")


def test_flow_sampling_refuses_what_it_cannot_do(dev):
    parts, embeds = dev
    family = ToyFlux(DEV, embeds)
    spec = resolve(PromptSpec("a red cat", width=72, height=64, steps=2), family, parts)
    with pytest.raises(ValueError, match="width 72 must be a multiple of 16.*try 64"):
        generate_batch(family, parts, [spec], [torch.Generator()])
    with pytest.raises(ValueError, match="scheduler cannot be given"):
        generate_batch(family, parts, [dataclasses.replace(spec, width=64)], [torch.Generator()], scheduler=object())
    broken = ToyFlux(DEV, embeds)
    broken.flow_sampling = lambda p: None
    with pytest.raises(ValueError, match="flow_sampling.*returned None"):
        resolve(PromptSpec("a"), broken, parts)


# ----------------------------------------------------------------------------------------------------------------------
# Chroma: T5 only (no pooled), the T5 mask, no guidance input, CFG with --l


class ToyChroma(ToyFlux):
    name = "toychroma"

    def encode_prompt(self, parts, captions, clip_skip=None, max_token_length=None):
        hidden, mask = zip(*(self.embeds[c] for c in captions))
        return ToyCond(torch.cat(hidden), None, torch.cat(mask))

    def predict(self, denoiser, noisy, t, cond, **options):
        from diffusers import FluxPipeline

        self.predict_calls.append((noisy.shape[0], t.clone(), options.get("guidance")))
        b, c, h, w = noisy.shape
        packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
        mask = torch.cat([cond.mask, torch.ones(b, packed.shape[1], dtype=torch.bool)], dim=1)
        out = denoiser(
            hidden_states=packed, timestep=t / 1000, encoder_hidden_states=cond.hidden_states,
            txt_ids=torch.zeros(cond.hidden_states.shape[1], 3), img_ids=img_ids, attention_mask=mask, return_dict=False,
        )[0]  # fmt: skip
        return FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)


def test_chroma_cfg_with_t5_mask_equals_chroma_pipeline(monkeypatch):
    """Chroma (sd-scripts' sample line ``--n ... --l 4 --g 0``): no guidance input, shifted schedule, CFG over
    the negative prompt with each prompt's T5 mask carried through the doubled batch == ChromaPipeline."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1,
    ).eval()  # fmt: skip
    parts, _ = _tiny(guidance_embeds=False)
    parts = dataclasses.replace(parts, denoiser=transformer)
    g = torch.Generator().manual_seed(2)
    embeds = {
        p: (torch.randn(1, 8, 32, generator=g), torch.arange(8)[None] <= n) for p, n in zip(PROMPTS, (5, 3, 2, 0))
    }
    family = ToyChroma(FlowSampling(embedded_guidance=False, shift=True), embeds)
    spec = parse_prompt_line("a red cat --n blurry --w 64 --h 64 --d 9 --l 4.0 --g 0.0 --s 3")
    latents, resolved = _ours(family, parts, spec, (9,), monkeypatch)
    assert resolved.guidance is None and [c[0] for c in family.predict_calls] == [2, 2, 2]
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    pipe = ChromaPipeline(scheduler, parts.vae, None, None, transformer)
    pipe.set_progress_bar_config(disable=True)
    packed = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(9))
    out = pipe(
        prompt_embeds=embeds["a red cat"][0], prompt_attention_mask=embeds["a red cat"][1],
        negative_prompt_embeds=embeds["blurry"][0], negative_prompt_attention_mask=embeds["blurry"][1],
        guidance_scale=4.0, height=64, width=64, num_inference_steps=3, latents=packed, output_type="latent",
    ).images  # fmt: skip
    theirs = pipe._unpack_latents(out, 64, 64, 8)
    torch.testing.assert_close(latents, theirs, rtol=0, atol=5e-5)  # measured 1.1e-5; masks all ones: 0.18


def test_sampling_during_training_uses_the_flow_sampler(dev, tmp_path):
    """training.py needs nothing per family: a flow family's round writes sd-scripts-named PNGs made by the Euler
    sampler (the same pixels as generate_batch for the prompt's seed), --g and the sampler in the text chunks,
    and leaves the RNG as it found it."""
    from PIL import Image

    from library.sampling import SampleConfig, generate, sample_during_training

    parts, embeds = dev
    family = ToyFlux(DEV, embeds)
    path = tmp_path / "prompts.txt"
    path.write_text("a red cat --w 64 --h 64 --s 2 --d 5 --g 2.5 --ss euler_a\n", encoding="utf-8")
    cfg = SampleConfig(path, every_n_steps=1, sampler="dpmsolver++")
    state = torch.get_rng_state()
    paths = sample_during_training(cfg, family, parts, output_dir=tmp_path, output_name="flux", step=1)
    assert torch.equal(torch.get_rng_state(), state) and len(paths) == 2
    image = Image.open(paths[0])
    assert image.text["sampler"] == "euler" and image.text["guidance"] == "2.5" and image.text["steps"] == "2"
    assert image.text["scale"] == "1.0" and "Distilled CFG Scale: 2.5" in image.text["parameters"]
    direct = generate(family, parts, parse_prompt_line("a red cat --w 64 --h 64 --s 2 --d 5 --g 2.5"))
    assert np.array_equal(np.asarray(image), np.asarray(direct))


def test_fp8_stored_bf16_model_samples_in_its_compute_dtype(dev):
    """--fp8_base keeps Linear weights in float8: the sampler gives the model x in the compute dtype (bf16 here, read
    from the biases), accumulates in float32, and the result stays near the float32 model's."""
    import copy

    from library.device.fp8 import store_in_fp8
    from library.sampling.flow_generate import compute_dtype

    parts, embeds = dev
    assert compute_dtype(parts.denoiser) == torch.float32
    model = copy.deepcopy(parts.denoiser).to(torch.bfloat16).requires_grad_(False)
    assert store_in_fp8(model, torch.bfloat16) > 0 and compute_dtype(model) == torch.bfloat16
    embeds16 = {k: tuple(t.to(torch.bfloat16) for t in v) for k, v in embeds.items()}
    spec = resolve(PromptSpec("a red cat", width=64, height=64, steps=2), ToyFlux(DEV, embeds), parts)
    full = generate_flow_latents(ToyFlux(DEV, embeds), parts, [spec], [torch.Generator().manual_seed(4)])
    low = generate_flow_latents(
        ToyFlux(DEV, embeds16), dataclasses.replace(parts, denoiser=model), [spec], [torch.Generator().manual_seed(4)]
    )
    assert full.dtype == low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low - full).abs().max() < 0.1 * full.abs().max()  # measured 0.03 (float8 weights)


def test_sizes_a_flow_model_cannot_sample_are_found_before_training(dev, tiny_parts, tmp_path, caplog):
    """--w 72 parses (a multiple of 8) but a flow model needs multiples of 16: check_sample_prompts says so before
    training (file, prompt, option, a fix); a round whose re-read file has it is skipped with that error; SD is fine."""
    from library.cli.problems import ConfigError
    from library.families import get_family
    from library.sampling import SampleConfig, check_sample_prompts, sample_during_training

    parts, embeds = dev
    path = tmp_path / "prompts.txt"
    path.write_text("a red cat --w 64 --h 64 --s 1\na dog --w 72 --h 64 --s 1\n", encoding="utf-8")
    cfg = SampleConfig(path, every_n_steps=1)
    with pytest.raises(ConfigError, match=r"prompts.txt: prompt 2: --w 72 is not a multiple of 16.*try 64"):
        check_sample_prompts(cfg, ToyFlux(DEV, embeds), parts)
    check_sample_prompts(cfg, get_family("sd1"), tiny_parts["sd1"])
    with caplog.at_level(logging.ERROR):
        assert (
            sample_during_training(cfg, ToyFlux(DEV, embeds), parts, output_dir=tmp_path, output_name=None, step=1)
            == []
        )
    assert "sampling at step 1 skipped" in caplog.text and "--w 72" in caplog.text
