"""Generation on the tiny models: every sampler on SD1 (eps), SD2 (v) and SDXL; seeds; the diffusers pipeline as oracle;
schedulers built for the model's prediction type and zero-terminal SNR."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from library.sampling import SAMPLER_NAMES, PromptSpec, generate, generate_batch, make_scheduler, resolve

FAMILIES = ["sd1", "sd2", "sdxl"]
SPEC = PromptSpec("a red (cat:1.2) on a mat", "blurry", width=64, height=64, steps=2, scale=5.0)


def _family(name):
    from library.families import get_family

    return get_family(name)


# sd-scripts' sampler names and the diffusers scheduler each one means (train_util.get_my_scheduler), typed in from
# sd-scripts rather than read from library/sampling/schedulers.py; the extra options are the ones the module
# docstring gives for diffusers' SD configs and today's diffusers
SD_SCRIPTS_SAMPLERS = {
    "ddim": ("DDIMScheduler", {}), "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "lms": ("LMSDiscreteScheduler", {}), "k_lms": ("LMSDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}), "k_euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}), "k_euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}), "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "k_dpm_2": ("KDPM2DiscreteScheduler", {}), "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "k_dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpmsolver": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    "dpmsolver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpmsingle": ("DPMSolverSinglestepScheduler", {"lower_order_final": True}),
}  # fmt: skip


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("sampler", SAMPLER_NAMES)
def test_every_sampler_equals_diffusers_scheduler_of_that_name(tiny_parts, monkeypatch, family_name, sampler):
    """Oracle: the diffusers pipeline with the scheduler class sd-scripts names for the sampler, swapped in the way
    diffusers documents (``Class.from_config(the model's scheduler config)``), the pipeline encoding the prompts
    itself, same seed: the same pixels (±1), a non-square image of the right size, finite latents."""
    import diffusers

    family, parts = _family(family_name), tiny_parts[family_name]
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    spec = PromptSpec("a red cat", "blurry", width=72, height=64, steps=3, scale=6.0, sampler=sampler, seeds=(1,))
    image = generate(family, parts, spec)
    assert image.size == (72, 64) and image.mode == "RGB"
    (latents,) = seen
    assert latents.shape == (1, 4, 8, 9) and torch.isfinite(latents).all()
    class_name, extra = SD_SCRIPTS_SAMPLERS[sampler]
    scheduler = getattr(diffusers, class_name).from_config(parts.scheduler_config, **extra)
    pipe = family.pipeline(parts, scheduler)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe("a red cat", negative_prompt="blurry", height=64, width=72, num_inference_steps=3, guidance_scale=6.0,
                  generator=torch.Generator().manual_seed(1)).images[0]  # fmt: skip
    diff = np.abs(np.asarray(image, np.int16) - np.asarray(theirs, np.int16)).max()
    assert diff <= 1, (sampler, diff)


def test_schedulers_follow_the_model(tiny_parts):
    import diffusers

    v_config = tiny_parts["sd2"].scheduler_config
    assert v_config["prediction_type"] == "v_prediction"
    classes = {
        "euler_a": "EulerAncestralDiscreteScheduler",
        "k_dpm_2": "KDPM2DiscreteScheduler",
        "ddpm": "DDPMScheduler",
    }
    for name, cls in classes.items():
        scheduler = make_scheduler(name, v_config)
        assert type(scheduler).__name__ == cls and scheduler.config.prediction_type == "v_prediction"
    assert make_scheduler("dpmsolver", v_config).config.algorithm_type == "dpmsolver"
    assert make_scheduler("dpmsolver++", v_config).config.algorithm_type == "dpmsolver++"
    # zero terminal SNR: the oracle is diffusers' own rescale (DDIM has the flag natively)
    reference = diffusers.DDIMScheduler(**{**_schedule(v_config), "rescale_betas_zero_snr": True})
    for name in ("ddim", "lms", "heun", "pndm"):
        s = make_scheduler(name, v_config, zero_terminal_snr=True)
        assert s.config.timestep_spacing in ("trailing", None)
        alphas = s.alphas_cumprod
        assert torch.allclose(alphas[:-1], reference.alphas_cumprod[:-1].to(alphas.dtype), rtol=1e-4, atol=1e-7)
        assert float(alphas[-1]) <= 2.0**-24 + 1e-12
    with pytest.raises(ValueError, match="unknown sampler"):
        make_scheduler("dpm++_2m_karras", v_config)


def _schedule(config):
    keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "prediction_type")
    return {k: config[k] for k in keys}


def test_zero_terminal_snr_sampling_is_finite(tiny_parts, monkeypatch):
    family, parts = _family("sd2"), tiny_parts["sd2"]
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    for sampler in ("euler", "k_lms", "dpm_2_a", "ddim"):
        spec = resolve(PromptSpec("a cat", width=64, height=64, steps=3, sampler=sampler), family, parts)
        scheduler = make_scheduler(sampler, parts.scheduler_config, zero_terminal_snr=True)
        generate_batch(family, parts, [spec], [torch.Generator().manual_seed(0)], scheduler=scheduler)
        assert scheduler.timesteps.max() >= 999  # trailing spacing starts at the last timestep
        assert torch.isfinite(seen[-1]).all(), sampler


@pytest.mark.parametrize("family_name", FAMILIES)
def test_same_seed_same_pixels(tiny_parts, family_name):
    family, parts = _family(family_name), tiny_parts[family_name]
    spec = PromptSpec("a cat", width=64, height=64, steps=2, sampler="euler_a", seeds=(7,))
    a, b = np.asarray(generate(family, parts, spec)), np.asarray(generate(family, parts, spec))
    c = np.asarray(generate(family, parts, PromptSpec("a cat", width=64, height=64, steps=2, seeds=(8,))))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("family_name", ["sd1", "sdxl"])
def test_batch_equals_single_images(tiny_parts, family_name):
    family, parts = _family(family_name), tiny_parts[family_name]
    specs = [resolve(PromptSpec(p, width=64, height=64, steps=2), family, parts) for p in ("a cat", "a dog")]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    batch = generate_batch(family, parts, specs, gens)
    single = [generate_batch(family, parts, [s], [torch.Generator().manual_seed(i)])[0] for s, i in zip(specs, (1, 2))]
    for x, y in zip(batch, single):
        assert np.abs(np.asarray(x, np.int16) - np.asarray(y, np.int16)).max() <= 1
    with pytest.raises(ValueError, match="share size"):
        generate_batch(family, parts, [specs[0], PromptSpec("x", width=72, height=64, steps=2)], gens)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_matches_diffusers_pipeline_with_its_own_prompt_encoding(tiny_parts, family_name):
    """Oracle: the diffusers pipeline encoding the prompts itself, same scheduler and seed (unweighted prompt)."""
    family, parts = _family(family_name), tiny_parts[family_name]
    spec = resolve(PromptSpec("a red cat", "blurry", width=64, height=64, steps=3, scale=6.0), family, parts)
    ours = generate_batch(family, parts, [spec], [torch.Generator().manual_seed(3)])[0]
    pipe = family.pipeline(parts, make_scheduler("ddim", parts.scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        "a red cat", negative_prompt="blurry", height=64, width=64, num_inference_steps=3, guidance_scale=6.0,
        generator=torch.Generator().manual_seed(3),
    ).images[0]  # fmt: skip
    diff = np.abs(np.asarray(ours, np.int16) - np.asarray(theirs, np.int16)).max()
    assert diff <= 1, diff


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_gpu(tiny_parts, monkeypatch, dtype):
    import copy

    family, parts = _family("sdxl"), copy.deepcopy(tiny_parts["sdxl"])
    for module in (parts.denoiser, parts.vae, *parts.text_encoders):
        module.to("cuda", dtype)
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    spec = PromptSpec("a (red:1.2) cat", "blurry", width=64, height=64, steps=2, sampler="euler_a", seeds=(3,))
    a, b = generate(family, parts, spec), generate(family, parts, spec)
    assert a.size == (64, 64) and all(torch.isfinite(x).all() for x in seen)
    assert np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max() <= 1
