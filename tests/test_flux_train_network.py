"""flux_train_network.py end to end on tiny FLUX.1-dev / Chroma files: sd-scripts' docs/flux_train_network.md
command lines run (BFL single files with --clip_l --t5xxl --ae, and a diffusers folder), every saved module maps to
a BFL key of the right shape by ComfyUI's rule, the metadata names the family, the held-out loss falls,
--guidance_scale reaches the step, --model_type is checked against the weights, and --save_state + --resume
equals an uninterrupted run."""

from __future__ import annotations

import math

import pytest
import torch
from _train_helpers import assert_comfyui_loads, write_dataset_toml

import flux_train_network
from library.cli.problems import ConfigError
from library.families import get_family
from library.families.flux.keys import diffusers_to_bfl
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.files.weights import load_state_dict, read_metadata


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{variant: {"model", "clip_l", "t5xxl", "ae": BFL / transformers files, "folder": diffusers folder}}."""
    root, out = tmp_path_factory.mktemp("flux_models"), {}
    for variant in ("flux-dev", "chroma"):
        parts = build_tiny_flux(variant, seed=0)
        files = {k: str(v) for k, v in write_tiny_files(parts, root / f"{variant}_files").items()}
        files["folder"] = str(get_family(variant).save(parts, root / variant))
        out[variant] = files
    return out


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "my_flux_dataset_config.toml")


def doc_command(files: dict, toml, out, layout: str) -> list[str]:
    """sd-scripts' docs/flux_train_network.md basic example, with the tiny files for its paths. Changed, and why:
    --max_train_epochs 1 (2 steps) and --blocks_to_swap 0 (the tiny transformer has 2 + 2 blocks; each list keeps
    2 on the device). CLIP-L's adapters train over the T5 cache (--cache_text_encoder_outputs without
    --network_train_unet_only), as in sd-scripts."""
    model = ([f"--pretrained_model_name_or_path={files['model']}", f"--clip_l={files['clip_l']}",
              f"--t5xxl={files['t5xxl']}", f"--ae={files['ae']}"] if layout == "bfl"
             else [f"--pretrained_model_name_or_path={files['folder']}"])  # fmt: skip
    return [
        *model, f"--dataset_config={toml}", f"--output_dir={out}", "--output_name=my_flux_lora",
        "--save_model_as=safetensors", "--network_module=networks.lora_flux", "--network_dim=16", "--network_alpha=1",
        "--learning_rate=1e-4", "--optimizer_type=AdamW8bit", "--lr_scheduler=constant", "--sdpa",
        "--max_train_epochs=1", "--save_every_n_epochs=1", "--mixed_precision=fp16", "--gradient_checkpointing",
        "--guidance_scale=1.0", "--timestep_sampling=flux_shift", "--model_prediction_type=raw",
        "--blocks_to_swap=0", "--cache_text_encoder_outputs", "--cache_latents",
        "--max_data_loader_n_workers", "0", "--seed", "1",
    ]  # fmt: skip


def bfl_shapes(folder: str) -> dict[str, tuple]:
    """BFL transformer key -> shape, from the diffusers folder's transformer (converted to BFL names)."""
    sd, _ = load_state_dict(f"{folder}/transformer/diffusion_pytorch_model.safetensors")
    return {k: tuple(v.shape) for k, v in diffusers_to_bfl(sd).items()}


@pytest.mark.parametrize("layout", ["bfl", "folder"])
def test_docs_command_line_runs(models, dataset_toml, tmp_path, layout, monkeypatch):
    """The docs' example trains 2 steps; FLUX.1-dev's transformer gets --guidance_scale 1.0 as its embedded guidance
    in every step; the file maps to the BFL keys, CLIP-L's adapters included; the metadata names FLUX.1-dev."""
    from diffusers import FluxTransformer2DModel

    seen, forward = [], FluxTransformer2DModel.forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs["guidance"].detach().clone())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(FluxTransformer2DModel, "forward", spy)
    files = models["flux-dev"]
    result = flux_train_network.run(doc_command(files, dataset_toml, tmp_path, layout))
    assert len(seen) == 2 and all(torch.equal(g, torch.full_like(g, 1.0)) for g in seen)
    assert result.steps == 2 and result.failed is None and all(map(math.isfinite, result.losses))
    assert_comfyui_loads(str(result.output), bfl_shapes(files["folder"]), te_prefixes=("lora_te1_",), names="BFL")
    meta = read_metadata(result.output)
    assert meta["ss_base_model_version"] == "flux1"
    assert meta["modelspec.architecture"] == "flux-1-dev/lora"
    assert "modelspec.prediction_type" not in meta  # a velocity is neither of the spec's epsilon / v (as sd-scripts)
    assert (meta["ss_timestep_sampling"], meta["ss_model_prediction_type"]) == ("flux_shift", "raw")
    assert (meta["ss_model_type"], meta["ss_guidance_scale"], meta["ss_apply_t5_attn_mask"]) == ("flux", "1.0", "False")


def base_argv(files, dataset, out, *extra, steps=2):
    """A short run's command line; ``files``: "model" and, for a BFL file, "t5xxl" and "ae"."""
    parts = [f for flag in ("t5xxl", "ae") if flag in files for f in (f"--{flag}", files[flag])]
    return [
        "--pretrained_model_name_or_path", files["model"], *parts,
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(out), "--output_name", "t", "--network_module", "networks.lora", "--network_dim", "4",
        "--network_alpha", "4", "--train_batch_size", "2", "--max_train_steps", str(steps),
        "--max_data_loader_n_workers", "0", "--seed", "1", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
        "--model_prediction_type", "raw", *extra,
    ]  # fmt: skip


def test_chroma_trains_with_the_docs_flags(models, dataset, tmp_path):
    """docs: --model_type chroma, no --clip_l, --guidance_scale 0, --timestep_sampling sigmoid, --apply_t5_attn_mask;
    and the docs' Chroma sample prompt (negative prompt, --l 4.0 true CFG, --g 0) sampled during training."""
    files = models["chroma"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Japanese shrine in the summer forest. --n low quality, ugly, unfinished, out of focus --w 64 "
                       "--h 64 --d 1 --l 4.0 --g 0.0 --s 2\n")  # fmt: skip
    argv = base_argv(files, dataset, tmp_path, "--model_type=chroma", "--guidance_scale=0.0",
                     "--timestep_sampling=sigmoid", "--apply_t5_attn_mask", "--sample_prompts", str(prompts),
                     "--sample_every_n_steps", "2")  # fmt: skip
    result = flux_train_network.run(argv)
    assert result.steps == 2 and all(map(math.isfinite, result.losses))
    assert len([p for p in (tmp_path / "sample").glob("t_000002_00_*.png")]) == 1
    assert_comfyui_loads(str(result.output), bfl_shapes(files["folder"]), names="BFL")
    meta = read_metadata(result.output)
    assert meta["ss_base_model_version"] == "chroma" and meta["modelspec.architecture"] == "chroma/lora"
    assert (meta["ss_model_type"], meta["ss_guidance_scale"], meta["ss_apply_t5_attn_mask"]) == (
        "chroma",
        "0.0",
        "True",
    )


@pytest.mark.parametrize("variant,flags,needle", [
    ("chroma", ["--apply_t5_attn_mask"], "--model_type flux"),  # a Chroma file with the default --model_type
    ("flux-dev", ["--model_type", "chroma", "--apply_t5_attn_mask"], "--model_type chroma"),
    ("chroma", ["--model_type", "chroma"], "--apply_t5_attn_mask"),
    ("flux-dev", ["--split_mode"], "--split_mode is not supported"),
])  # fmt: skip
def test_bad_model_flags_are_refused_before_training(models, dataset, tmp_path, variant, flags, needle):
    files = models[variant]
    extra = ["--clip_l", files["clip_l"]] if "clip_l" in files else []
    with pytest.raises(ConfigError, match=needle):
        flux_train_network.run(base_argv(files, dataset, tmp_path, *extra, *flags))


def test_loss_falls_and_resume_equals_an_uninterrupted_run(models, dataset, tmp_path):
    """10 steps: the held-out flow loss falls; 5 steps + --save_state, then --resume to 10, gives the same weights."""
    files = models["flux-dev"]
    common = ["--clip_l", files["clip_l"], "--network_train_unet_only", "--validation_split", "0.25",
              "--validate_every_n_steps", "5", "--learning_rate", "1e-2"]  # fmt: skip
    full = flux_train_network.run(base_argv(files, dataset, tmp_path / "full", *common, steps=10))
    values = [v for _, v in full.validation]
    assert len(values) == 2 and values[-1] < 0.97 * values[0]  # measured: 1.47 -> 1.28
    first = base_argv(files, dataset, tmp_path / "a", *common, "--save_every_n_steps", "5", "--save_state", steps=10)
    half = [*first[: first.index("--max_train_steps") + 1], "5", *first[first.index("--max_train_steps") + 2 :]]
    flux_train_network.run(half)
    resumed = flux_train_network.run([*first, "--resume", str(tmp_path / "a" / "t-state")])
    (a, _), (b, _) = load_state_dict(full.output), load_state_dict(resumed.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_demo_trains_a_tiny_flux_lora(tmp_path, capsys):
    """``flux_train_network.py --demo``: a tiny FLUX.1-dev folder and the example images, made offline; the file
    loads back and changes the transformer's output."""
    result = flux_train_network.run(["--demo", "--demo_dir", str(tmp_path), "--max_train_steps", "2"])
    assert result.steps == 2 and result.output.exists() and not result.failed
    assert (tmp_path / "models" / "flux-dev" / "model_index.json").exists()
    assert read_metadata(result.output)["ss_base_model_version"] == "flux1"
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("demo: the adapter is at"))
    assert "sdtrain loads it" in line and "changes the transformer output" in line


def test_fp8_base_stores_every_flux_linear_and_trains(models, dataset, tmp_path):
    """--fp8_base: every transformer Linear in float8, the adaLN modulations (``norm1.linear``...) too, as sd-scripts'
    ``model.to(float8_e4m3fn)``; T5's ``wo`` stays (transformers keeps it); a bf16 step runs and is finite."""
    from types import SimpleNamespace

    from library.device.fp8 import stored_in_fp8
    from library.run.setup import store_frozen_in_fp8

    parts = build_tiny_flux("flux-dev")
    run = SimpleNamespace(
        fp8_base=True, fp8_base_unet=False, fp8_scaled=False, weight_dtype=torch.bfloat16, train_dtype=torch.float32
    )
    store_frozen_in_fp8(SimpleNamespace(run=run, trained_parts=(), family=get_family("flux-dev")), parts)
    linears = [(n, m) for n, m in parts.denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    assert any("norm" in n for n, _ in linears) and all(stored_in_fp8(m) for _, m in linears)
    t5 = [(n, m) for n, m in parts.text_encoders[-1].named_modules() if isinstance(m, torch.nn.Linear)]
    assert all(stored_in_fp8(m) != n.endswith(".wo") for n, m in t5)
    files = models["flux-dev"]
    argv = base_argv(files, dataset, tmp_path, "--clip_l", files["clip_l"], "--fp8_base", "--mixed_precision", "bf16",
                     "--network_train_unet_only", steps=1)  # fmt: skip
    result = flux_train_network.run(argv)
    assert result.steps == 1 and all(map(math.isfinite, result.losses))
    scaled = flux_train_network.run([*argv, "--fp8_scaled", "--output_dir", str(tmp_path / "scaled")])  # musubi's flag
    assert scaled.steps == 1 and all(map(math.isfinite, scaled.losses)) and scaled.losses != result.losses


def test_blocks_to_swap_swaps_the_flux_transformer_and_trains_the_same(dataset, tmp_path, monkeypatch):
    """--blocks_to_swap 2 on a tiny FLUX.1-dev with 3 double and 4 single blocks: the run places the transformer with
    a BlockSwap of 1 double + 2 single blocks (sd-scripts' split), and on the CPU its losses equal a run without."""
    from diffusers import FluxTransformer2DModel

    from library.families.flux.tiny import TRANSFORMER
    from library.run import setup as run_setup
    from library.run.block_swap import BlockSwap

    parts = build_tiny_flux("flux-dev")
    torch.manual_seed(0)
    config = {**TRANSFORMER, "num_layers": 3, "num_single_layers": 4}
    parts.denoiser = FluxTransformer2DModel(**config, pooled_projection_dim=32, guidance_embeds=True).eval()
    folder = str(get_family("flux-dev").save(parts, tmp_path / "model"))
    swaps, place = [], run_setup.place_denoiser

    def spy(*args, **kwargs):
        swaps.append(place(*args, **kwargs))
        return swaps[-1]

    monkeypatch.setattr(run_setup, "place_denoiser", spy)
    argv = base_argv({"model": folder}, dataset, tmp_path, "--network_train_unet_only")
    plain = flux_train_network.run([*argv, "--output_name", "plain"])
    swapped = flux_train_network.run([*argv, "--output_name", "swapped", "--blocks_to_swap", "2"])
    assert swaps[0] is None and isinstance(swaps[1], BlockSwap)
    assert list(swaps[1].counts) == [1, 2] and swaps[1].moves_in > 0
    assert plain.losses == swapped.losses and len(plain.losses) == 2


def test_clip_l_adapters_train_over_the_t5_cache_as_without_it(models, dataset, tmp_path):
    """sd-scripts' partial cache: --cache_text_encoder_outputs while CLIP-L's adapters train caches T5 and runs CLIP-L
    in every step; the losses and the trained CLIP-L adapters equal those of the run that encodes every step."""
    files = models["flux-dev"]
    argv = base_argv(files, dataset, tmp_path, "--clip_l", files["clip_l"], "--learning_rate", "1e-2", steps=3)
    cached = flux_train_network.run([*argv, "--cache_text_encoder_outputs", "--output_name", "cached"])
    live = flux_train_network.run([*argv, "--output_name", "live"])
    torch.testing.assert_close(cached.losses, live.losses, rtol=1e-4, atol=1e-6)
    (a, _), (b, _) = load_state_dict(cached.output), load_state_dict(live.output)
    te = [k for k in a if k.startswith("lora_te1_") and k.endswith("lora_up.weight")]
    assert te and any(a[k].abs().max() > 0 for k in te)  # CLIP-L's adapters trained (they start at zero)
    for k in te:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-6)


def test_a_sample_size_the_model_cannot_take_stops_before_training(models, dataset, tmp_path, monkeypatch):
    """--w 72 passes the prompt file's own check (multiples of 8) but FLUX needs multiples of 16: refused once the
    model is loaded and before the first step (every sampling round logged "skipped" before)."""
    import train_network
    from library.cli.problems import ConfigError

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog --w 64 --h 64\na cat --w 72 --h 64\n")
    monkeypatch.setattr(train_network, "train", lambda *a, **k: pytest.fail("training started"))
    files = models["flux-dev"]
    argv = base_argv(files, dataset, tmp_path, "--clip_l", files["clip_l"], "--sample_prompts", str(prompts),
                     "--sample_every_n_steps", "1")  # fmt: skip
    with pytest.raises(ConfigError, match=r"prompt 2: --w 72 is not a multiple of 16.*try 64"):
        flux_train_network.run(argv)


def test_another_familys_network_module_is_refused_naming_the_right_one(
    models, dataset, tiny_dir, tmp_path, monkeypatch
):
    """networks.lora_sd3 on a FLUX model trained silently (its context_attn_dim did nothing, the metadata named it);
    networks.lora_flux on SD1 failed only by accident ("index 0 is outside this model's 0 blocks")."""
    import train_network
    from library.cli.problems import ConfigError

    monkeypatch.setattr(train_network, "train", lambda *a, **k: pytest.fail("training started"))
    files = models["flux-dev"]
    argv = base_argv(files, dataset, tmp_path, "--clip_l", files["clip_l"], "--network_module", "networks.lora_sd3",
                     "--network_args", "context_attn_dim=8")  # fmt: skip
    with pytest.raises(ConfigError, match=r"networks.lora_sd3 is the network module of SD3.* use networks.lora_flux"):
        flux_train_network.run(argv)
    sd1 = ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir", str(dataset),
           "--output_dir", str(tmp_path), "--network_module", "networks.lora_flux"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"networks.lora_flux is the network module of FLUX.*this model is SD1"):
        train_network.run(sd1)
