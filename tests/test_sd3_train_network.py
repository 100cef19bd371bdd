"""sd3_train_network.py end to end on tiny SD3 / SD3.5 files: sd-scripts' docs/sd3_train_network.md command line runs
unchanged but for tiny paths and one epoch (the SAI file with --clip_l --clip_g --t5xxl, the SAI file with its
encoders inside, a diffusers folder; --blocks_to_swap=32 on the tiny 34-block SD3.5-large), every saved module maps
to an SAI key of the right shape by ComfyUI's rule, the metadata names the variant, the held-out loss falls,
--save_state + --resume equals an uninterrupted run, and the text-encoder cache on disk holds SD3's three encoders'
outputs under a key of the prompt settings."""

from __future__ import annotations

import math

import pytest
import torch
from _train_helpers import assert_comfyui_loads, write_dataset_toml
from safetensors.torch import load_file, save_file

import sd3_train_network
from library.cli.problems import ConfigError
from library.families.sd3.keys import diffusers_to_sai
from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files
from library.files.weights import load_state_dict, read_metadata

ARCH = {"sd3": "stable-diffusion-3-medium", "sd3.5-medium": "stable-diffusion-3-5-medium",
        "sd3.5-large": "stable-diffusion-3-5-large"}  # fmt: skip

FUSED_QKV = "joint_blocks_0_x_block_attn_qkv"  # the fused q|k|v: one kohya module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(variant)``: {"model": SAI file with its encoders, "bare": SAI file without them, "clip_l" "clip_g"
    "t5xxl" "vae": the separate files, "diffusers": a diffusers folder, "shapes": SAI key -> shape}, written once per
    variant when first asked for."""
    root, made = tmp_path_factory.mktemp("sd3_models"), {}

    def get(variant: str) -> dict:
        if variant not in made:
            parts = build_tiny_sd3(variant, seed=0)
            files = {k: str(v) for k, v in write_tiny_files(parts, root / variant).items()}
            full = load_file(files["model"])  # the SAI file without its encoders: the same keys less text_encoders.*
            files["bare"] = str(root / variant / "bare.safetensors")
            save_file({k: v for k, v in full.items() if not k.startswith("text_encoders.")}, files["bare"])
            files["shapes"] = {k: tuple(v.shape) for k, v in diffusers_to_sai(parts.denoiser.state_dict()).items()}
            made[variant] = files
        return made[variant]

    return get


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "my_sd3_dataset_config.toml")


def doc_command(files: dict, toml, out, layout: str, blocks_to_swap: int = 32) -> list[str]:
    """sd-scripts' docs/sd3_train_network.md example with the tiny files for its paths. Changed, and why:
    --max_train_epochs=1 (2 steps), --max_data_loader_n_workers 0 and --seed 1 (a test); ``blocks_to_swap`` 0 on
    the 2-block tiny models (swapping keeps 2 blocks on the device). ``layout``: "separate" (the SAI file without
    encoders and the docs' --clip_l --clip_g --t5xxl), "embedded" (the SAI file with them: the docs say to skip the
    three flags then), "diffusers" (a folder)."""
    model = {
        "separate": [f"--pretrained_model_name_or_path={files['bare']}", f"--clip_l={files['clip_l']}",
                     f"--clip_g={files['clip_g']}", f"--t5xxl={files['t5xxl']}"],
        "embedded": [f"--pretrained_model_name_or_path={files['model']}"],
        "diffusers": [f"--pretrained_model_name_or_path={files['diffusers']}"],
    }[layout]  # fmt: skip
    return [
        *model, f"--dataset_config={toml}", f"--output_dir={out}", "--output_name=my_sd3_lora",
        "--save_model_as=safetensors", "--network_module=networks.lora", "--network_dim=16", "--network_alpha=1",
        "--learning_rate=1e-4", "--optimizer_type=AdamW8bit", "--lr_scheduler=constant", "--sdpa",
        "--max_train_epochs=1", "--save_every_n_epochs=1", "--mixed_precision=fp16", "--gradient_checkpointing",
        "--weighting_scheme=uniform", f"--blocks_to_swap={blocks_to_swap}",
        "--max_data_loader_n_workers", "0", "--seed", "1",
    ]  # fmt: skip


@pytest.mark.parametrize("layout,variant", [("separate", "sd3.5-large"), ("embedded", "sd3"),
                                            ("diffusers", "sd3.5-medium")])  # fmt: skip
def test_docs_command_line_runs(models, dataset_toml, tmp_path, layout, variant):
    """The docs' example trains 2 steps: as written (--blocks_to_swap=32) on the tiny SD3.5-large (34 blocks) from
    the SAI file and --clip_l --clip_g --t5xxl; on SD3 medium from the SAI file with its encoders; on SD3.5-medium
    from a diffusers folder. CLIP-L's and CLIP-G's adapters train with the transformer's (sd-scripts trains CLIP
    unless --network_train_unet_only, never T5 by default); the file names SAI modules; the metadata names the
    variant read from the weights and carries sd-scripts' SD3 keys."""
    files = models(variant)
    argv = doc_command(files, dataset_toml, tmp_path, layout, 32 if variant == "sd3.5-large" else 0)
    result = sd3_train_network.run(argv)
    assert result.steps == 2 and result.failed is None and all(map(math.isfinite, result.losses))
    assert_comfyui_loads(
        str(result.output), files["shapes"], te_prefixes=("lora_te1_", "lora_te2_"), names="SAI", fused=FUSED_QKV
    )
    assert not any(k.startswith("lora_te3_") for k in load_state_dict(result.output)[0])
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == ARCH[variant] + "/lora"
    assert "modelspec.prediction_type" not in meta  # flow matching: neither epsilon nor v
    assert (meta["ss_weighting_scheme"], meta["ss_apply_lg_attn_mask"], meta["ss_apply_t5_attn_mask"]) == (
        "uniform",
        "False",
        "False",
    )


def base_argv(files, dataset, out, *extra, steps=2):
    """A short run's command line on the SAI file with its encoders."""
    return [
        "--pretrained_model_name_or_path", files["model"],
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(out), "--output_name", "t", "--network_module", "networks.lora", "--network_dim", "4",
        "--network_alpha", "4", "--train_batch_size", "2", "--max_train_steps", str(steps),
        "--max_data_loader_n_workers", "0", "--seed", "1", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
        *extra,
    ]  # fmt: skip


def test_loss_falls_and_resume_equals_an_uninterrupted_run(models, dataset, tmp_path):
    """SD3.5-medium (dual attention): 10 steps, the held-out flow loss falls. With T5 dropout and random
    position-embedding crops (draws a resume must continue): 3 steps + --save_state, then --resume to 6, gives the
    weights of 6 uninterrupted steps."""
    files = models("sd3.5-medium")
    common = ["--network_train_unet_only", "--validation_split", "0.25", "--validate_every_n_steps", "5",
              "--learning_rate", "3e-2"]  # fmt: skip
    full = sd3_train_network.run(base_argv(files, dataset, tmp_path / "full", *common, steps=10))
    values = [v for _, v in full.validation]
    assert len(values) == 2 and values[-1] < 0.97 * values[0], values  # measured: 1.195 -> 1.147
    assert read_metadata(full.output)["modelspec.architecture"] == ARCH["sd3.5-medium"] + "/lora"
    assert_comfyui_loads(str(full.output), files["shapes"], names="SAI", fused=FUSED_QKV)
    assert any("x_block_attn2_qkv" in k for k in load_state_dict(full.output)[0])  # SD3.5-medium's second attention
    draws = ["--network_train_unet_only", "--t5_dropout_rate", "0.5", "--pos_emb_random_crop_rate", "0.5"]
    straight = sd3_train_network.run(base_argv(files, dataset, tmp_path / "straight", *draws, steps=6))
    first = base_argv(files, dataset, tmp_path / "a", *draws, "--save_every_n_steps", "3", "--save_state", steps=6)
    half = [*first[: first.index("--max_train_steps") + 1], "3", *first[first.index("--max_train_steps") + 2 :]]
    sd3_train_network.run(half)
    resumed = sd3_train_network.run([*first, "--resume", str(tmp_path / "a" / "t-state")])
    assert resumed.losses[-3:] == straight.losses[-3:]
    (a, _), (b, _) = load_state_dict(straight.output), load_state_dict(resumed.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_encoder_outputs_cached_to_disk(models, dataset, tmp_path):
    """--cache_text_encoder_outputs_to_disk (which implies the cache, as sd-scripts) with the transformer's adapters
    only: the three encoders' outputs are cached on disk and the losses equal a run that encodes every step; a
    different --apply_t5_attn_mask is a different cache entry (never a stale one)."""
    files = models("sd3.5-medium")
    argv = base_argv(files, dataset, tmp_path, "--network_train_unet_only", steps=2)
    cache = tmp_path / "cache"
    cached = sd3_train_network.run([*argv, "--cache_text_encoder_outputs_to_disk", "--cache_dir", str(cache),
                                    "--output_name", "cached"])  # fmt: skip
    live = sd3_train_network.run([*argv, "--output_name", "live"])
    torch.testing.assert_close(cached.losses, live.losses, rtol=1e-4, atol=1e-6)
    written = sorted(p for p in cache.rglob("*") if p.is_file())
    assert written
    masked = sd3_train_network.run([*argv, "--cache_text_encoder_outputs_to_disk", "--cache_dir", str(cache),
                                    "--apply_t5_attn_mask", "--output_name", "masked"])  # fmt: skip
    assert len([p for p in cache.rglob("*") if p.is_file()]) > len(written)
    assert masked.losses != cached.losses


def test_medium_only_flags_are_refused_on_other_variants_before_training(models, dataset, tmp_path):
    """--pos_emb_random_crop_rate / --enable_scaled_pos_embed: refused on SD3 medium weights before anything trains,
    read on SD3.5-medium's (one step runs)."""
    flags = ("--pos_emb_random_crop_rate", "0.5", "--enable_scaled_pos_embed")
    with pytest.raises(ConfigError, match="--pos_emb_random_crop_rate") as e:
        sd3_train_network.run(base_argv(models("sd3"), dataset, tmp_path / "sd3", *flags))
    assert "--enable_scaled_pos_embed" in str(e.value) and not (tmp_path / "sd3").exists()
    result = sd3_train_network.run(base_argv(models("sd3.5-medium"), dataset, tmp_path / "m", *flags, steps=1))
    assert result.steps == 1 and all(map(math.isfinite, result.losses))


def test_attention_backends_keep_sd3_joint_attention(caplog):
    """--sdpa / --xformers: SD3's joint attention layers (diffusers ``Attention`` with ``JointAttnProcessor2_0``) keep
    their processor, which attends over image and text tokens together (a plain ``AttnProcessor2_0`` broke the first
    step); the VAE's plain attention still gets ``AttnProcessor2_0``."""
    import logging

    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from library.run.runtime import set_attention

    parts = build_tiny_sd3("sd3.5-medium")
    before = {k: type(v) for k, v in parts.denoiser.attn_processors.items()}
    assert any("Joint" in t.__name__ for t in before.values())
    parts.vae.set_attn_processor(AttnProcessor())
    set_attention([parts.denoiser, parts.vae], "sdpa")
    assert {k: type(v) for k, v in parts.denoiser.attn_processors.items()} == before
    assert {type(v) for v in parts.vae.attn_processors.values()} == {AttnProcessor2_0}
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        set_attention([parts.denoiser], "xformers")
    assert {k: type(v) for k, v in parts.denoiser.attn_processors.items()} == before
    assert "keeps its own attention" in caplog.text


def test_demo_trains_a_tiny_sd3_lora(tmp_path, capsys):
    """``sd3_train_network.py --demo``: a tiny SD3 medium folder and the example images, made offline; the file loads
    back and changes the transformer's output."""
    result = sd3_train_network.run(["--demo", "--demo_dir", str(tmp_path), "--max_train_steps", "2"])
    assert result.steps == 2 and result.output.exists() and not result.failed
    assert (tmp_path / "models" / "sd3" / "model_index.json").exists()
    assert read_metadata(result.output)["modelspec.architecture"] == ARCH["sd3"] + "/lora"
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("demo: the adapter is at"))
    assert "sdtrain loads it" in line and "changes the transformer output" in line


def test_fp8_base_stores_the_frozen_transformer_in_float8_and_trains(models, dataset, tmp_path):
    """--fp8_base: the transformer's Linear layers (but those the family keeps, ``fp8_skip``) are stored in float8
    (sd-scripts' ``mmdit.to(float8_e4m3fn)``); a bf16 step on them runs and is finite."""
    from types import SimpleNamespace

    from library.device.fp8 import stored_in_fp8
    from library.families import get_family
    from library.run.setup import store_frozen_in_fp8

    family = get_family("sd3.5-medium")
    parts = build_tiny_sd3("sd3.5-medium")
    run = SimpleNamespace(
        fp8_base=True, fp8_base_unet=False, fp8_scaled=False, weight_dtype=torch.bfloat16, train_dtype=torch.float32
    )
    store_frozen_in_fp8(SimpleNamespace(run=run, trained_parts=(), family=family), parts)
    linears = [(n, m) for n, m in parts.denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = [n for n, m in linears if not stored_in_fp8(m)]
    assert all(any(s in n for s in family.fp8_skip) for n in kept) and len(kept) < len(linears)
    argv = base_argv(models("sd3.5-medium"), dataset, tmp_path, "--fp8_base", "--mixed_precision", "bf16",
                     "--network_train_unet_only", steps=1)  # fmt: skip
    result = sd3_train_network.run(argv)
    assert result.steps == 1 and all(map(math.isfinite, result.losses))


def test_clip_adapters_train_over_the_t5_cache_as_without_it(models, dataset, tmp_path):
    """sd-scripts' partial cache: --cache_text_encoder_outputs while CLIP-L's and CLIP-G's adapters train caches T5
    and runs both CLIPs in every step; the losses and the trained CLIP adapters equal those of the run that encodes
    every step."""
    argv = base_argv(models("sd3.5-medium"), dataset, tmp_path, "--learning_rate", "1e-2", steps=3)
    cached = sd3_train_network.run([*argv, "--cache_text_encoder_outputs", "--output_name", "cached"])
    live = sd3_train_network.run([*argv, "--output_name", "live"])
    torch.testing.assert_close(cached.losses, live.losses, rtol=1e-4, atol=1e-6)
    (a, _), (b, _) = load_state_dict(cached.output), load_state_dict(live.output)
    for prefix in ("lora_te1_", "lora_te2_"):
        te = [k for k in a if k.startswith(prefix) and k.endswith("lora_up.weight")]
        assert te and any(a[k].abs().max() > 0 for k in te), prefix  # the CLIP adapters trained (they start at 0)
        for k in te:
            torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-6)
