"""FLUX.1 inference with LoRA: our flow sampler against diffusers' FluxPipeline (the LoRA merged by ComfyUI's rule),
flux_minimal_inference.py against gen_img.py, and the flags of both (tiny models, a few steps)."""

from __future__ import annotations

import copy
import dataclasses
import io

import numpy as np
import pytest
import torch
from _networks_helpers import random_lora_state
from PIL import Image
from safetensors.torch import save_file

from library.families import get_family
from library.families.flux import FLUX_DEV
from library.families.flux import keys as K
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.sampling import PromptSpec, resolve

PROMPT = "a red cat"


@pytest.fixture(scope="module")
def dev():
    return build_tiny_flux("flux-dev", seed=0)


@pytest.fixture(scope="module")
def lora_state(dev):
    """A rank-2 LoRA (random up and down, alpha 1) on the family's default targets: transformer and CLIP-L."""
    state = random_lora_state(FLUX_DEV, dev)
    assert any(k.startswith("lora_te1_") for k in state) and any(k.endswith("_linear1.alpha") for k in state)
    return state


@pytest.fixture(scope="module")
def model_files(dev, lora_state, tmp_path_factory):
    """The tiny dev model as a diffusers folder and as sd-scripts' four single files, and the LoRA file."""
    root = tmp_path_factory.mktemp("flux_infer")
    FLUX_DEV.save(dev, root / "folder")
    files = write_tiny_files(dev, root / "single")
    save_file(lora_state, root / "lora.safetensors")
    return root, files


def comfyui_merge(denoiser, state, multiplier):
    """A copy of ``denoiser`` with every ``lora_unet_`` module of ``state`` merged by ComfyUI's rule: the BFL key
    ``lora_unet_`` + path with dots as underscores, ``W += multiplier · α/r · up @ down``."""
    bfl = K.diffusers_to_bfl(denoiser.state_dict())
    by_rule = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in bfl if k.endswith(".weight")}
    modules = {k.rsplit(".", 2)[0] for k in state if k.startswith("lora_unet_")}
    for module in modules:
        up, down = state[module + ".lora_up.weight"], state[module + ".lora_down.weight"]
        scale = multiplier * float(state[module + ".alpha"]) / down.shape[0]
        bfl[by_rule[module]] = bfl[by_rule[module]] + scale * (up.float() @ down.float())
    merged = copy.deepcopy(denoiser)
    merged.load_state_dict(K.bfl_to_diffusers(bfl))
    return merged


def pipeline_latents(denoiser, vae, cond, spec, seed):
    """FluxPipeline (FLUX.1-dev's released scheduler config) on ``cond``'s embeddings with sd-scripts' packed noise
    for ``seed``, unpacked to (1, 16, H/8, W/8)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(scheduler, vae, None, None, None, None, denoiser)
    pipe.set_progress_bar_config(disable=True)
    h, w = spec.height // 8, spec.width // 8
    packed = torch.randn(1, (h // 2) * (w // 2), 64, generator=torch.Generator().manual_seed(seed))
    out = pipe(
        prompt_embeds=cond.hidden_states, pooled_prompt_embeds=cond.pooled, height=spec.height, width=spec.width,
        num_inference_steps=spec.steps, guidance_scale=spec.guidance, latents=packed, output_type="latent",
    ).images  # fmt: skip
    return pipe._unpack_latents(out, spec.height, spec.width, 8)


def test_lora_latents_equal_flux_pipeline_with_the_lora_merged_by_comfyui_rule(dev, lora_state):
    """Our sampler with the LoRA file live at multiplier 0.7 (fused qkv / linear1 included) == FluxPipeline on the
    base transformer with the file merged by ComfyUI's rule at 0.7: same seed, weights and embeddings."""
    from library.sampling.flow_generate import generate_flow_latents
    from networks.inject import network_from_state_dict

    unet_only = {k: v for k, v in lora_state.items() if k.startswith("lora_unet_")}
    parts = copy.deepcopy(dev)
    network = network_from_state_dict(unet_only, FLUX_DEV.adapter_roots(parts))
    network.set_multiplier(0.7)
    spec = resolve(PromptSpec(PROMPT, width=64, height=48, steps=3, guidance=2.5), FLUX_DEV, parts)
    ours = generate_flow_latents(FLUX_DEV, parts, [spec], [torch.Generator().manual_seed(11)])
    with torch.no_grad():
        cond = FLUX_DEV.encode_prompt(dev, [PROMPT])
        theirs = pipeline_latents(comfyui_merge(dev.denoiser, unet_only, 0.7), dev.vae, cond, spec, 11)
        base = pipeline_latents(dev.denoiser, dev.vae, cond, spec, 11)
    diff, effect = (ours - theirs).abs().max().item(), (theirs - base).abs().max().item()
    assert diff < 1e-4 and effect > 100 * diff, (diff, effect)


def _pixels(path):
    return np.asarray(Image.open(io.BytesIO(path.read_bytes())).convert("RGB"), dtype=np.int16)


def _minimal_args(root, files, *extra):
    return ["--ckpt_path", str(files["model"]), "--clip_l", str(files["clip_l"]), "--t5xxl", str(files["t5xxl"]),
            "--ae", str(files["ae"]), "--prompt", PROMPT, "--seed", "5", "--steps", "3", "--width", "64",
            "--height", "64", "--guidance", "2.0", "--dtype", "fp32", "--output_dir", str(root / "minimal"),
            *extra]  # fmt: skip


def test_minimal_inference_image_equals_gen_img_with_the_same_lora(model_files):
    """flux_minimal_inference.py on the BFL files with --lora_weights "file;0.8" (transformer and CLIP-L modules)
    writes the same pixels as gen_img.py on the diffusers folder of the same weights with --network_mul 0.8;
    without the LoRA, or with --guidance 6, the image changes."""
    import flux_minimal_inference
    import gen_img

    root, files = model_files
    lora = str(root / "lora.safetensors")
    [minimal] = flux_minimal_inference.run(_minimal_args(root, files, "--lora_weights", f"{lora};0.8"))
    gen_args = ["--ckpt", str(root / "folder"), "--prompt", PROMPT, "--seed", "5", "--steps", "3", "--W", "64",
                "--H", "64", "--guidance", "2.0", "--network_module", "networks.lora", "--network_weights", lora,
                "--network_mul", "0.8", "--outdir", str(root / "gen")]  # fmt: skip
    [ours] = gen_img.run(gen_args)
    assert np.array_equal(_pixels(minimal), _pixels(ours))
    [plain] = flux_minimal_inference.run(_minimal_args(root, files))
    [other_g] = flux_minimal_inference.run(_minimal_args(root, files, "--lora_weights", f"{lora};0.8",
                                                         "--guidance", "6"))  # fmt: skip
    assert np.abs(_pixels(plain) - _pixels(minimal)).max() > 0
    assert np.abs(_pixels(other_g) - _pixels(minimal)).max() > 0


def test_merged_lora_and_offload_give_the_live_lora_image(model_files, monkeypatch):
    """--merge_lora_weights (W += 0.8 ΔW) with --offload (parts moved on and off the device), and two files at 0.5
    and 0.3 (merged), give the live adapter's latents at 0.8."""
    import flux_minimal_inference as fmi

    root, files = model_files
    lora = f"{root / 'lora.safetensors'};0.8"
    from library.sampling import flow_generate

    seen = []

    sample = flow_generate.sample_flow_latents
    monkeypatch.setattr(flow_generate, "sample_flow_latents", lambda *a: seen.append(sample(*a)) or seen[-1])
    fmi.run(_minimal_args(root, files, "--lora_weights", lora))
    fmi.run(_minimal_args(root, files, "--lora_weights", lora, "--merge_lora_weights", "--offload"))
    half, rest = f"{root / 'lora.safetensors'};0.5", f"{root / 'lora.safetensors'};0.3"
    fmi.run(_minimal_args(root, files, "--lora_weights", half, rest))  # two files: merged, W + 0.5 ΔW + 0.3 ΔW
    assert len(seen) == 3
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(seen[2], seen[0], rtol=0, atol=1e-5)


def test_cfg_runs_only_with_a_negative_prompt_as_sd_scripts(dev, caplog):
    """sd-scripts' minimal inference runs true CFG only with a non-empty negative prompt and --cfg_scale != 1;
    schnell defaults to 4 steps, dev to 50."""
    import flux_minimal_inference as fmi

    spec = PromptSpec(PROMPT, width=64, height=64, scale=4.0, guidance=3.5)
    with caplog.at_level("INFO"):
        settled = fmi.settle(spec, FLUX_DEV, dev)
    assert settled.scale == 1.0 and settled.steps == 50 and "needs a --negative_prompt" in caplog.text
    assert fmi.settle(dataclasses.replace(spec, negative_prompt="blur"), FLUX_DEV, dev).scale == 4.0
    schnell = build_tiny_flux("flux-schnell", seed=0)
    settled = fmi.settle(spec, get_family("flux-schnell"), schnell)
    assert settled.steps == 4 and settled.guidance is None


def test_interactive_options_as_sd_scripts():
    """--w --h --s --g --c carry over; --d and --n are per prompt (- = empty); --m sets live multipliers (the count
    must match; a bad option is logged and skipped)."""
    import flux_minimal_inference as fmi

    class Net:
        multiplier = 1.0

        def set_multiplier(self, value):
            self.multiplier = value

    net = Net()
    spec = PromptSpec("x", width=64, height=64, steps=None, scale=1.0, guidance=3.5)
    spec, seed = fmi.interactive_options("a dog --w 96 --h 32 --s 7 --d 9 --g 1.5 --c 3 --n - --m 0.25", spec, [net])
    assert (spec.prompt, spec.width, spec.height, spec.steps, spec.guidance, spec.scale, seed) == (
        "a dog", 96, 32, 7, 1.5, 3.0, 9)  # fmt: skip
    assert spec.negative_prompt == "" and net.multiplier == 0.25
    spec, seed = fmi.interactive_options("a cat --n blurry --m 0.5,0.5 --s x", spec, [net])
    assert spec.prompt == "a cat" and spec.width == 96 and spec.steps == 7 and seed is None
    assert spec.negative_prompt == "blurry" and net.multiplier == 0.25  # two values for one network: skipped
    assert fmi.interactive_options("  ", spec, [net]) is None


def test_interactive_run_reads_stdin_until_an_empty_line(model_files, monkeypatch):
    import flux_minimal_inference as fmi

    root, files = model_files
    monkeypatch.setattr("sys.stdin", io.StringIO("a dog --w 32 --h 32 --s 1 --d 1\na cat --d 2\n\nnever\n"))
    written = fmi.run(_minimal_args(root, files, "--interactive", "--output_dir", str(root / "interactive")))
    assert len(written) == 2 and [Image.open(p).size for p in written] == [(32, 32), (32, 32)]


def test_bad_command_lines_are_refused_before_loading(model_files, capsys):
    import flux_minimal_inference as fmi

    root, files = model_files
    code = fmi.main(["--ckpt_path", str(root / "missing"), "--dtype", "fp8_e5m2", "--lora_weights", "x.safetensors",
                     "--flux_dtype", "int8"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--ckpt_path" in err and "float8_e4m3fn" in err and "no such file x.safetensors" in err
    assert "--flux_dtype int8" in err
    assert fmi.main(_minimal_args(root, files, "--model_type", "chroma")) == 2
    assert "--model_type flux" in capsys.readouterr().err


def test_gen_img_defaults_come_from_the_sampler(dev, tiny_parts):
    """gen_img's --steps / --scale defaults are SD's (50 / 7.5) for SD models only: a FLUX model gets the flow
    sampler's (20 steps, no CFG, embedded guidance 3.5, or --guidance)."""
    from gen_img import build_parser
    from library.sampling.inference import GEN_IMG_DDPM_DEFAULTS, GenImgConfig

    def settings(family, parts, *flags):
        cfg = GenImgConfig.from_args(build_parser().parse_args(["--ckpt", ".", "--prompt", PROMPT, *flags]))
        spec = resolve(cfg.prompts[0], family, parts, ddpm_defaults=GEN_IMG_DDPM_DEFAULTS, **cfg.defaults)
        return spec.steps, spec.scale, spec.guidance

    assert settings(FLUX_DEV, dev) == (20, 1.0, 3.5)
    assert settings(FLUX_DEV, dev, "--guidance", "2", "--scale", "3", "--steps", "8") == (8, 3.0, 2.0)
    assert settings(get_family("sd1"), tiny_parts["sd1"]) == (50, 7.5, None)
    assert settings(get_family("sd1"), tiny_parts["sd1"], "--steps", "8", "--scale", "3") == (8, 3.0, None)


def test_fp8_base_stores_flux_modulation_linears_in_float8(dev):
    """--fp8_base stores the whole FLUX transformer in float8 as sd-scripts' model.to(float8) does, its modulation
    Linears (norm1.linear ..., 3 GiB at real size) included, which the SD UNets' rule (skip "norm") would keep."""
    from types import SimpleNamespace

    from library.device.fp8 import store_in_fp8, stored_in_fp8
    from library.run.setup import store_frozen_in_fp8

    parts, sd_rule = copy.deepcopy(dev), copy.deepcopy(dev.denoiser)
    run = SimpleNamespace(
        fp8_base=True, fp8_base_unet=False, fp8_scaled=False, weight_dtype=torch.bfloat16, train_dtype=torch.float32
    )
    store_frozen_in_fp8(SimpleNamespace(run=run, trained_parts=(), family=FLUX_DEV), parts)
    store_in_fp8(sd_rule, torch.bfloat16, skip=("norm",))
    linears = [n for n, m in dev.denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    modulation = [n for n in linears if "norm" in n]
    assert modulation and all(stored_in_fp8(parts.denoiser.get_submodule(n)) for n in linears)
    assert not any(stored_in_fp8(sd_rule.get_submodule(n)) for n in modulation)
    for te in parts.text_encoders:  # every Linear but those transformers keeps in float32 (T5's feed-forward ``wo``)
        keep = tuple(getattr(te, "_keep_in_fp32_modules", None) or ())
        for n, m in te.named_modules():
            if isinstance(m, torch.nn.Linear):
                assert stored_in_fp8(m) != any(k in n.split(".") for k in keep), n


def test_cached_sample_prompts_sample_without_the_text_encoders(dev, tmp_path):
    """Under --cache_text_encoder_outputs the run caches the sample prompts' conditioning with the text-encoder
    outputs (cache_sample_prompts, as sd-scripts): a round given it never runs a text encoder (so T5-XXL needs no
    device memory while sampling) and writes the same pixels as a round that encodes (true CFG with --n too)."""
    from library.sampling import SampleConfig, cache_sample_prompts, sample_during_training

    parts = copy.deepcopy(dev)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 5\na dog --n blurry --l 3 --w 64 --h 64 --s 2 --d 6\n")
    cfg = SampleConfig(prompts, every_n_steps=1)
    conds = cache_sample_prompts(cfg, FLUX_DEV, parts)
    assert set(conds) == {"a red cat", "", "a dog", "blurry"}
    encoded = sample_during_training(cfg, FLUX_DEV, parts, output_dir=tmp_path / "a", output_name="x", step=1)
    calls = []
    for te in parts.text_encoders:
        te.register_forward_pre_hook(lambda *a: calls.append(1))
    cached = sample_during_training(cfg, FLUX_DEV, parts, output_dir=tmp_path / "b", output_name="x", step=1,
                                    conds=conds)  # fmt: skip
    assert not calls and len(cached) == len(encoded) == 3  # two images and the grid
    for a, b in zip(encoded, cached):
        assert np.array_equal(_pixels(a), _pixels(b))
    assert cache_sample_prompts(SampleConfig(None), FLUX_DEV, parts) is None  # nothing samples: nothing cached


def test_samples_during_a_flux_run_use_the_cached_prompts(dataset, tmp_path, monkeypatch):
    """train_network.run on the FLUX family (flux_train_network.py is its own piece) with
    --cache_text_encoder_outputs and --sample_prompts: the run caches the sample prompts with the text-encoder
    outputs, the round gets them and writes its image without running a text encoder."""
    import train_network
    from library import sampling

    rounds = []
    original = sampling.sample_during_training

    def recorded(cfg, family, parts, **kwargs):
        calls = []
        hooks = [te.register_forward_pre_hook(lambda *a: calls.append(1)) for te in parts.text_encoders]
        try:
            paths = original(cfg, family, parts, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        rounds.append((sorted(kwargs.get("conds") or {}), len(calls), paths))
        return paths

    monkeypatch.setattr(sampling, "sample_during_training", recorded)
    model = FLUX_DEV.save(build_tiny_flux("flux-dev"), tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 1\n")
    argv = [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
        "--output_dir", str(tmp_path / "out"), "--output_name", "t", "--network_module", "networks.lora",
        "--network_dim", "2", "--network_train_unet_only", "--cache_text_encoder_outputs", "--resolution", "64",
        "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "1", "--sample_prompts",
        str(prompts), "--sample_every_n_steps", "1",
    ]  # fmt: skip
    result = train_network.run(argv, family_names=("flux-dev",))
    assert result.steps == 1 and result.failed is None
    [(cached, te_calls, paths)] = rounds
    assert cached == ["", "a red cat"] and te_calls == 0 and paths and all(p.exists() for p in paths)
