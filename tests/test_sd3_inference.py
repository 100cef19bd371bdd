"""SD3 / SD3.5 inference on the SD3 family: our sampler's latents and decoded image against diffusers'
StableDiffusion3Pipeline on the same tiny weights, prompt embeddings, seed and CFG; sd3_minimal_inference.py on the
SAI files against gen_img.py on the diffusers folder; their flags (tiny models, a few steps)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from _networks_helpers import random_lora_state
from PIL import Image

from library.families import get_family
from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files
from library.sampling import PromptSpec, generate_batch, resolve

PROMPT, NEGATIVE = "a red cat", "blurry"
VARIANT = "sd3.5-medium"


@pytest.fixture(scope="module")
def medium():
    return build_tiny_sd3(VARIANT, seed=0)


@pytest.fixture(scope="module")
def model_files(medium, tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3_infer")
    return root, write_tiny_files(medium, root / "files")


def _pipeline(parts, *, with_text_encoders=False):
    """diffusers' StableDiffusion3Pipeline over the same modules, with a scheduler from the model's released
    scheduler config (FlowMatchEulerDiscreteScheduler, shift 3.0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    te = parts.text_encoders if with_text_encoders else [None] * 3
    tok = parts.tokenizers if with_text_encoders else [None] * 3
    pipe = StableDiffusion3Pipeline(
        transformer=parts.denoiser, scheduler=FlowMatchEulerDiscreteScheduler.from_config(parts.scheduler_config),
        vae=parts.vae, text_encoder=te[0], tokenizer=tok[0], text_encoder_2=te[1], tokenizer_2=tok[1],
        text_encoder_3=te[2], tokenizer_3=tok[2],
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flow_settings_of_the_family(medium):
    """SD3 samples with a static shift from its scheduler config, unpacked noise, no embedded guidance, and
    sd-scripts' SD3 sample defaults."""
    settings = get_family(VARIANT).flow_sampling(medium)
    assert settings.static_shift == medium.scheduler_config["shift"] == 3.0
    assert (settings.shift, settings.embedded_guidance, settings.packed_noise) == (False, False, False)
    assert (settings.latent_channels, settings.default_steps, settings.default_scale) == (16, 30, 7.5)


@pytest.mark.parametrize("scale,negative", [(4.0, NEGATIVE), (7.5, ""), (1.0, "")])
def test_latents_and_image_equal_stable_diffusion3_pipeline(medium, scale, negative, monkeypatch):
    """generate_batch (as gen_img and training samples run it) == StableDiffusion3Pipeline with the family's prompt
    embeddings: the latents (output_type="latent") and the decoded image in [0, 1] (output_type="pt", the VAE's
    scale 1.5305 and shift 0.0609 undone by the pipeline itself)."""
    family = get_family(VARIANT)
    spec = resolve(PromptSpec(PROMPT, negative_prompt=negative, width=64, height=48, steps=3, scale=scale),
                   family, medium)  # fmt: skip
    seen = []
    decode = family.decode_latents

    def capture(parts, latents):
        pixels = decode(parts, latents)
        seen.append((latents, pixels))
        return pixels

    monkeypatch.setattr(family, "decode_latents", capture)
    generate_batch(family, medium, [spec], [torch.Generator().manual_seed(7)])
    [(ours, pixels)] = seen
    with torch.no_grad():
        both = family.encode_prompt(medium, [PROMPT, negative])  # one batch, as the sampler encodes them
    pos, neg = [dataclasses.replace(both, hidden_states=both.hidden_states[i : i + 1], pooled=both.pooled[i : i + 1])
                for i in (0, 1)]  # fmt: skip
    args = dict(prompt_embeds=pos.hidden_states, pooled_prompt_embeds=pos.pooled,
                negative_prompt_embeds=neg.hidden_states, negative_pooled_prompt_embeds=neg.pooled, height=48,
                width=64, num_inference_steps=3, guidance_scale=scale)  # fmt: skip
    pipe = _pipeline(medium)
    theirs = pipe(**args, generator=torch.Generator().manual_seed(7), output_type="latent").images
    image = pipe(**args, generator=torch.Generator().manual_seed(7), output_type="pt").images
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-6, f"latents: max |ours - StableDiffusion3Pipeline| = {diff}"
    ours_01 = (pixels.float() / 2 + 0.5).clamp(0, 1)
    diff = (ours_01 - image).abs().max().item()
    assert diff <= 1e-5, f"image: max |ours - StableDiffusion3Pipeline| = {diff}"


def test_scale_and_negative_prompt_change_the_latents(medium, monkeypatch):
    """--l and --n reach the sampler: each changes the result (and --l 1 ignores --n)."""
    family = get_family(VARIANT)
    seen = []
    decode = family.decode_latents
    monkeypatch.setattr(family, "decode_latents", lambda parts, latents: seen.append(latents) or decode(parts, latents))
    for scale, negative in [(7.5, ""), (3.0, ""), (7.5, NEGATIVE), (1.0, ""), (1.0, NEGATIVE)]:
        spec = resolve(PromptSpec(PROMPT, negative_prompt=negative, width=32, height=32, steps=2, scale=scale),
                       family, medium)  # fmt: skip
        generate_batch(family, medium, [spec], [torch.Generator().manual_seed(1)])
    assert len(seen) == 5
    for i, j in [(0, 1), (0, 2), (0, 3)]:
        assert (seen[i] - seen[j]).abs().max() > 1e-4, (i, j)
    assert torch.equal(seen[3], seen[4])


def _pixels(path):
    return np.asarray(Image.open(io.BytesIO(path.read_bytes())).convert("RGB"), dtype=np.int16)


def _minimal_args(root, files, *extra):
    return ["--ckpt_path", str(files["model"]), "--prompt", PROMPT, "--negative_prompt", NEGATIVE, "--seed", "5",
            "--steps", "3", "--width", "96", "--height", "64", "--cfg_scale", "4", "--output_dir",
            str(root / "minimal"), *extra]  # fmt: skip


def test_minimal_inference_flags_reach_the_spec_and_load(model_files):
    """sd-scripts' flags land where they act: the prompt settings in the sampler's spec, the encoder files and
    text settings in the family's load keywords."""
    import sd3_minimal_inference as smi

    root, files = model_files
    separate = ["--clip_l", str(files["clip_l"]), "--clip_g", str(files["clip_g"]), "--t5xxl", str(files["t5xxl"])]
    args = smi.build_parser().parse_args(_minimal_args(root, files, *separate, "--cfg_scale", "1.5", "--bf16",
                                                       "--t5xxl_token_length", "77", "--apply_lg_attn_mask"))  # fmt: skip
    cfg = smi.InferenceConfig.from_args(args)
    spec = cfg.spec
    assert (spec.prompt, spec.negative_prompt, spec.width, spec.height, spec.steps, spec.scale) == (
        PROMPT, NEGATIVE, 96, 64, 3, 1.5)  # fmt: skip
    assert (cfg.seed, cfg.dtype, cfg.t5xxl_max_token_length, cfg.apply_lg_attn_mask, cfg.apply_t5_attn_mask) == (
        5, torch.bfloat16, 77, True, False)  # fmt: skip
    assert cfg.files == {k: str(files[k]) for k in ("clip_l", "clip_g", "t5xxl")}
    defaults = smi.InferenceConfig.from_args(smi.build_parser().parse_args(["--ckpt_path", str(files["model"])]))
    assert (defaults.spec.scale, defaults.spec.steps, defaults.spec.width, defaults.spec.negative_prompt) == (
        5.0, 50, 1024, "")  # fmt: skip
    assert (defaults.seed, defaults.dtype, defaults.t5xxl_max_token_length) == (1, torch.float32, 256)


def test_interactive_options_as_sd_scripts(model_files, monkeypatch):
    """--w --h --s --c carry over; --d and --n are per prompt (--n - = empty; not given = --negative_prompt); --m
    needs one value per live network; a prompt with a bad size is skipped and its settings do not carry over."""
    import sd3_minimal_inference as smi

    spec = PromptSpec("x", negative_prompt="base", width=64, height=64, steps=4, scale=5.0)
    spec, seed = smi.interactive_options("a dog --w 96 --h 32 --s 7 --d 9 --c 3 --n -", spec, "base", [])
    assert (spec.prompt, spec.width, spec.height, spec.steps, spec.scale, spec.negative_prompt, seed) == (
        "a dog", 96, 32, 7, 3.0, "", 9)  # fmt: skip
    spec, seed = smi.interactive_options("a cat --s x", spec, "base", [])
    assert (spec.steps, spec.width, spec.negative_prompt, seed) == (7, 96, "base", None)
    assert smi.interactive_options("  ", spec, "base", []) is None
    root, files = model_files
    monkeypatch.setattr("sys.stdin", io.StringIO("a dog --w 32 --h 32 --s 1 --d 1\na cat --w 40\na cat --d 2\n\nx\n"))
    written = smi.run(_minimal_args(root, files, "--interactive", "--output_dir", str(root / "interactive")))
    assert len(written) == 2 and [Image.open(p).size for p in written] == [(32, 32), (32, 32)]


def test_bad_command_lines_are_refused_before_loading(model_files, capsys, tmp_path):
    import sd3_minimal_inference as smi

    root, files = model_files
    assert smi.main(["--ckpt_path", str(tmp_path / "nope.safetensors"), "--width", "100", "--fp16", "--bf16"]) == 2
    err = capsys.readouterr().err
    assert "nope.safetensors: no such file" in err and "--width 100" in err and "try 96" in err and "--bf16" in err
    from library.families.flux.tiny import build_tiny_flux
    from library.families.flux.tiny import write_tiny_files as write_flux

    flux = write_flux(build_tiny_flux("flux-dev", seed=0), tmp_path / "flux")
    assert smi.main(["--ckpt_path", str(flux["model"])]) == 2
    assert "SD3 / SD3.5 only" in capsys.readouterr().err


def test_gen_img_refuses_a_flag_the_family_does_not_read(model_files, capsys):
    import gen_img

    root, files = model_files
    assert gen_img.main(["--ckpt", str(files["diffusers"]), "--prompt", "x", "--ae", str(files["vae"]),
                         "--outdir", str(root / "never")]) == 2  # fmt: skip
    assert "--ae" in capsys.readouterr().err


def test_training_samples_equal_gen_img(model_files, dataset, tmp_path):
    """sd3_train_network.py's sample at the first step (--sample_at_first; the new LoRA's up weights are zero, so the
    model is the base one) writes gen_img.py's pixels for the same prompt line, seed and model, with SD3's defaults
    for what the line leaves out (CFG 7.5 with the negative prompt); the prompt's --l reaches the training sample."""
    import gen_img
    import sd3_train_network

    root, files = model_files
    line = f"{PROMPT} --n {NEGATIVE} --w 64 --h 64 --d 3 --s 2"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{line}\n{line} --l 2.0\n")
    sd3_train_network.run([
        "--pretrained_model_name_or_path", str(files["model"]), "--train_data_dir", str(dataset),
        "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(tmp_path), "--output_name", "t",
        "--network_module", "networks.lora", "--network_dim", "4", "--train_batch_size", "2",
        "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "1", "--sample_prompts",
        str(prompts), "--sample_at_first",
    ])  # fmt: skip
    samples = sorted((tmp_path / "sample").glob("t_e000000_0[01]_*.png"))
    assert len(samples) == 2, samples
    [ours] = gen_img.run(["--ckpt", str(files["diffusers"]), "--prompt", line, "--outdir", str(root / "gen7")])
    assert np.array_equal(_pixels(samples[0]), _pixels(ours))
    assert np.abs(_pixels(samples[1]) - _pixels(samples[0])).max() > 0


@pytest.fixture(scope="module")
def lora_file(medium, model_files):
    """A rank-2 kohya LoRA (random up and down, alpha 1) on the SD3 family's default targets: the transformer's
    joint blocks (fused qkv by SAI name) and the CLIP text encoders."""
    from safetensors.torch import save_file

    state = random_lora_state(get_family(VARIANT), medium)
    assert any(k.startswith("lora_unet_joint_blocks_0_x_block_attn_qkv") for k in state)
    path = model_files[0] / "lora.safetensors"
    save_file(state, path)
    return path


def test_minimal_inference_lora_live_merged_and_gen_img(model_files, lora_file, monkeypatch):
    """--lora_weights "file;0.8" live, merged (--merge_lora_weights, with --offload), and gen_img.py's
    --network_weights at --network_mul 0.8 (on the diffusers folder) give the same latents, and the live run writes
    gen_img.py's pixels; without the LoRA the latents differ."""
    import gen_img
    import sd3_minimal_inference as smi
    from library.sampling import flow_generate

    root, files = model_files
    seen = []
    sample = flow_generate.sample_flow_latents
    monkeypatch.setattr(flow_generate, "sample_flow_latents", lambda *a: seen.append(sample(*a)) or seen[-1])
    lora = f"{lora_file};0.8"
    [live_png] = smi.run(_minimal_args(root, files, "--lora_weights", lora))
    smi.run(_minimal_args(root, files, "--lora_weights", lora, "--merge_lora_weights", "--offload"))
    smi.run(_minimal_args(root, files))
    decode = get_family(VARIANT).decode_latents
    monkeypatch.setattr(get_family(VARIANT), "decode_latents", lambda p, lat: seen.append(lat) or decode(p, lat))
    [gen_png] = gen_img.run(["--ckpt", str(files["diffusers"]), "--prompt", f"{PROMPT} --n {NEGATIVE}", "--seed", "5", "--steps",
                 "3", "--W", "96", "--H", "64", "--scale", "4", "--network_module", "networks.lora",
                 "--network_weights", str(lora_file), "--network_mul", "0.8", "--outdir", str(root / "gen_lora")])  # fmt: skip
    live, merged, plain, ours = seen
    torch.testing.assert_close(merged, live, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours, live, rtol=0, atol=1e-5)
    assert (plain - live).abs().max() > 100 * 1e-5
    assert np.array_equal(_pixels(live_png), _pixels(gen_png))
