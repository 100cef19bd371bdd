"""FLUX.2 (klein) on the tiny files: the BFL / ComfyUI / diffusers DiT layouts against diffusers' single-file
converter on every key; the AE's names and latent normalisation against diffusers' converter and Flux2KleinPipeline;
the Qwen3 prompt against Flux2KleinPipeline's encoder; the DiT call's position ids against the pipeline's; musubi-tuner's
documented flux_2_train_network.py command line with its dataset TOML, whose LoRA applied by ComfyUI's rule (by hand)
and by diffusers' Flux2KleinPipeline loader equals our injected network; LoKr; the loss falls; bad input is refused
before training."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import flux_2_train_network
from library.cli.problems import ConfigError
from library.families.autoencoders import flux2 as ae
from library.families.base import Parts
from library.families.flux2 import FLUX2
from library.families.flux2 import keys as K
from library.families.flux2 import model as M
from library.families.flux2.loading import load_dit, variant
from library.files.weights import read_metadata

pytest_plugins = ["_flux2_helpers"]
CAPTIONS = ["a red cube on a table", ""]


def musubi_toml(dataset: Path, path: Path, extra: str = "") -> Path:
    """musubi-tuner's dataset config (docs/dataset_config.md's image example) over the demo's images, 64 px."""
    path.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 2\nenable_bucket = true\n'
                    f'bucket_no_upscale = false\n\n[[datasets]]\nimage_directory = "{(dataset / "10_sks shape").as_posix()}"\n'
                    f'num_repeats = 1\n{extra}')  # fmt: skip
    return path


def doc_command(files, toml, out, *extra):
    """musubi-tuner's docs/flux_2.md LoRA line with the tiny files (1 epoch, loader workers 0 for the test)."""
    return ["--model_version", "klein-base-4b", "--dit", files["dit"], "--vae", files["vae"], "--text_encoder",
            files["text_encoder"], "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16",
            "--timestep_sampling", "flux2_shift", "--weighting_scheme", "none", "--optimizer_type", "adamw8bit",
            "--learning_rate", "1e-4", "--gradient_checkpointing", "--max_data_loader_n_workers", "0",
            "--persistent_data_loader_workers", "--network_module", "networks.lora_flux_2", "--network_dim", "32",
            "--max_train_epochs", "1", "--save_every_n_epochs", "1", "--seed", "42", "--output_dir", str(out),
            "--output_name", "name-of-lora", *extra]  # fmt: skip


def _inputs(seed: int, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 128, 4, 6, generator=g),
        torch.randn(batch, 5, 48, generator=g),
        torch.tensor([0.6] * batch),
    )


@pytest.mark.parametrize("guidance", [False, True])
def test_dit_keys_equal_diffusers_converter(flux2_files, guidance):
    """Every key of a tiny BFL file (klein; dev's guidance_in too) converts as diffusers'
    convert_flux2_transformer_checkpoint_to_diffusers converts it, bare and under model.diffusion_model.; back to BFL
    gives the file again."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    torch.manual_seed(1)
    model = M.build(dict(M.TINY, guidance_embeds=guidance))
    bfl = {k: torch.randn(v.shape) for k, v in K.to_bfl(model.state_dict()).items()}
    want = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(want) == set(model.state_dict())
    for source in (bfl, {K.BFL_PREFIX + k: v for k, v in bfl.items()}):
        view = K.BflView(source)
        assert set(view) == set(want) and view.unread == []
        for k in want:
            assert torch.equal(view[k], want[k]) and tuple(view.shape(k)) == tuple(want[k].shape), k
    back = K.to_bfl(dict(K.BflView(bfl).items()))
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_dit_layouts_load_the_same(flux2_files, tmp_path):
    """BFL's file, ComfyUI's model.diffusion_model. file, a file in diffusers' names and a diffusers folder read the
    same DiT; the folder also gives its text encoder and AE (no --text_encoder / --vae)."""
    parts = flux2_files["parts"]
    want = parts.denoiser.state_dict()
    bfl = load_file(flux2_files["dit"])
    save_file({K.BFL_PREFIX + k: v for k, v in bfl.items()}, str(tmp_path / "comfy.safetensors"))
    save_file(dict(want), str(tmp_path / "diffusers.safetensors"))
    FLUX2.tiny.write_folder(parts, tmp_path / "pipe")
    for path in (Path(flux2_files["dit"]), tmp_path / "comfy.safetensors", tmp_path / "diffusers.safetensors"):
        got = load_dit(path, torch.float32, "cpu").state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), path
    loaded = FLUX2.load(tmp_path / "pipe")
    for a, b in ((parts.denoiser, loaded.denoiser), (parts.vae, loaded.vae), (parts.text_encoders[0],
                                                                              loaded.text_encoders[0])):  # fmt: skip
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="--dit .*no FLUX.2 DiT weights"):
        load_dit(Path(flux2_files["vae"]), torch.float32, "cpu")


def test_variant_from_the_weights():
    """dev / klein 4B / klein 9B from the architecture; base from --model_version or the file name; a version that
    names another architecture is refused."""
    assert variant(M.DEV, None, Path("flux2-dev.safetensors")) == "dev"
    assert variant(M.KLEIN_9B, None, Path("flux2-klein-9b.safetensors")) == "klein-9b"
    assert variant(M.KLEIN_4B, None, Path("flux2-klein-base-4b.safetensors")) == "klein-base-4b"
    assert variant(M.KLEIN_4B, "klein-base-4b", Path("x.safetensors")) == "klein-base-4b"
    with pytest.raises(ValueError, match="--model_version dev: the DiT .* is FLUX.2 klein-4b"):
        variant(M.KLEIN_4B, "dev", Path("x.safetensors"))


def test_ae_names_and_latents_equal_diffusers(flux2_files):
    """The BFL ae.safetensors names read as diffusers' convert_ldm_vae_checkpoint reads them (quant convs moved to
    the top, bn kept); encode equals Flux2KleinPipeline._encode_vae_image (argmax, patchify, bn statistics) and
    decode inverts the normalisation."""
    from diffusers import Flux2KleinPipeline
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    vae = flux2_files["parts"].vae
    bfl = load_file(flux2_files["vae"])
    moved = {k.replace("encoder.quant_conv", "quant_conv").replace("decoder.post_quant_conv", "post_quant_conv"): v
             for k, v in bfl.items()}  # fmt: skip
    want = convert_ldm_vae_checkpoint(moved, dict(vae.config))
    got = ae.load(Path(flux2_files["vae"]), torch.float32, "cpu").state_dict()
    assert set(want) | {k for k in got if k.startswith("bn.")} == set(got)
    assert all(torch.equal(got[k], want[k].reshape(got[k].shape)) for k in want)
    assert all(torch.equal(got[k], vae.state_dict()[k]) for k in got)
    pixels = torch.rand(2, 3, 64, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    pipe = SimpleNamespace(vae=vae, _patchify_latents=Flux2KleinPipeline._patchify_latents)
    with torch.no_grad():
        ref = Flux2KleinPipeline._encode_vae_image(pipe, pixels, None)
        ours = FLUX2.encode_latents(flux2_files["parts"], pixels)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        z = vae.encode(pixels).latent_dist.mode()
        torch.testing.assert_close(FLUX2.decode_latents(flux2_files["parts"], ours),
                                   vae.decode(z).sample.clamp(-1, 1), atol=1e-5, rtol=1e-5)  # fmt: skip


def test_prompt_equals_klein_pipeline(flux2_files):
    """Our prompt equals Flux2KleinPipeline._get_qwen3_prompt_embeds over Qwen3ForCausalLM with the same weights
    (chat template, thinking off, 512 tokens, layers 9, 18, 27 side by side)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.families.encoders import qwen3
    from library.families.flux2.loading import TINY_QWEN3

    parts = flux2_files["parts"]
    lm = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).eval()
    lm.model.load_state_dict(parts.text_encoders[0].state_dict())
    tok = copy.copy(parts.tokenizers[0])
    tok.chat_template = qwen3.chat_template()
    with torch.no_grad():
        ref = Flux2KleinPipeline._get_qwen3_prompt_embeds(lm, tok, CAPTIONS, dtype=torch.float32, device="cpu")
        ours = FLUX2.encode_prompt(parts, CAPTIONS).hidden_states
    assert ours.shape == (2, 512, 48)
    torch.testing.assert_close(ours, ref)


def test_forward_ids_equal_pipeline(flux2_files):
    """The DiT call (tokens in row order, ids (0, h, w, 0), text ids (0, 0, 0, l), a reference image at t = 10)
    equals the transformer called with Flux2KleinPipeline's own packing and id helpers."""
    from diffusers import Flux2KleinPipeline as P

    denoiser = flux2_files["parts"].denoiser
    x, ctx, t = _inputs(0, 2)
    ref = torch.randn(2, 128, 2, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = M.forward(denoiser, x, t, ctx, references=[ref])
        ids = torch.cat([P._prepare_latent_ids(x)[0], P._prepare_image_ids([ref[:1]])[0]])
        tokens = torch.cat([P._pack_latents(x), P._pack_latents(ref)], dim=1)
        out = denoiser(hidden_states=tokens, encoder_hidden_states=ctx, timestep=t, img_ids=ids,
                       txt_ids=P._prepare_text_ids(ctx)[0], return_dict=False)[0][:, :24]  # fmt: skip
    torch.testing.assert_close(ours, out.transpose(1, 2).reshape(x.shape))


def _merged(denoiser, lora_sd, multiplier=1.0):
    """ComfyUI's rule by hand on the BFL state dict (lora_unet_ + the BFL key's module path with dots as
    underscores; W += m·α/r·up@down), read back into the diffusers model through the BFL view."""
    bfl = K.to_bfl(denoiser.state_dict())
    by_kohya = {"lora_unet_" + k[: -len(".weight")].replace(".", "_"): k for k in bfl if k.endswith(".weight")}
    for name in {k.split(".")[0] for k in lora_sd}:
        up, down = lora_sd[f"{name}.lora_up.weight"].float(), lora_sd[f"{name}.lora_down.weight"].float()
        alpha = float(lora_sd[f"{name}.alpha"]) if f"{name}.alpha" in lora_sd else down.shape[0]
        key = by_kohya[name]
        bfl[key] = bfl[key] + multiplier * alpha / down.shape[0] * (up @ down)
    out = copy.deepcopy(denoiser)
    out.load_state_dict(dict(K.BflView(bfl).items()))
    return out


def _comfy_lokr_merged(denoiser, lokr_sd):
    """ComfyUI's LoKr rule (comfy/weight_adapter/lokr.py) by hand on the BFL state dict: W += s·kron(w1, w2), each
    factor given whole or as a @ b, s = alpha / the decomposed factor's rank (1 when neither is decomposed)."""
    bfl = K.to_bfl(denoiser.state_dict())
    by_kohya = {"lora_unet_" + k[: -len(".weight")].replace(".", "_"): k for k in bfl if k.endswith(".weight")}
    for name in {k.split(".")[0] for k in lokr_sd}:
        get = {k.split(".", 1)[1]: v.float() for k, v in lokr_sd.items() if k.split(".")[0] == name}
        w1 = get["lokr_w1"] if "lokr_w1" in get else get["lokr_w1_a"] @ get["lokr_w1_b"]
        w2 = get["lokr_w2"] if "lokr_w2" in get else get["lokr_w2_a"] @ get["lokr_w2_b"]
        dim = (
            get["lokr_w2_b"].shape[0]
            if "lokr_w2_b" in get
            else get["lokr_w1_b"].shape[0]
            if "lokr_w1_b" in get
            else None
        )
        scale = float(get["alpha"]) / dim if dim is not None and "alpha" in get else 1.0
        key = by_kohya[name]
        bfl[key] = bfl[key] + scale * torch.kron(w1, w2).reshape(bfl[key].shape)
    out = copy.deepcopy(denoiser)
    out.load_state_dict(dict(K.BflView(bfl).items()))
    return out


def test_documented_command_line_with_musubi_toml(flux2_files, dataset, tmp_path):
    """musubi-tuner's docs/flux_2.md line with its dataset TOML runs; the file names every Linear of the blocks by
    its BFL path (qkv fused); applied by ComfyUI's rule, by diffusers' Flux2KleinPipeline loader and by our injected
    network it gives the same output."""
    from diffusers import Flux2KleinPipeline

    from networks.inject import network_from_file

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    result = flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", "--network_alpha", "8"))
    meta = read_metadata(result.output)
    assert meta["ss_network_module"] == "networks.lora_flux_2" and meta["ss_timestep_sampling"] == "flux2_shift"
    assert meta["modelspec.architecture"] == "flux-2/lora" and meta["ss_base_model_version"] == "flux2"
    sd = load_file(str(result.output))
    names = {k.split(".")[0] for k in sd}
    blocks = {f"lora_unet_double_blocks_0_{s}_{m}" for s in ("img", "txt") for m in ("attn_qkv", "attn_proj",
                                                                                        "mlp_0", "mlp_2")}  # fmt: skip
    assert names == blocks | {f"lora_unet_single_blocks_{i}_linear{j}" for i in (0, 1) for j in (1, 2)}
    for k in [k for k in sd if k.endswith("lora_up.weight")]:
        sd[k] = torch.randn_like(sd[k]) * 0.05  # trained ups are tiny after 2 steps: make the comparison telling
    save_file(sd, str(tmp_path / "lora.safetensors"))
    base = flux2_files["parts"].denoiser
    merged = _merged(base, sd)
    ours = copy.deepcopy(base)
    net = network_from_file(tmp_path / "lora.safetensors", FLUX2.adapter_roots(Parts(ours, None, [], [], {}, "flux2")))
    net.set_multiplier(1.0)
    x, ctx, t = _inputs(3)
    with torch.no_grad():
        want = M.forward(merged, x, t, ctx)
        assert (want - M.forward(base, x, t, ctx)).abs().max() > 1e-3  # the LoRA changes the output
        diff = copy.deepcopy(base)
        state = Flux2KleinPipeline.lora_state_dict(str(tmp_path / "lora.safetensors"))
        Flux2KleinPipeline.load_lora_into_transformer(state, transformer=diff)
        torch.testing.assert_close(M.forward(diff, x, t, ctx), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(M.forward(ours, x, t, ctx), want, atol=1e-4, rtol=1e-4)


def test_lycoris_lokr_trains_and_merges(flux2_files, dataset, tmp_path):
    """LoKr through lycoris.kohya on the blocks (the fused qkv one module): live equals merged into the weights, and
    equals the file applied by ComfyUI's LoKr rule on the BFL names (what klein users load)."""
    from networks.inject import network_from_file

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    extra = ["--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=4", "--network_dim", "4"]
    result = flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", *extra))
    sd = load_file(str(result.output))
    assert "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1" in sd and all(k.startswith("lora_unet_") for k in sd)
    for k in [k for k in sd if "lokr_w" in k]:
        sd[k] = torch.randn_like(sd[k]) * 0.3
    save_file(sd, str(tmp_path / "lokr.safetensors"))
    base = flux2_files["parts"].denoiser
    live, merged = copy.deepcopy(base), copy.deepcopy(base)
    net = network_from_file(tmp_path / "lokr.safetensors", FLUX2.adapter_roots(Parts(live, None, [], [], {}, "f")))
    net.set_multiplier(1.0)
    other = network_from_file(tmp_path / "lokr.safetensors", FLUX2.adapter_roots(Parts(merged, None, [], [], {}, "f")))
    other.set_multiplier(1.0)
    other.merge_into_base()
    x, ctx, t = _inputs(5)
    with torch.no_grad():
        a, b = M.forward(live, x, t, ctx), M.forward(merged, x, t, ctx)
        assert (a - M.forward(base, x, t, ctx)).abs().max() > 1e-3
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        comfy = M.forward(_comfy_lokr_merged(base, sd), x, t, ctx)
        torch.testing.assert_close(comfy, a, atol=1e-4, rtol=1e-4)


def test_loss_falls(flux2_files, dataset, tmp_path):
    """Ten epochs at a high learning rate on the four images: the loss of the last epoch is below the first's."""
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    result = flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", "--max_train_epochs", "10",
                                                  "--learning_rate", "3e-3", "--optimizer_type", "AdamW",
                                                  "--timestep_sampling", "uniform", "--save_every_n_epochs", "10"))  # fmt: skip
    assert result.output.is_file() and len(result.losses) == 20
    assert sum(result.losses[-4:]) < sum(result.losses[:4])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fp8_text_encoder"], "--fp8_text_encoder is not supported yet"),
        (["--timestep_sampling", "qinglong_flux"], "--timestep_sampling qinglong_flux is not supported for FLUX.2"),
        (["--model_version", "klein-9"], "--model_version klein-9: unknown"),
    ],
)
def test_refused_before_training(flux2_files, dataset, tmp_path, extra, message):
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    with pytest.raises(ConfigError, match=message):
        flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_generate_image_equals_klein_pipeline(flux2_files, tmp_path):
    """flux_2_generate_image.py's musubi-tuner line (klein base: true CFG with the negative prompt) writes the image
    diffusers' Flux2KleinPipeline makes from the same noise and noise levels (its scheduler given our shifted sigmas),
    and with --control_image_path what it makes with the reference image (image=)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from PIL import Image
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import flux_2_generate_image
    from library.families.encoders import qwen3
    from library.families.flux2.loading import TINY_QWEN3
    from library.sampling.flow import latent_noise
    from library.sampling.flow_generate import flow_settings, sampling_sigmas

    base = ["--dit", flux2_files["dit"], "--vae", flux2_files["vae"], "--text_encoder", flux2_files["text_encoder"],
            "--prompt", "a cat", "--negative_prompt", "", "--image_size", "32", "64", "--infer_steps", "3",
            "--guidance_scale", "2.5", "--flow_shift", "3.0", "--seed", "1"]  # fmt: skip
    (path,) = flux_2_generate_image.run([*base, "--save_path", str(tmp_path / "a")])
    ours = np.asarray(Image.open(path)).astype(int)
    parts = flux2_files["parts"]
    lm = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).eval()
    lm.model.load_state_dict(parts.text_encoders[0].state_dict())
    tok = copy.copy(parts.tokenizers[0])
    tok.chat_template = qwen3.chat_template()
    pipe = Flux2KleinPipeline(FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False), parts.vae, lm,
                              tok, parts.denoiser, is_distilled=False)  # fmt: skip
    settings = flow_settings(FLUX2, Parts(parts.denoiser, None, [], [], {"static_shift": 3.0}, "flux2"))
    sigmas = sampling_sigmas(settings, 3, 32, 64)[:-1].tolist()
    noise = latent_noise([torch.Generator().manual_seed(1)], 32, 64, 128, 16)
    want = pipe(prompt="a cat", height=32, width=64, num_inference_steps=3, sigmas=sigmas, guidance_scale=2.5,
                latents=noise, output_type="np").images[0]  # fmt: skip
    assert ours.shape == (32, 64, 3)
    assert np.abs(ours - np.round(want * 255).astype(int)).max() <= 1
    with pytest.raises(ConfigError, match="--control_image_path x.png: no such file"):
        flux_2_generate_image.run([*base, "--save_path", str(tmp_path / "c"), "--control_image_path", "x.png"])
    # reference images (the edit mode): the pipeline's image= on the same image (a size its processor keeps)
    rng = np.random.default_rng(3)
    control = tmp_path / "control.png"
    Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(control)
    (path,) = flux_2_generate_image.run([*base, "--save_path", str(tmp_path / "e"), "--control_image_path",
                                         str(control)])  # fmt: skip
    edited = np.asarray(Image.open(path)).astype(int)
    want = pipe(prompt="a cat", image=[Image.open(control)], height=32, width=64, num_inference_steps=3,
                sigmas=sigmas, guidance_scale=2.5, latents=noise, output_type="np").images[0]  # fmt: skip
    assert np.abs(edited - np.round(want * 255).astype(int)).max() <= 1 and np.abs(edited - ours).max() > 1


def test_fp8_flags_mean_musubis(flux2_files, dataset, tmp_path):
    """musubi-tuner's --fp8_base is the DiT's alone (our --fp8_base_unet); with --fp8_text_encoder the text encoder
    is stored in float8 too (our --fp8_base); the run trains with both and says so in the file."""
    from library.families.flux2.options import musubi_argv

    assert "--fp8_base_unet" in musubi_argv(["--fp8_base", "--fp8_scaled"])
    both = musubi_argv(["--fp8_base", "--fp8_text_encoder"])
    assert "--fp8_base" in both and "--fp8_text_encoder" not in both and "--fp8_base_unet" not in both
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    extra = ["--fp8_base", "--fp8_scaled", "--fp8_text_encoder"]
    result = flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", *extra))
    meta = read_metadata(result.output)
    assert meta["ss_fp8_base"] == "True" and meta["ss_fp8_scaled"] == "True"
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_vae_dtype_is_read(flux2_files):
    """--vae_dtype sets the AE's dtype (musubi-tuner's flag); the others keep theirs."""
    from library.families.flux2.options import Flux2Options

    opts = Flux2Options(text_encoder=flux2_files["text_encoder"], vae_dtype="bfloat16")
    parts = FLUX2.load(flux2_files["dit"], vae=flux2_files["vae"], options=opts)
    assert next(parts.vae.parameters()).dtype == torch.bfloat16
    assert next(parts.denoiser.parameters()).dtype == torch.float32


def test_lokr_loads_in_diffusers_equal_to_ours(flux2_files, tmp_path):
    """A LoKr file (lycoris.kohya names, the fused qkv one module) converted by lokr_for_diffusers loads in
    Flux2KleinPipeline.load_lora_weights and gives our injected network's output."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from library.families.flux2.lora_formats import lokr_for_diffusers
    from networks.inject import network_from_file

    base = flux2_files["parts"].denoiser
    g = torch.Generator().manual_seed(9)
    sd = {}
    for name, (rows, cols) in (("double_blocks_0_img_attn_qkv", (96, 32)), ("single_blocks_1_linear2", (32, 128))):
        sd[f"lora_unet_{name}.lokr_w1"] = torch.randn(4, 4, generator=g) * 0.3
        sd[f"lora_unet_{name}.lokr_w2"] = torch.randn(rows // 4, cols // 4, generator=g) * 0.3
    save_file(sd, str(tmp_path / "lokr.safetensors"))
    ours = copy.deepcopy(base)
    net = network_from_file(tmp_path / "lokr.safetensors", FLUX2.adapter_roots(Parts(ours, None, [], [], {}, "f")))
    net.set_multiplier(1.0)
    pipe = Flux2KleinPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, copy.deepcopy(base))
    pipe.load_lora_weights(lokr_for_diffusers(sd))
    x, ctx, t = _inputs(8)
    with torch.no_grad():
        want = M.forward(ours, x, t, ctx)
        assert (want - M.forward(base, x, t, ctx)).abs().max() > 1e-3
        torch.testing.assert_close(M.forward(pipe.transformer, x, t, ctx), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not a LoKr tensor"):
        lokr_for_diffusers({"lora_unet_single_blocks_0_linear1.lora_down.weight": torch.zeros(1)})


# every flag of musubi-tuner's flux_2_train_network.py (training/parser_common.py's setup_parser_common +
# flux2_setup_parser, read from kohya-ss/musubi-tuner's parser)
MUSUBI_FLAGS = """--async_upload --base_weights --base_weights_multiplier --block_swap_h2d_only --block_swap_ring_size
--blocks_to_swap --compile --compile_backend --compile_cache_size_limit --compile_dynamic --compile_fullgraph
--compile_mode --config_file --cuda_allow_tf32 --cuda_cudnn_benchmark --dataset_config --ddp_gradient_as_bucket_view
--ddp_static_graph --ddp_timeout --dim_from_weights --disable_numpy_memmap --discrete_flow_shift --dit
--dynamo_backend --dynamo_dynamic --dynamo_fullgraph --dynamo_mode --flash3 --flash_attn --fp8_base --fp8_scaled
--fp8_text_encoder --gradient_accumulation_steps --gradient_checkpointing --gradient_checkpointing_cpu_offload
--guidance_scale --help --huggingface_path_in_repo --huggingface_repo_id --huggingface_repo_type
--huggingface_repo_visibility --huggingface_token --img_in_txt_in_offloading --learning_rate --log_config
--log_prefix --log_tracker_config --log_tracker_name --log_with --logging_dir --logit_mean --logit_std
--lr_decay_steps --lr_scheduler --lr_scheduler_args --lr_scheduler_min_lr_ratio --lr_scheduler_num_cycles
--lr_scheduler_power --lr_scheduler_timescale --lr_scheduler_type --lr_warmup_steps --max_data_loader_n_workers
--max_grad_norm --max_timestep --max_train_epochs --max_train_steps --metadata_arch --metadata_author
--metadata_description --metadata_license --metadata_reso --metadata_tags --metadata_title --min_timestep
--mixed_precision --mode_scale --model_version --network_alpha --network_args --network_dim --network_dropout
--network_module --network_weights --no_metadata --num_timestep_buckets --optimizer_args --optimizer_type
--output_dir --output_name --persistent_data_loader_workers --preserve_distribution_shape --resume
--resume_from_huggingface --sage_attn --sample_at_first --sample_every_n_epochs --sample_every_n_steps
--sample_prompts --save_every_n_epochs --save_every_n_steps --save_last_n_epochs --save_last_n_epochs_state
--save_last_n_steps --save_last_n_steps_state --save_precision --save_state --save_state_on_train_end
--save_state_to_huggingface --scale_weight_norms --sdpa --seed --show_timesteps --sigmoid_scale --split_attn
--text_encoder --timestep_sampling --training_comment --use_pinned_memory_for_block_swap --vae --vae_dtype
--wandb_api_key --wandb_run_name --weighting_scheme --xformers""".split()


def test_every_musubi_flag_is_read_or_refused_by_name():
    """Each flag of musubi-tuner's FLUX.2 LoRA script is one of ours; the musubi-only ones are refused with a message
    naming the flag."""
    from library.cli.parse import unsupported_problems
    from library.families.flux2.options import MUSUBI_ONLY

    parser = flux_2_train_network.build_parser()
    assert [f for f in MUSUBI_FLAGS if f not in parser._option_string_actions] == []
    for flag, (kwargs, _) in MUSUBI_ONLY.items():
        value = [] if kwargs.get("action") == "store_true" else ["1"]
        args = parser.parse_args([flag, *value])
        assert any(p.startswith(f"{flag} is not supported yet") for p in unsupported_problems(parser, args)), flag


def test_sampling_during_training_with_cfg(flux2_files, dataset, tmp_path):
    """A sample prompt with a negative prompt is drawn during training (klein base: true CFG) as a 64 px PNG that
    is not blank."""
    import numpy as np
    from PIL import Image

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    (tmp_path / "prompts.txt").write_text("a red cube on the table --w 64 --h 64 --s 2 --l 4.0 --n bad --d 3\n")
    extra = ["--sample_prompts", str(tmp_path / "prompts.txt"), "--sample_every_n_epochs", "1"]
    flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out", *extra))
    pngs = sorted((tmp_path / "out" / "sample").glob("*.png"))
    assert pngs
    pixels = np.asarray(Image.open(pngs[-1]))
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0


def test_qwen3_comfy_fp8_scaled_file_loads(flux2_files, tmp_path):
    """ComfyUI's fp8_scaled Qwen3 file (each Linear weight in float8 times its scale_weight) loads as the bf16 one,
    within float8's rounding."""
    from library.families.encoders import qwen3
    from library.families.flux2.loading import TINY_QWEN3

    want = flux2_files["parts"].text_encoders[0].state_dict()
    scaled = {}
    for k, v in want.items():
        if k.endswith(".weight") and v.ndim == 2 and "embed" not in k:
            scale = v.abs().max() / 448
            scaled["model." + k] = (v / scale).to(torch.float8_e4m3fn)
            scaled["model." + k[: -len("weight")] + "scale_weight"] = scale.reshape(1)
        else:
            scaled["model." + k] = v
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, str(tmp_path / "qwen_3_4b_fp8_scaled.safetensors"))
    got = qwen3.load(tmp_path / "qwen_3_4b_fp8_scaled.safetensors", [(TINY_QWEN3, "tiny")], torch.float32).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0.07 * float(want[k].abs().max()) + 1e-7, rtol=0)
