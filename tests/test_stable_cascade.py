"""Stable Cascade stage C (library/families/stable_cascade/) on a tiny model with the real module names.

Oracles: diffusers' own single-file conversion (``convert_stable_cascade_unet_single_file_to_diffusers``) for
Stability's names, at tiny width and on the released 3.6B / lite layouts (meta device); torchvision's documented
size of EfficientNetV2-S (21,458,488 parameters with its 1280 -> 1000 classifier) and its module names for the
encoder; the stable-cascade branch's GDF formulas (re-typed below from its ``library/stable_cascade.py``:
``CosineSchedule``, ``VPScaler``, ``CosineTNoiseCond``, ``P2LossWeight``) and diffusers' ``DDPMWuerstchenScheduler``
on fixed draws; ComfyUI's ``lora_unet_`` rule applied to the Stability-named weights (with ComfyUI's split of
``in_proj`` into ``attn.to_q | to_k | to_v``) against our injected network; the uninterrupted run for ``--resume``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _train_helpers import fixed_noise_loss, write_dataset_toml

import stable_cascade_train_c_network
import stable_cascade_train_stage_c
from library.cli.problems import ConfigError
from library.families import detect_family
from library.families.stable_cascade import STABLE_CASCADE as FAMILY
from library.families.stable_cascade import model as M
from library.families.stable_cascade.effnet import EfficientNetEncoder
from library.files.weights import load_state_dict, read_metadata, save_state_dict
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny parts, Stability's stage C file of them, and the text model / EfficientNet files beside it."""
    root = tmp_path_factory.mktemp("cascade")
    parts = FAMILY.tiny.build(seed=0)
    stage_c = save_state_dict(M.diffusers_to_stability(parts.denoiser.state_dict()), root / "stage_c.safetensors",
                              {}, None)  # fmt: skip
    return {"parts": parts, "stage_c": stage_c, **FAMILY.tiny.write_files(parts, root, "tiny")}


def load(f):
    return FAMILY.load(f["stage_c"], options=FAMILY.options(effnet_checkpoint_path=str(f["effnet"]),
                                                             text_model_checkpoint_path=str(f["text_model"])))  # fmt: skip


def test_stability_files_read_as_diffusers_converts_them(files, tmp_path):
    from diffusers.loaders.single_file_utils import convert_stable_cascade_unet_single_file_to_diffusers as convert

    stability, _ = load_state_dict(files["stage_c"])
    assert any(k.endswith("attention.attn.in_proj_weight") for k in stability)
    theirs = convert(dict(stability))
    ours = M.stability_to_diffusers(stability)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert M.diffusers_to_stability(ours).keys() == stability.keys()
    assert detect_family(files["stage_c"]) is FAMILY
    loaded = load(files)
    reference = files["parts"].denoiser.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in loaded.denoiser.state_dict().items())
    with pytest.raises(ValueError, match="--text_model_checkpoint_path"):
        FAMILY.load(files["stage_c"])
    folder = FAMILY.save(loaded, tmp_path / "folder")  # a diffusers prior folder, the encoder in effnet/
    again = FAMILY.load(folder)
    assert detect_family(folder) is FAMILY and again.vae is not None
    for mine, theirs in ((again.denoiser, loaded.denoiser), (again.vae, loaded.vae),
                         (again.text_encoders[0], loaded.text_encoders[0])):  # fmt: skip
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in mine.state_dict().items())
    target = tmp_path / "text_model.safetensors"  # --save_text_model: the folder's encoder, as the branch writes it
    FAMILY.load(folder, options=FAMILY.options(save_text_model=True, text_model_checkpoint_path=str(target)))
    written, original = load_state_dict(target)[0], load_state_dict(files["text_model"])[0]
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in written)


@pytest.mark.parametrize("config", [M.PRIOR, M.PRIOR_LITE], ids=["3.6B", "lite"])
def test_released_layouts_are_told_from_the_weights(config):
    from accelerate import init_empty_weights

    with init_empty_weights():
        prior = M.prior_factory(config)()
    state = prior.state_dict()
    assert M.config_from_weights(state, lambda k: tuple(state[k].shape), None) == config
    count = sum(p.numel() for p in prior.parameters())
    low, high = (3.55e9, 3.65e9) if config is M.PRIOR else (0.95e9, 1.1e9)  # the releases' "3.6B" and "1B"
    assert low < count < high, count


def test_effnet_is_efficientnet_v2_s_features_and_the_mapper():
    encoder = EfficientNetEncoder()
    state = encoder.state_dict()
    backbone = sum(p.numel() for p in encoder.backbone.parameters())
    assert backbone + 1280 * 1000 + 1000 == 21_458_488  # torchvision's efficientnet_v2_s num_params
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["backbone.0.0.weight"] == (24, 3, 3, 3) and shapes["backbone.7.0.weight"] == (1280, 256, 1, 1)
    assert shapes["backbone.1.1.block.0.0.weight"] == (24, 24, 3, 3)  # fused, no expansion: one conv
    assert shapes["backbone.2.0.block.1.0.weight"] == (48, 96, 1, 1)  # fused with expansion: conv then projection
    assert shapes["backbone.4.0.block.2.fc1.weight"] == (16, 256, 1, 1)  # MBConv: squeeze to in/4
    assert shapes["backbone.6.14.block.3.1.running_var"] == (256,) and "backbone.6.15.block.0.0.weight" not in state
    assert shapes["mapper.0.weight"] == (16, 1280, 1, 1) and "mapper.1.weight" not in state  # affine-free BN
    assert encoder.backbone[1][0].residual and not encoder.backbone[2][0].residual
    with torch.no_grad():
        assert encoder.eval().encode(torch.zeros(1, 3, 64, 96)).shape == (1, 16, 2, 3)


def branch_gdf(t: torch.Tensor):
    """The branch's GDF on drawn t: (a, b, noise_cond, P2 weight) (CosineSchedule clamp [1e-4, 0.9999], VPScaler,
    CosineTNoiseCond, P2LossWeight k = gamma = s = 1)."""
    s = torch.tensor([0.008])
    min_var = torch.cos(s / (1 + s) * torch.pi * 0.5) ** 2
    var = (torch.cos((s + t) / (1 + s) * torch.pi * 0.5).clamp(0, 1) ** 2 / min_var).clamp(0.0001, 0.9999)
    log_snr = (var / (1 - var)).log()
    a2 = log_snr.sigmoid()
    cond_var = log_snr.sigmoid().clamp(0, 1)
    cond = ((cond_var * min_var) ** 0.5).acos() / (torch.pi * 0.5) * (1 + s) - s
    return a2.sqrt(), (1 - a2).sqrt(), cond, (1 + log_snr.exp()) ** -1


def test_objective_is_the_branchs_gdf_and_diffusers_schedule(files):
    from diffusers import DDPMWuerstchenScheduler

    objective = FAMILY.training_objective(files["parts"], NoiseConfig(), LossConfig())
    latents = torch.randn(3, 16, 2, 3, generator=torch.Generator().manual_seed(3))
    ex = objective.example(latents, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)  # the draws in order: ε, then u
    noise = torch.randn(latents.shape, generator=g)
    t = (1 - torch.rand(3, generator=g)).add(0.001).clamp(0.001, 1.0)
    a, b, cond, p2 = branch_gdf(t)
    assert torch.equal(ex.noise, noise) and torch.equal(ex.target, noise)
    assert torch.allclose(ex.noisy, a.view(-1, 1, 1, 1) * latents + b.view(-1, 1, 1, 1) * noise, atol=1e-6)
    assert torch.allclose(ex.noisy, DDPMWuerstchenScheduler().add_noise(latents, noise, t), atol=1e-6)
    # OneTrainer's BaseWuerstchenSetup for Stable Cascade: t.add(0.001).clamp(0.001, 1) of its draw, its
    # __alpha_cumprod (the same cosine, clamped to [1e-4, 0.9999]), sqrt(ᾱ) x0 + sqrt(1 - ᾱ) ε, target ε
    s0 = torch.tensor([0.008])
    bar = (torch.cos((t + s0) / (1 + s0) * torch.pi * 0.5) ** 2 / torch.cos(s0 / (1 + s0) * torch.pi * 0.5) ** 2).clamp(
        0.0001, 0.9999
    )
    onetrainer = bar.sqrt().view(-1, 1, 1, 1) * latents + (1 - bar).sqrt().view(-1, 1, 1, 1) * noise
    assert torch.allclose(ex.noisy, onetrainer, atol=1e-6)
    assert torch.allclose(ex.timesteps, cond, atol=1e-5)
    pred = torch.randn(latents.shape, generator=g)
    loss = objective.loss_per_sample(pred, ex)
    assert torch.allclose(loss, ((pred - noise) ** 2).mean(dim=(1, 2, 3)) * p2, rtol=1e-5)
    edge = objective.example(latents, torch.Generator().manual_seed(4), timesteps=torch.tensor([0.001, 0.5, 1.0]))
    assert torch.allclose(edge.timesteps, branch_gdf(torch.tensor([0.001, 0.5, 1.0]))[2], atol=1e-5)
    assert not math.isclose(float(edge.timesteps[0]), 0.001, abs_tol=1e-4)  # ᾱ's clamp acts at t = 0.001
    assert FAMILY.objective_problems(NoiseConfig(min_timestep=10), LossConfig(min_snr_gamma=5.0), None) == [
        "--min_timestep is not supported for Stable Cascade: it bounds SD's integer timesteps (0-1000); drop it",
        "--min_snr_gamma is not supported for Stable Cascade: the loss already carries GDF's P2 weight 1 / (1 + SNR);"
        " drop it",
    ]


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "dataset.toml")


def command(f, toml, out, *extra, steps=2) -> list[str]:
    return ["--stage_c_checkpoint_path", str(f["stage_c"]), "--text_model_checkpoint_path", str(f["text_model"]),
            "--effnet_checkpoint_path", str(f["effnet"]), "--dataset_config", str(toml), "--output_dir", str(out),
            "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", "--cache_latents",
            "--cache_text_encoder_outputs", *extra]  # fmt: skip


def lora(f, toml, out, *extra, steps=2) -> list[str]:
    return command(f, toml, out, "--output_name", "sc", "--network_module", "networks.lora", "--network_dim", "4",
                   "--network_alpha", "2", "--network_train_unet_only", "--learning_rate", "1e-3", *extra, steps=steps)  # fmt: skip


def comfyui_merged(stability: dict, lora_sd: dict) -> dict:
    """ComfyUI's StableCascade_C load (``in_proj`` split into ``attn.to_q | to_k | to_v``) and its ``lora_unet_`` +
    key rule: W += alpha / rank · up @ down for every LoRA module."""
    state = {}
    for k, v in stability.items():
        if k.endswith(("in_proj_weight", "in_proj_bias")):
            kind = k.rsplit("_", 1)[1]
            for name, chunk in zip(("to_q", "to_k", "to_v"), v.chunk(3)):
                state[k.replace(f"in_proj_{kind}", f"{name}.{kind}")] = chunk.clone()
        else:
            state[k] = v.clone()
    by_name = {"lora_unet_" + k[: -len(".weight")].replace(".", "_"): k for k in state if k.endswith(".weight")}
    for module in {k.split(".")[0] for k in lora_sd}:
        up, down = lora_sd[f"{module}.lora_up.weight"].float(), lora_sd[f"{module}.lora_down.weight"].float()
        scale = float(lora_sd[f"{module}.alpha"]) / down.shape[0]
        key = by_name[module]
        delta = (up.flatten(1) @ down.flatten(1)).reshape(state[key].shape)
        state[key] = state[key] + scale * delta
    return state


def test_lora_is_comfyuis_and_resume_repeats_the_run(files, dataset_toml, tmp_path):
    from networks.inject import network_from_file

    full = stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path / "full", steps=4))
    first = stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path / "half", "--save_state",
                                                    "--save_every_n_steps", "2", steps=2))  # fmt: skip
    resumed = stable_cascade_train_c_network.run([*lora(files, dataset_toml, tmp_path / "half", steps=4), "--resume",
                                                  str(first.state)])  # fmt: skip
    assert resumed.losses == full.losses and first.losses == full.losses[:2]
    a, b = load_state_dict(full.output)[0], load_state_dict(resumed.output)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = read_metadata(full.output)
    assert meta["ss_base_model_version"] == "stable_cascade" and meta["modelspec.architecture"].endswith("/lora")

    for k in [k for k in a if k.endswith("lora_up.weight")]:
        a[k] = torch.randn_like(a[k]) * 0.05  # trained ups are tiny after 4 steps: make the comparison telling
    save_state_dict(a, tmp_path / "lora.safetensors", {}, None)
    base = load(files)
    stability = M.diffusers_to_stability(base.denoiser.state_dict())
    merged = comfyui_merged(stability, a)
    assert any(k.endswith("attention.attn.to_q.weight") for k in merged)
    unsplit = {k: v for k, v in merged.items()}  # back to Stability's names, then diffusers'
    for k in [k for k in unsplit if k.endswith("attn.to_q.weight") or k.endswith("attn.to_q.bias")]:
        kind = k.rsplit(".", 1)[1]
        parts = [unsplit.pop(k.replace("to_q", n)) for n in ("to_q", "to_k", "to_v")]
        unsplit[k.replace(f"to_q.{kind}", f"in_proj_{kind}")] = torch.cat(parts)
    comfy = copy.deepcopy(base.denoiser)
    comfy.load_state_dict(M.stability_to_diffusers(unsplit))
    network_from_file(tmp_path / "lora.safetensors", FAMILY.adapter_roots(base))  # injected into base.denoiser
    cond = FAMILY.encode_prompt(base, ["a red circle"])
    x = torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.6])
    with torch.no_grad():
        ours = FAMILY.predict(base.denoiser, x, t, cond)
        theirs = FAMILY.predict(comfy, x, t, cond)
        plain = FAMILY.predict(load(files).denoiser, x, t, cond)
    assert (ours - plain).abs().max() > 1e-3
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_refusals_are_clear(files, dataset_toml, tmp_path):
    with pytest.raises(ConfigError, match="--adaptive_loss_weight is not supported"):
        stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path, "--adaptive_loss_weight"))
    argv = lora(files, dataset_toml, tmp_path)
    at = argv.index("--effnet_checkpoint_path")
    with pytest.raises(ConfigError, match="--effnet_checkpoint_path is required for training"):
        stable_cascade_train_c_network.run(argv[:at] + argv[at + 2 :])
    with pytest.raises(ConfigError, match="--sample_prompts needs --previewer_checkpoint_path"):
        stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path, "--sample_prompts", str(dataset_toml)))
    with pytest.raises(ConfigError, match="--timestep_sampling logit_normal: Stable Cascade draws"):
        stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path, "--timestep_sampling", "logit_normal"))


def fixed_loss(parts, prior, dataset) -> float:
    return fixed_noise_loss(FAMILY, parts, prior, dataset)


def test_full_fine_tune_loss_falls_and_reads_back(files, dataset, dataset_toml, tmp_path):
    """The loss on the training images falls; the Stability-named file reads back exactly in diffusers' conversion
    and equals the diffusers folder of the same run; a trained text model is written beside the file."""
    from diffusers import StableCascadeUNet
    from diffusers.loaders.single_file_utils import convert_stable_cascade_unet_single_file_to_diffusers as convert

    base = command(files, dataset_toml, tmp_path, "--output_name", "ft", "--learning_rate", "1e-3", steps=10)
    single = stable_cascade_train_stage_c.run([*base, "--output_dir", str(tmp_path / "a"), "--save_model_as",
                                               "safetensors"])  # fmt: skip
    written = load_state_dict(single.output)[0]
    assert written.keys() == load_state_dict(files["stage_c"])[0].keys()
    assert detect_family(single.output) is FAMILY
    trained = FAMILY.load(single.output, options=FAMILY.options(effnet_checkpoint_path=str(files["effnet"]),
                                                                 text_model_checkpoint_path=str(files["text_model"])))  # fmt: skip
    before, after = (
        fixed_loss(load(files), load(files).denoiser, dataset),
        fixed_loss(trained, trained.denoiser, dataset),
    )
    assert after < 0.9 * before, (before, after)
    folder = stable_cascade_train_stage_c.run([*base, "--output_dir", str(tmp_path / "b"), "--save_model_as",
                                               "diffusers_safetensors"])  # fmt: skip
    theirs = StableCascadeUNet.from_pretrained(folder.output, subfolder="prior").state_dict()
    mine = convert(dict(written))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    argv = [w for w in base if w != "--cache_text_encoder_outputs"]
    with_te = stable_cascade_train_stage_c.run([*argv, "--output_dir", str(tmp_path / "c"), "--save_model_as",
                                                "safetensors", "--train_text_encoder", "--learning_rate_te1", "1e-4",
                                                "--max_train_steps", "2"])  # fmt: skip
    text_model = with_te.output.with_name(with_te.output.stem + "_text_model.safetensors")
    trained_te, original_te = load_state_dict(text_model)[0], load_state_dict(files["text_model"])[0]
    assert trained_te.keys() == original_te.keys()
    assert any(not torch.equal(trained_te[k], original_te[k]) for k in trained_te)


def tiny_decoder_folder(root):
    """A tiny diffusers StableCascadeDecoderPipeline folder (diffusers' own test sizes, stage B reading the 16-channel
    stage C latents)."""
    from diffusers import DDPMWuerstchenScheduler, StableCascadeDecoderPipeline, StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel

    from library.families.encoders import clip

    torch.manual_seed(0)
    res, attn = ["SDCascadeResBlock", "SDCascadeTimestepBlock"], ["SDCascadeResBlock", "SDCascadeTimestepBlock",
                                                                    "SDCascadeAttnBlock"]  # fmt: skip
    decoder = StableCascadeUNet(in_channels=4, out_channels=4, conditioning_dim=32, block_out_channels=[16, 32],
                                num_attention_heads=[-1, 2], down_num_layers_per_block=[1, 1],
                                up_num_layers_per_block=[1, 1], down_blocks_repeat_mappers=[1, 1],
                                up_blocks_repeat_mappers=[1, 1], block_types_per_layer=[res, attn], switch_level=None,
                                clip_text_pooled_in_channels=48, effnet_in_channels=16, dropout=[0.0, 0.0],
                                timestep_conditioning_type=["sca"], patch_size=2)  # fmt: skip
    encoder = clip.factory(dict(clip.TINY_COMMON, **clip.TINY_CLIP_G), with_projection=True)()
    pipe = StableCascadeDecoderPipeline(decoder=decoder, tokenizer=FAMILY.tiny.build().tokenizers[0],
                                        text_encoder=encoder, scheduler=DDPMWuerstchenScheduler(),
                                        vqgan=PaellaVQModel(bottleneck_blocks=1, num_vq_embeddings=2),
                                        latent_dim_scale=4.0)  # fmt: skip
    pipe.save_pretrained(root)
    return root


def test_stage_c_sampler_equals_the_prior_pipeline_and_gen_img_decodes(files, tmp_path):
    import stable_cascade_gen_img
    from library.families.stable_cascade.sampling import encode_pair, latent_shape, sample_stage_c

    parts = load(files)
    cond, uncond = encode_pair(FAMILY, parts, "a red circle", "blurry", 1)
    ours = sample_stage_c(FAMILY, parts.denoiser, cond, uncond, latent_shape(1, 96, 64), steps=3, guidance=4.0,
                          generator=torch.Generator().manual_seed(7))  # fmt: skip
    pipe = FAMILY.prior_pipeline(parts)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt_embeds=cond.hidden_states, prompt_embeds_pooled=cond.pooled.unsqueeze(1),
                  negative_prompt_embeds=uncond.hidden_states, negative_prompt_embeds_pooled=uncond.pooled.unsqueeze(1),
                  height=96, width=64, num_inference_steps=3, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(7), output_type="pt").image_embeddings  # fmt: skip
    assert ours.shape == theirs.shape == (1, 16, 3, 2)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()

    decoder = tiny_decoder_folder(tmp_path / "decoder")
    written = stable_cascade_gen_img.run(["--stage_c_checkpoint_path", str(files["stage_c"]),
                                          "--text_model_checkpoint_path", str(files["text_model"]), "--decoder",
                                          str(decoder), "--prompt", "a red circle", "--negative_prompt", "blurry",
                                          "--h", "96", "--w", "64", "--steps", "3", "--decoder_steps", "2", "--seed",
                                          "7", "--outdir", str(tmp_path / "out"), "--save_latents",
                                          "--device", "cpu"])  # fmt: skip
    latents = load_state_dict(written[0])[0]["stage_c_latents"]
    assert torch.equal(latents, ours)
    from PIL import Image

    assert Image.open(written[1]).size[1] > 0
    with pytest.raises(ValueError, match="generate with stable_cascade_gen_img.py --decoder"):
        FAMILY.pipeline(parts, None)  # what gen_img.py and the samples during training would ask
    with pytest.raises(ValueError, match="--stage_b_checkpoint_path: Stability's stage B / A single files"):
        stable_cascade_gen_img.run(["--stage_c_checkpoint_path", str(files["stage_c"]), "--prompt", "x",
                                    "--stage_b_checkpoint_path", str(files["stage_c"]), "--outdir", str(tmp_path)])  # fmt: skip


# The stable-cascade branch's ``Previewer`` (library/stable_cascade.py), re-typed: (index in ``blocks``, kind, in, out)
# at c_hidden 512; GELUs sit at the other indices.
BRANCH_PREVIEWER = [(0, "conv1", 16, 512), (2, "bn", 512, 512), (3, "conv3", 512, 512), (5, "bn", 512, 512),
                    (6, "up", 512, 256), (8, "bn", 256, 256), (9, "conv3", 256, 256), (11, "bn", 256, 256),
                    (12, "up", 256, 128), (14, "bn", 128, 128), (15, "conv3", 128, 128), (17, "bn", 128, 128),
                    (18, "up", 128, 128), (20, "bn", 128, 128), (21, "conv3", 128, 128), (23, "bn", 128, 128),
                    (24, "conv1", 128, 3)]  # fmt: skip


def test_previewer_has_the_branchs_state_dict():
    from library.families.stable_cascade.previewer import Previewer

    expected = {}
    for i, kind, c_in, c_out in BRANCH_PREVIEWER:
        if kind == "bn":
            expected |= {f"blocks.{i}.{n}": (c_out,) for n in ("weight", "bias", "running_mean", "running_var")}
            expected[f"blocks.{i}.num_batches_tracked"] = ()
            continue
        k = {"conv1": 1, "conv3": 3, "up": 2}[kind]
        weight = (c_in, c_out, k, k) if kind == "up" else (c_out, c_in, k, k)  # ConvTranspose2d: (in, out, k, k)
        expected |= {f"blocks.{i}.weight": weight, f"blocks.{i}.bias": (c_out,)}
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in Previewer().state_dict().items()}
    assert ours == expected


def test_samples_during_training_are_the_previewers_image(files, dataset_toml, tmp_path):
    import numpy as np
    from PIL import Image

    from library.families.stable_cascade.previewer import load_previewer, preview
    from library.families.stable_cascade.sampling import encode_pair, latent_shape, sample_stage_c
    from networks.inject import network_from_file

    previewer = files["previewer"]  # tiny.tiny_previewer_state: an image that follows the latents
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --n blurry --w 64 --h 96 --s 2 --l 4 --d 7\na blue square --w 64 --h 64 --s 2 "
                       "--l 1 --d 3\n")  # fmt: skip
    result = stable_cascade_train_c_network.run(lora(files, dataset_toml, tmp_path / "out", "--sample_prompts",
                                                     str(prompts), "--sample_every_n_steps", "1", "--sample_at_first",
                                                     "--previewer_checkpoint_path", str(previewer), steps=1))  # fmt: skip
    written = sorted(p.name for p in (tmp_path / "out" / "sample").glob("*.png") if "grid" not in p.name)
    assert len(written) == 4 and [n[:13] for n in written] == ["sc_000001_00_", "sc_000001_01_", "sc_e000000_00"[:13],
                                                                "sc_e000000_01"[:13]]  # fmt: skip
    parts, net = load(files), load_previewer(previewer)
    for label, (prompt, negative, h, w, scale, seed) in (("e000000", ("a red circle", "blurry", 96, 64, 4.0, 7)),
                                                         ("000001", ("a blue square", "", 64, 64, 1.0, 3))):  # fmt: skip
        if label == "000001":  # after the step: the trained LoRA, as saved at the end of this 1-step run
            network_from_file(result.output, FAMILY.adapter_roots(parts))
        index = "00" if label == "e000000" else "01"
        cond, uncond = encode_pair(FAMILY, parts, prompt, negative, 1)
        latents = sample_stage_c(FAMILY, parts.denoiser.eval(), cond, uncond, latent_shape(1, h, w), steps=2,
                                 guidance=scale, generator=torch.Generator().manual_seed(seed))  # fmt: skip
        expected = (preview(net, latents)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        (path,) = (tmp_path / "out" / "sample").glob(f"sc_{label}_{index}_*.png")
        image = np.asarray(Image.open(path))
        assert image.std() > 10  # the preview shows the latents (not a flat or clamped image)
        assert image.shape == (8 * latents.shape[2], 8 * latents.shape[3], 3)
        assert np.array_equal(image, expected), np.abs(image.astype(int) - expected).max()
        if label == "e000000":  # gen_img's preview of the same prompt and seed (base model) is that image too
            import stable_cascade_gen_img

            (shown,) = stable_cascade_gen_img.run(["--stage_c_checkpoint_path", str(files["stage_c"]),
                                                   "--text_model_checkpoint_path", str(files["text_model"]),
                                                   "--previewer_checkpoint_path", str(previewer), "--prompt", prompt,
                                                   "--negative_prompt", negative, "--h", str(h), "--w", str(w),
                                                   "--steps", "2", "--guidance_scale", str(scale), "--seed",
                                                   str(seed), "--outdir", str(tmp_path / "gen"), "--device", "cpu"])  # fmt: skip
            assert shown.name.endswith("_preview.png") and np.array_equal(np.asarray(Image.open(shown)), image)
