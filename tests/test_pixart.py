"""PixArt-α / PixArt-Σ (library/families/pixart/) on tiny models with the real module names.

Oracles: diffusers' conversion scripts (``scripts/convert_pixart_{alpha,sigma}_to_diffusers.py``: their key pairs,
re-typed below as they pop them, replayed on every key of a tiny official ``.pth``); diffusers' ``DDPMScheduler`` and
OneTrainer's ``_add_noise_discrete`` formula (sqrt ᾱ x0 + sqrt(1 − ᾱ) ε on the betas) and its prediction split
(``transformer(...).sample.chunk(2, dim=1)``, micro-conditions from the latents' size) on fixed draws; diffusers'
``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` at the same seed; ComfyUI's ``lora_unet_`` rule on the official
names; the uninterrupted run for ``--resume``; diffusers' own loader for the saved folder.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from _train_helpers import assert_comfyui_loads, write_dataset_toml

import pixart_train
import pixart_train_network
from library.cli.problems import ConfigError
from library.families import detect_family
from library.families.pixart import PIXART_ALPHA, PIXART_SIGMA
from library.families.pixart import keys as K
from library.files.weights import load_state_dict, read_metadata
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

FAMILIES = {"alpha": PIXART_ALPHA, "sigma": PIXART_SIGMA}


def script_conversion(state: dict, depth: int, micro: bool) -> dict:
    """diffusers' conversion scripts' pairs, popped from ``state`` as they pop them (``state`` must end empty but for
    ``pos_embed`` and ``y_embedder.y_embedding``, which they drop)."""
    out = {"pos_embed.proj.weight": state.pop("x_embedder.proj.weight"),
           "pos_embed.proj.bias": state.pop("x_embedder.proj.bias")}  # fmt: skip
    for n in (1, 2):
        for p in ("weight", "bias"):
            out[f"caption_projection.linear_{n}.{p}"] = state.pop(f"y_embedder.y_proj.fc{n}.{p}")
    embedders = [("timestep_embedder", "t_embedder")]
    if micro:
        embedders += [("resolution_embedder", "csize_embedder"), ("aspect_ratio_embedder", "ar_embedder")]
    for theirs, ours in embedders:
        for n, i in ((1, 0), (2, 2)):
            for p in ("weight", "bias"):
                out[f"adaln_single.emb.{theirs}.linear_{n}.{p}"] = state.pop(f"{ours}.mlp.{i}.{p}")
    for p in ("weight", "bias"):
        out[f"adaln_single.linear.{p}"] = state.pop(f"t_block.1.{p}")
    for d in range(depth):
        b, t = f"blocks.{d}.", f"transformer_blocks.{d}."
        out[t + "scale_shift_table"] = state.pop(b + "scale_shift_table")
        for p in ("weight", "bias"):
            q, k, v = torch.chunk(state.pop(f"{b}attn.qkv.{p}"), 3, dim=0)
            out.update({f"{t}attn1.to_q.{p}": q, f"{t}attn1.to_k.{p}": k, f"{t}attn1.to_v.{p}": v})
            out[f"{t}attn1.to_out.0.{p}"] = state.pop(f"{b}attn.proj.{p}")
            out[f"{t}ff.net.0.proj.{p}"] = state.pop(f"{b}mlp.fc1.{p}")
            out[f"{t}ff.net.2.{p}"] = state.pop(f"{b}mlp.fc2.{p}")
            out[f"{t}attn2.to_q.{p}"] = state.pop(f"{b}cross_attn.q_linear.{p}")
            k, v = torch.chunk(state.pop(f"{b}cross_attn.kv_linear.{p}"), 2, dim=0)
            out.update({f"{t}attn2.to_k.{p}": k, f"{t}attn2.to_v.{p}": v})
            out[f"{t}attn2.to_out.0.{p}"] = state.pop(f"{b}cross_attn.proj.{p}")
    for p in ("weight", "bias"):
        out[f"proj_out.{p}"] = state.pop(f"final_layer.linear.{p}")
    out["scale_shift_table"] = state.pop("final_layer.scale_shift_table")
    state.pop("y_embedder.y_embedding")
    state.pop("pos_embed")
    assert not state, sorted(state)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per variant: the tiny parts, the official .pth (a ``state_dict`` pickle as released) and --t5xxl / --vae."""
    root = tmp_path_factory.mktemp("pixart")
    made = {}
    for variant, family in FAMILIES.items():
        parts = family.tiny.build(seed=0)
        official = K.diffusers_to_official(parts.denoiser.state_dict(), extras=family.official_extras(parts))
        pth = root / f"{variant}.pth"
        torch.save({"state_dict": official}, pth)
        made[variant] = {"parts": parts, "pth": pth, **family.tiny.write_files(parts, root, variant)}
    return made


@pytest.mark.parametrize("variant", ["alpha", "sigma"])
def test_official_pth_reads_as_the_conversion_scripts_convert_it(files, variant):
    family, f = FAMILIES[variant], files[variant]
    official = torch.load(f["pth"], weights_only=True)["state_dict"]
    assert official[K.Y_EMBEDDING].shape == (120 if variant == "alpha" else 300, 32)
    expected = script_conversion(dict(official), 2, micro=variant == "alpha")
    ours = K.official_to_diffusers(official)
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)
    assert K.diffusers_to_official(ours, extras={k: official[k] for k in K.EXTRA}).keys() == official.keys()
    assert detect_family(f["pth"]) is family  # α / Σ from the weights (micro-conditions, the null caption's rows)
    loaded = family.load(f["pth"], vae=f["vae"], options=family.options(t5xxl=str(f["t5xxl"])))
    theirs = f["parts"].denoiser.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in loaded.denoiser.state_dict().items())
    assert loaded.denoiser.use_additional_conditions is (variant == "alpha")
    assert loaded.options.t5xxl_max_token_length == (120 if variant == "alpha" else 300)
    with pytest.raises(ValueError, match="is a pixart_"):
        FAMILIES["sigma" if variant == "alpha" else "alpha"].load(f["pth"], vae=f["vae"])
    with pytest.raises(ValueError, match=r"--t5xxl, --vae required: the single file .* holds the transformer only"):
        family.load(f["pth"])


def test_a_diffusers_single_file_reads_too(files, tmp_path):
    """A diffusers-named transformer file (no metadata, no null caption): α from its micro-condition embedders."""
    from safetensors.torch import save_file

    for variant, family in FAMILIES.items():
        f = files[variant]
        path = tmp_path / f"{variant}.safetensors"
        save_file({"transformer." + k: v.contiguous() for k, v in f["parts"].denoiser.state_dict().items()}, path)
        assert detect_family(path) is family
        loaded = family.load(path, vae=f["vae"], options=family.options(t5xxl=str(f["t5xxl"])))
        theirs = f["parts"].denoiser.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in loaded.denoiser.state_dict().items())


def test_objective_is_ddpm_epsilon_on_the_eps_half(files):
    """Fixed draws: the noisy input equals DDPMScheduler's add_noise and OneTrainer's formula on the linear betas; the
    target is ε; the prediction is the ε half of the 8 channels with α's micro-conditions of the latents' size; at
    --vb_loss_strength 0 the loss is the ε loss alone."""
    from diffusers import DDPMScheduler

    parts = files["alpha"]["parts"]
    eps_only = dataclasses.replace(parts, options=PIXART_ALPHA.options(vb_loss_strength=0.0))
    objective = PIXART_ALPHA.training_objective(eps_only, NoiseConfig(), LossConfig())
    latents = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(3))
    ex = objective.example(latents, torch.Generator().manual_seed(4))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear")
    assert torch.allclose(ex.noisy, scheduler.add_noise(latents, ex.noise, ex.timesteps), atol=1e-6)
    bar = torch.cumprod(1 - torch.linspace(0.0001, 0.02, 1000, dtype=torch.float64), 0)[ex.timesteps]
    onetrainer = bar.sqrt()[:, None, None, None] * latents + (1 - bar).sqrt()[:, None, None, None] * ex.noise
    assert torch.allclose(ex.noisy, onetrainer.float(), atol=1e-6) and torch.equal(ex.target, ex.noise)

    cond = PIXART_ALPHA.encode_prompt(parts, ["a cat", "a red circle on white"])
    size = torch.tensor([[64.0, 96.0]] * 2)
    eps, var = parts.denoiser(ex.noisy, encoder_hidden_states=cond.hidden_states, encoder_attention_mask=cond.mask,
                              timestep=ex.timesteps, added_cond_kwargs={"resolution": size,
                                                                         "aspect_ratio": size[:, :1] / size[:, 1:]},
                              ).sample.chunk(2, dim=1)  # fmt: skip
    pred = PIXART_ALPHA.predict(parts.denoiser, ex.noisy, ex.timesteps, cond, **objective.predict_options)
    assert torch.equal(pred, eps) and var.abs().sum() > 0
    loss = objective.loss_per_sample(objective.prediction(pred, ex), ex)
    assert torch.allclose(loss, ((eps - ex.noise) ** 2).mean(dim=(1, 2, 3)), atol=1e-6)
    assert PIXART_ALPHA.objective_problems(NoiseConfig(), LossConfig(v_parameterization=True), None)


def test_the_variational_bound_trains_the_variance_half_only():
    """--vb_loss_strength (default 1): ε loss + the bound, whose reverse-step mean and learned-range log variance are
    diffusers' DDPMScheduler's (``step`` from ε, ``variance_type="learned_range"``), its KL the Gaussian one, its
    t = 0 term the 1/255-bin likelihood (exact normal CDF here); the bound's gradient reaches the variance half only."""
    from diffusers import DDPMScheduler

    from library.families.pixart.vb_loss import Coefficients, vb_terms

    parts = FAMILIES["alpha"].tiny.build(seed=0)
    objective = PIXART_ALPHA.training_objective(parts, NoiseConfig(), LossConfig())
    assert objective.predict_options == {"with_variance": True} and objective.vb_strength == 1.0
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(3, 4, 6, 6, generator=g).clamp(-1, 1)
    ex = objective.example(x0, g, timesteps=torch.tensor([0, 7, 640]))
    eps, var_values = torch.randn(3, 4, 6, 6, generator=g), torch.rand(3, 4, 6, 6, generator=g) * 2 - 1
    ours = vb_terms(Coefficients.of(objective.schedule), x0, ex.noisy, ex.timesteps, eps, var_values)

    def mean_and_log_var(scheduler, eps_, i, t):  # the step's mean: its sample minus its own noise draw
        learned = scheduler.config.variance_type == "learned_range"
        output = torch.cat([eps_[i : i + 1], var_values[i : i + 1]], dim=1) if learned else eps_[i : i + 1]
        out = scheduler.step(output, t, ex.noisy[i : i + 1], generator=torch.Generator().manual_seed(9))
        variance = scheduler._get_variance(t, var_values[i : i + 1] if learned else None)
        log_var = variance if learned else torch.log(variance)
        noise = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(9))
        return out.prev_sample - torch.exp(0.5 * log_var) * noise, log_var

    config = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", clip_sample=False)
    learned, fixed = DDPMScheduler(**config, variance_type="learned_range"), DDPMScheduler(**config)
    learned.set_timesteps(1000), fixed.set_timesteps(1000)
    for i, t in ((1, 7), (2, 640)):
        mean, log_var = mean_and_log_var(learned, eps, i, t)
        true_mean, true_log_var = mean_and_log_var(fixed, ex.noise, i, t)
        kl = 0.5 * (-1 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                    + (true_mean - mean) ** 2 * torch.exp(-log_var)) / math.log(2)  # fmt: skip
        torch.testing.assert_close(ours[i : i + 1], kl, rtol=2e-4, atol=2e-5)
    c = Coefficients.of(objective.schedule)  # t = 0: the decoder's likelihood of x0 under N(mean, σ²)
    mean = c.posterior_mean_x0[0] * (ex.noisy[0] / c.alphas_cumprod[0].sqrt()
                                     - (1 / c.alphas_cumprod[0] - 1).sqrt() * eps[0]) + c.posterior_mean_xt[0] * ex.noisy[0]  # fmt: skip
    log_var = (var_values[0] + 1) / 2 * c.betas[0].log() + (1 - var_values[0]) / 2 * c.log_posterior_variance[0]
    normal = torch.distributions.Normal(mean.double(), torch.exp(0.5 * log_var).double())
    upper = torch.where(x0[0] > 0.999, torch.ones_like(mean.double()), normal.cdf(x0[0].double() + 1 / 255))
    lower = torch.where(x0[0] < -0.999, torch.zeros_like(mean.double()), normal.cdf(x0[0].double() - 1 / 255))
    p = upper - lower  # the tanh approximation of the CDF holds away from the far tails
    kept = p > 1e-4
    assert kept.sum() > p.numel() // 2
    torch.testing.assert_close(ours[0].double()[kept], -torch.log(p[kept]) / math.log(2), rtol=5e-2, atol=2e-2)

    pred = torch.cat([eps, var_values], dim=1).requires_grad_()
    total = objective.loss_per_sample(pred, ex)
    eps_only = ((eps - ex.noise) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(total, eps_only + ours.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(total.sum(), pred)
    torch.testing.assert_close(grad[:, :4], 2 * (eps - ex.noise) / eps[0].numel())  # the ε loss's gradient alone
    assert grad[:, 4:].abs().sum() > 0


@pytest.mark.parametrize("variant", ["alpha", "sigma"])
def test_sampling_equals_the_diffusers_pipeline(files, variant):
    from library.sampling.generate import generate
    from library.sampling.prompts import PromptSpec
    from library.sampling.schedulers import make_scheduler

    family, parts = FAMILIES[variant], files[variant]["parts"]
    spec = PromptSpec("a red circle", "blurry", width=64, height=48, seeds=(7,), scale=4.5, steps=3, sampler="ddim")
    scheduler = make_scheduler("ddim", parts.scheduler_config)
    ours = np.asarray(generate(family, parts, spec, scheduler=scheduler))
    pipe = family.pipeline(parts, type(scheduler).from_config(scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", height=48, width=64, num_inference_steps=3,
                  guidance_scale=4.5, generator=torch.Generator().manual_seed(7), use_resolution_binning=False,
                  clean_caption=False, output_type="np").images[0]  # fmt: skip
    assert ours.shape == (48, 64, 3)
    assert np.abs(ours.astype(int) - (theirs * 255).round().astype(int)).max() <= 1


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "dataset.toml")


def lora_command(f, toml, out, *extra, steps=2) -> list[str]:
    return ["--pretrained_model_name_or_path", str(f["pth"]), "--t5xxl", str(f["t5xxl"]), "--vae", str(f["vae"]),
            "--dataset_config", str(toml), "--output_dir", str(out), "--output_name", "px", "--network_module",
            "networks.lora", "--network_dim", "4", "--network_train_unet_only", "--learning_rate", "1e-3",
            "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", "--cache_latents",
            "--cache_text_encoder_outputs", *extra]  # fmt: skip


def test_lora_names_are_comfyuis_and_resume_repeats_the_run(files, dataset_toml, tmp_path):
    f = files["sigma"]
    full = pixart_train_network.run(lora_command(f, dataset_toml, tmp_path / "full", steps=4))
    first = pixart_train_network.run(lora_command(f, dataset_toml, tmp_path / "half", "--save_state",
                                                  "--save_every_n_steps", "2", steps=2))  # fmt: skip
    resumed = pixart_train_network.run([*lora_command(f, dataset_toml, tmp_path / "half", steps=4), "--resume",
                                        str(first.state)])  # fmt: skip
    assert resumed.losses == full.losses and first.losses == full.losses[:2]
    a, b = load_state_dict(full.output)[0], load_state_dict(resumed.output)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    official = torch.load(f["pth"], weights_only=True)["state_dict"]
    assert_comfyui_loads(str(full.output), {k: tuple(v.shape) for k, v in official.items()}, names="PixArt",
                         fused="attn_qkv")  # fmt: skip
    assert any("cross_attn_kv_linear" in k for k in a)
    meta = read_metadata(full.output)
    assert meta["ss_base_model_version"] == "pixart_sigma" and meta["modelspec.architecture"] == "pixart-sigma/lora"


def test_training_t5_is_refused_with_its_memory(files, dataset_toml, tmp_path):
    argv = [w for w in lora_command(files["sigma"], dataset_toml, tmp_path) if w not in ("--network_train_unet_only",
                                                                                          "--cache_text_encoder_outputs")]  # fmt: skip
    with pytest.raises(ConfigError, match=r"training T5-XXL is not supported for PixArt: its weights \(8.9 GiB"):
        pixart_train_network.run(argv)


def test_full_fine_tune_loss_falls_and_both_layouts_read_back(files, dataset_toml, tmp_path):
    """The single file ComfyUI reads (official names, pos_embed, the null caption) and the diffusers folder hold the
    trained transformer; the held-out loss falls."""
    from diffusers import PixArtTransformer2DModel

    f = files["alpha"]
    base = ["--pretrained_model_name_or_path", str(f["pth"]), "--t5xxl", str(f["t5xxl"]), "--vae", str(f["vae"]),
            "--dataset_config", str(dataset_toml), "--output_name", "ft", "--learning_rate", "2e-3",
            "--max_train_steps", "10", "--max_data_loader_n_workers", "0", "--seed", "1", "--cache_latents",
            "--cache_text_encoder_outputs", "--validation_split", "0.25", "--validate_every_n_steps", "5"]  # fmt: skip
    single = pixart_train.run([*base, "--output_dir", str(tmp_path / "a"), "--save_model_as", "safetensors"])
    values = [v for _, v in single.validation]
    assert len(values) == 2 and values[-1] < values[0], values
    written = load_state_dict(single.output)[0]
    official = torch.load(f["pth"], weights_only=True)["state_dict"]
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in official.items()}
    assert torch.equal(written[K.Y_EMBEDDING], official[K.Y_EMBEDDING])
    assert detect_family(single.output) is PIXART_ALPHA
    folder = pixart_train.run([*base, "--output_dir", str(tmp_path / "b"), "--save_model_as", "diffusers_safetensors"])
    theirs = PixArtTransformer2DModel.from_pretrained(folder.output, subfolder="transformer").state_dict()
    mine = K.official_to_diffusers(written)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine) and mine.keys() == theirs.keys()
