"""Z-Image on the tiny files: the DiT's key map equals diffusers' single-file converter on every key, and every
released layout (original / ComfyUI, diffusers names, split sets, diffusers folders) loads the same weights; the Qwen3
prompt path equals transformers' Qwen3ForCausalLM; sampling equals diffusers' ZImagePipeline (timestep direction, sign,
shift, CFG); musubi-tuner's objective draws; bad input is refused before anything loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zimage_cache_latents
import zimage_train_network
from library.cli.problems import ConfigError
from library.families.encoders import qwen3
from library.families.zimage import ZIMAGE
from library.families.zimage import model as M
from library.families.zimage.loading import load_dit, load_vae
from library.families.zimage.objective import ZImageFlowConfig, ZImageFlowObjective
from library.families.zimage.options import ZImageOptions
from library.objectives.losses import LossConfig

pytest_plugins = ["_zimage_helpers"]
CAPTIONS = ["a red cube on a table", ""]


def test_key_map_equals_diffusers_converter(zimage_files):
    """Every key of the original file, bare and under model.diffusion_model., reads as diffusers'
    convert_z_image_transformer_checkpoint_to_diffusers makes it (fused qkv split, renames); back again exactly."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    original = load_file(zimage_files["dit"])
    assert any(k.endswith("attention.qkv.weight") for k in original) and "x_embedder.weight" in original
    for state in (original, {M.COMFY_PREFIX + k: v for k, v in original.items()}):
        want = convert_z_image_transformer_checkpoint_to_diffusers(dict(state))
        view = M.DiffusersView(state)
        assert sorted(view) == sorted(want)
        for key, value in want.items():
            assert torch.equal(view[key], value), key
            assert tuple(view.shape(key)) == tuple(value.shape)
    diffusers_state = zimage_files["parts"].denoiser.state_dict()
    assert sorted(want) == sorted(diffusers_state)
    back = M.to_original(dict(M.DiffusersView(original).items()))
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


def test_dit_layouts_load_the_same(zimage_files, tmp_path):
    """The original file, the same bf16 under ComfyUI's prefix, diffusers names split into -0000k-of-00002 files (given
    by the first) and a diffusers folder (save_pretrained) give the same DiT."""
    parts = zimage_files["parts"]
    want = parts.denoiser.state_dict()
    state = dict(want)
    keys = sorted(state)
    half = len(keys) // 2
    for i, chunk in enumerate((keys[:half], keys[half:]), 1):
        save_file({k: state[k].contiguous() for k in chunk}, str(tmp_path / f"dit-{i:05d}-of-00002.safetensors"))
    comfy = {M.COMFY_PREFIX + k: v for k, v in load_file(zimage_files["dit"]).items()}
    save_file(comfy, str(tmp_path / "comfy.safetensors"))
    parts.denoiser.save_pretrained(str(tmp_path / "folder" / "transformer"))
    for path in (zimage_files["dit"], tmp_path / "comfy.safetensors", tmp_path / "dit-00001-of-00002.safetensors",
                 tmp_path / "folder"):  # fmt: skip
        got = load_dit(Path(path), torch.float32, "cpu").state_dict()
        assert sorted(got) == sorted(want), path
        assert all(torch.equal(got[k], want[k]) for k in want), path
    with pytest.raises(ValueError, match="no Z-Image DiT weights"):
        load_dit(Path(zimage_files["vae"]), torch.float32, "cpu")


def test_prompt_and_text_encoder_layouts(zimage_files, tmp_path):
    """Our prompt states equal transformers' Qwen3ForCausalLM hidden_states[-2] at the real tokens of the chat
    template; a Qwen3ForCausalLM file (lm_head, no prefix stripping needed) loads the same encoder; the AE file in
    BFL names loads the tiny AE; --fp8_llm stays close."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    parts = zimage_files["parts"]
    tok = parts.tokenizers[0]
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644 and tok.convert_tokens_to_ids("<|im_end|>") == 151645
    lm = Qwen3ForCausalLM(Qwen3Config(**qwen3.TINY)).eval()
    lm.model.load_state_dict(parts.text_encoders[0].state_dict())
    ids, mask = qwen3.tokenize(tok, CAPTIONS)
    assert ids[0, :3].tolist() == [151644, 872, 198]  # <|im_start|> user \n
    with torch.no_grad():
        ref = lm(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        cond = ZIMAGE.encode_prompt(parts, CAPTIONS)
    for i in range(len(CAPTIONS)):
        n = int(mask[i].sum())
        torch.testing.assert_close(cond.hidden_states[i, :n], ref[i, :n])
        assert not cond.hidden_states[i, n:].any()
    save_file({**{"model." + k: v for k, v in lm.model.state_dict().items()}, "lm_head.weight": lm.lm_head.weight.clone()},
              str(tmp_path / "qwen3_causal.safetensors"))  # fmt: skip
    got = qwen3.load(tmp_path / "qwen3_causal.safetensors", dtype=torch.float32).state_dict()
    assert all(torch.equal(got[k], v) for k, v in parts.text_encoders[0].state_dict().items())
    vae = load_vae(Path(zimage_files["vae"]), torch.float32, "cpu")
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in parts.vae.state_dict().items())
    # our folder (DiT, Qwen3, AE) loads without the part flags; --fp8_llm keeps the prompt states close
    ZIMAGE.save(parts, tmp_path / "folder")
    again = ZIMAGE.load(tmp_path / "folder")
    assert all(torch.equal(again.denoiser.state_dict()[k], v) for k, v in parts.denoiser.state_dict().items())
    fp8 = ZIMAGE.load(tmp_path / "folder", options=ZImageOptions(fp8_llm=True))
    assert fp8.text_encoders[0].layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn
    rounded = copy.deepcopy(parts)  # the oracle: every Linear weight rounded to float8 and back by hand
    for module in rounded.text_encoders[0].modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.to(torch.float8_e4m3fn).float()
    with torch.no_grad():
        got = ZIMAGE.encode_prompt(fp8, CAPTIONS).hidden_states
        want = ZIMAGE.encode_prompt(rounded, CAPTIONS).hidden_states
    torch.testing.assert_close(got, want)
    assert (want - cond.hidden_states).abs().max() > 1e-3


def test_sampling_equals_diffusers_pipeline(zimage_files):
    """Our flow sampler on the tiny model equals diffusers' ZImagePipeline from the same noise and prompt states:
    turbo (no CFG) and base with a negative prompt (diffusers' guidance_scale g is our CFG g + 1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from library.sampling.flow_generate import encode_flow_prompts, sample_flow_latents
    from library.sampling.generate import resolve
    from library.sampling.prompts import PromptSpec

    parts = zimage_files["parts"]
    pipe = ZImagePipeline(FlowMatchEulerDiscreteScheduler(shift=3.0), parts.vae, parts.text_encoders[0],
                          parts.tokenizers[0], parts.denoiser)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pos, neg = ZIMAGE.encode_prompt(parts, ["a red cube"]), ZIMAGE.encode_prompt(parts, ["blurry"])
    for g, spec in ((0.0, PromptSpec("a red cube", width=64, height=48, steps=3, scale=1.0)),
                    (4.0, PromptSpec("a red cube", "blurry", width=64, height=48, steps=3, scale=5.0))):  # fmt: skip
        spec = resolve(spec, ZIMAGE, parts)
        gen = torch.Generator().manual_seed(3)
        noise = torch.randn((1, 16, 6, 8), generator=torch.Generator().manual_seed(3))
        ours = sample_flow_latents(ZIMAGE, parts, [spec], encode_flow_prompts(ZIMAGE, parts, [spec]), [gen])
        ref = pipe(prompt_embeds=[pos.hidden_states[0]], negative_prompt_embeds=[neg.hidden_states[0]],
                   guidance_scale=g, height=48, width=64, num_inference_steps=3, latents=noise.clone(),
                   output_type="latent").images  # fmt: skip
        torch.testing.assert_close(ours, ref.float(), rtol=1e-4, atol=1e-4)


def test_objective_draws():
    """musubi-tuner's meanings: x_t = (1 − t) x0 + t ε with timesteps 1000 t + 1 (sigma: 1000 σ from its table), the
    target is ε − x0 (the negation of its x0 − ε, as predict negates the DiT); the shift law moves t up."""
    x0 = torch.randn(64, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    ts = {}
    for kind in ("uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "logsnr", "sigma"):
        obj = ZImageFlowObjective(ZImageFlowConfig(timestep_sampling=kind, discrete_flow_shift=2.0), LossConfig())
        ex = obj.example(x0, torch.Generator().manual_seed(7))
        t = ex.sigmas.view(-1, 1, 1, 1)
        torch.testing.assert_close(ex.noisy, (1 - t) * x0 + t * ex.noise)
        torch.testing.assert_close(ex.target, ex.noise - x0)
        offset = 0 if kind == "sigma" else 1
        torch.testing.assert_close(ex.timesteps.float(), ex.sigmas.float() * 1000 + offset)
        ts[kind] = ex.sigmas
    torch.testing.assert_close(ts["shift"], 2 * ts["sigmoid"] / (1 + ts["sigmoid"]))
    with pytest.raises(ConfigError, match="qinglong_flux"):
        ZImageFlowConfig(timestep_sampling="qinglong_flux")


def test_bad_input_refused_before_loading(tmp_path, capsys):
    """Refusals name the flag, all at once, before any file is read; the caching scripts name a missing file."""
    argv = ["--dit", str(tmp_path / "none.safetensors"), "--dataset_config", str(tmp_path / "d.toml"),
            "--network_module", "networks.lora_zimage", "--output_dir", str(tmp_path)]  # fmt: skip
    assert zimage_train_network.main([*argv, "--flash_attn"]) == 2
    assert "--flash_attn" in capsys.readouterr().err
    assert zimage_train_network.main([*argv, "--timestep_sampling", "qinglong_flux", "--model_version", "edit"]) == 2
    err = capsys.readouterr().err
    assert "qinglong_flux" in err and "--model_version edit" in err and "d.toml: file not found" in err
    assert zimage_cache_latents.main(["--dataset_config", "x.toml", "--vae", "ae.safetensors"]) == 2
    assert "--vae ae.safetensors: no such file" in capsys.readouterr().err
