"""Anima's scripts end to end on the tiny files: sd-scripts' docs/anima_train_network.md command line (tiny paths;
unchanged, though sd-scripts' own assert stops it: the Qwen3 adapters are left out over the cached outputs), whose
file loads by ComfyUI's key rule; networks.lora_anima's train_llm_adapter, Qwen3 LoRA and network_reg_dims;
LoHa through lycoris.kohya over
float8 base weights (--fp8_base works for Anima; sd-scripts disables it); anima_train.py's file (net. names, the adapter frozen by --llm_adapter_lr 0) reading
back exactly, its loss falling and --resume equal to an uninterrupted run; the minimal inference script."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import assert_comfyui_loads, write_dataset_toml
from safetensors.torch import load_file

import anima_minimal_inference
import anima_train
import anima_train_network
from library.cli.problems import ConfigError
from library.families.anima import ANIMA, text
from library.families.anima.objective import AnimaFlowConfig, AnimaFlowObjective
from library.files.weights import read_metadata
from library.objectives.losses import LossConfig

pytest_plugins = ["_anima_helpers"]  # the shared tiny files (anima_files)


def model_flags(files: dict) -> list[str]:
    return [f"--pretrained_model_name_or_path={files['dit']}", f"--qwen3={files['qwen3']}", f"--vae={files['vae']}",
            "--qwen3_max_token_length=16", "--t5_max_token_length=16"]  # fmt: skip


def doc_command(files, toml, out, *extra):
    """docs/anima_train_network.md's example with the tiny files; --max_train_epochs=1 (2 steps), a test's seed
    and loader workers."""
    return [
        *model_flags(files)[:3], f"--dataset_config={toml}", f"--output_dir={out}", "--output_name=my_anima_lora",
        "--save_model_as=safetensors", "--network_module=networks.lora_anima", "--network_dim=8",
        "--learning_rate=1e-4", "--optimizer_type=AdamW8bit", "--lr_scheduler=constant", "--timestep_sampling=sigmoid",
        "--discrete_flow_shift=1.0", "--max_train_epochs=1", "--save_every_n_epochs=1", "--mixed_precision=bf16",
        "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--vae_chunk_size=64",
        "--vae_disable_cache", "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
    ]  # fmt: skip


def test_docs_command_line(anima_files, dataset, tmp_path, caplog):
    """The docs' line as written (sd-scripts itself stops it with an assertion: Qwen3 adapters over cached outputs):
    it trains the DiT's adapters, as --network_train_unet_only, with one warning saying so."""
    toml = write_dataset_toml(dataset, tmp_path / "my_anima_dataset_config.toml")
    with caplog.at_level("WARNING"):
        result = anima_train_network.run(doc_command(anima_files, toml, tmp_path / "out"))
    assert sum("only the denoiser's adapters train" in r.getMessage() for r in caplog.records) == 1
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == "anima-preview/lora" and meta["ss_base_model_version"] == "anima"
    assert meta["ss_network_module"] == "networks.lora_anima" and meta["ss_timestep_sampling"] == "sigmoid"
    dit = {k[len("net.") :]: tuple(v.shape) for k, v in load_file(anima_files["dit"]).items()}
    assert_comfyui_loads(str(result.output), dit)
    names = {k.split(".")[0] for k in load_file(result.output)}  # attention and MLP of every block, nothing else
    assert len(names) == 2 * 10 and not any("modulation" in n or "embedder" in n for n in names)
    assert not any(n.startswith("lora_te") for n in names)  # no Qwen3 adapters over the cached outputs


def test_adapter_text_encoder_and_lycoris(anima_files, dataset, tmp_path):
    common = [*model_flags(anima_files), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
              "--resolution", "64", "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "1",
              "--network_dim", "4", "--learning_rate", "1e-3"]  # fmt: skip
    lora = anima_train_network.run(
        [
            *common,
            "--output_dir",
            str(tmp_path / "a"),
            "--network_module",
            "networks.lora_anima",
            "--network_args",
            "train_llm_adapter=True",
            r"network_reg_dims=blocks\.0\..*=2",
            "include_patterns=['.*final_layer.*']",
            "network_reg_lrs=.*self_attn.*=1e-4",
            "loraplus_lr_ratio=2.0",
            "rank_dropout=0.1",
            "module_dropout=0.1",
            "verbose=True",
        ]
    )  # fmt: skip  (docs/anima_train_network.md's examples)
    sd = load_file(lora.output)
    assert any(k.startswith("lora_te_layers_0_self_attn_q_proj") for k in sd)  # Qwen3 trains (no text cache)
    assert "lora_unet_llm_adapter_blocks_0_cross_attn_k_proj.lora_down.weight" in sd
    assert sd["lora_unet_blocks_0_mlp_layer1.lora_down.weight"].shape[0] == 2
    assert sd["lora_unet_blocks_1_mlp_layer1.lora_down.weight"].shape[0] == 4
    assert {"lora_unet_final_layer_linear.alpha", "lora_unet_final_layer_adaln_modulation_1.alpha"} <= set(sd)
    assert not any("blocks_0_adaln_modulation" in k for k in sd)  # still excluded: only final_layer is included
    loha = anima_train_network.run([*common, "--output_dir", str(tmp_path / "b"), "--network_module",
                                    "lycoris.kohya", "--network_args", "algo=loha", "--network_train_unet_only",
                                    "--fp8_base", "--mixed_precision", "bf16"])  # fmt: skip
    assert any(k.startswith("lora_unet_blocks_0_self_attn_q_proj.hada_w1_a") for k in load_file(loha.output))


def _loss(parts, latents, cond) -> float:
    objective = AnimaFlowObjective(AnimaFlowConfig(), LossConfig())
    ex = objective.example(latents, torch.Generator().manual_seed(0))
    with torch.no_grad():
        pred = ANIMA.predict(parts.denoiser, ex.noisy, ex.timesteps, cond)
    return objective.loss_per_sample(pred, ex).mean().item()


def test_full_finetune_reads_back_loss_falls_and_resumes(anima_files, dataset, tmp_path, monkeypatch):
    """The three runs share one --cache_dir: the first tokenizes (the Qwen3 and T5 tokenizers built once), the other
    two read every text output from there and build no tokenizer (Qwen3's: ~135 MB of the process); the resumed
    run's weights equal the uninterrupted one's all the same."""
    argv = [*model_flags(anima_files), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
            "--resolution", "64", "--max_data_loader_n_workers", "0", "--seed", "1", "--learning_rate", "2e-3",
            "--llm_adapter_lr", "0", "--cache_latents", "--cache_text_encoder_outputs", "--output_name", "ft",
            "--train_batch_size", "2", "--optimizer_type", "AdamW", "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    built = {"load_qwen3_tokenizer": 0, "load_t5_tokenizer": 0}
    for name in built:

        def counted(*args, _name=name, _load=getattr(text, name)):
            built[_name] += 1
            return _load(*args)

        monkeypatch.setattr(text, name, counted)
    straight = anima_train.run([*argv, "--output_dir", str(tmp_path / "s"), "--max_train_steps", "4"])
    assert built == {"load_qwen3_tokenizer": 1, "load_t5_tokenizer": 1}
    anima_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "2", "--save_state"])
    resumed = anima_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "4", "--resume",
                               str(tmp_path / "r" / "ft-state")])  # fmt: skip
    assert built == {"load_qwen3_tokenizer": 1, "load_t5_tokenizer": 1}  # cached: neither later run tokenized
    a, b, base = load_file(straight.output), load_file(resumed.output), load_file(anima_files["dit"])
    assert a.keys() == b.keys() == base.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], base[k]) for k in a if k.startswith("net.llm_adapter."))  # --llm_adapter_lr 0
    assert any(not torch.equal(a[k], base[k]) for k in a if k.startswith("net.blocks."))
    parts = ANIMA.load(straight.output, vae=anima_files["vae"], options=ANIMA.load(anima_files["dit"],
                       vae=anima_files["vae"], options=_options(anima_files)).options)  # fmt: skip
    state = {k[len("net.") :]: v for k, v in a.items()}
    from library.families.anima.saving import dit_state

    assert all(torch.equal(v, state[k[len("net.") :]]) for k, v in dit_state(parts.denoiser).items())
    _diffusers_reads(straight.output, parts, tmp_path)
    original = ANIMA.load(anima_files["dit"], vae=anima_files["vae"], options=_options(anima_files))
    pixels = torch.stack([torch.rand(3, 64, 64) * 2 - 1 for _ in range(2)])
    with torch.no_grad():
        latents = ANIMA.encode_latents(original, pixels)
        cond = ANIMA.encode_prompt(original, ["sks shape", "sks shape"])
    assert _loss(parts, latents, cond) < _loss(original, latents, cond)


def _diffusers_reads(path, parts, tmp_path) -> None:
    """diffusers' CosmosTransformer3DModel.from_single_file reads the DiT of our file exactly (it has no single-file
    reader for the adapter, whose keys it leaves unused)."""
    import json

    from diffusers import CosmosTransformer3DModel

    config = {k: v for k, v in dict(parts.denoiser.config).items() if not k.startswith("_") and k != "text_conditioner"}
    (tmp_path / "cfg" / "transformer").mkdir(parents=True)
    (tmp_path / "cfg" / "transformer" / "config.json").write_text(json.dumps(config))
    model = CosmosTransformer3DModel.from_single_file(str(path), config=str(tmp_path / "cfg"), subfolder="transformer",
                                                      local_files_only=True)  # fmt: skip
    ours = {k: v for k, v in parts.denoiser.state_dict().items() if not k.startswith("llm_adapter.")}
    theirs = model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _options(files):
    from library.families.anima.options import AnimaOptions

    return AnimaOptions(qwen3=files["qwen3"], qwen3_max_token_length=16, t5_max_token_length=16)


def test_minimal_inference(anima_files, tmp_path):
    paths = anima_minimal_inference.run(["--dit", anima_files["dit"], "--text_encoder", anima_files["qwen3"], "--vae",
                                         anima_files["vae"], "--prompt", "1girl", "--image_size", "64", "48",
                                         "--infer_steps", "2", "--seed", "1", "--save_path", str(tmp_path),
                                         "--qwen3_max_token_length", "16", "--t5_max_token_length", "16"])  # fmt: skip
    from PIL import Image

    assert len(paths) == 1 and Image.open(paths[0]).size == (48, 64)
    # without the length flags (512 each, as sd-scripts) and with true CFG: prompt and "" negative, both padded
    paths = anima_minimal_inference.run(["--dit", anima_files["dit"], "--text_encoder", anima_files["qwen3"], "--vae",
                                         anima_files["vae"], "--prompt", "1girl, smile", "--image_size", "32", "32",
                                         "--infer_steps", "1", "--guidance_scale", "3.5", "--seed", "1",
                                         "--save_path", str(tmp_path / "cfg")])  # fmt: skip
    assert len(paths) == 1
    with pytest.raises(ConfigError, match="--fp8"):
        anima_minimal_inference.run(["--dit", anima_files["dit"], "--prompt", "x", "--save_path", str(tmp_path),
                                     "--fp8"])  # fmt: skip


def test_full_finetune_block_swap_offload_and_samples(dataset, tmp_path):
    """anima_train.py on a 4-block tiny model: --cpu_offload_checkpointing gives the plain run's weights exactly;
    --blocks_to_swap 2 (blocks - 2) gives them up to the order in which the gradients of what every block reads (the
    LLM adapter's context, the time embedding) are summed (measured: 1.5e-8 after one SGD step); samples are drawn
    during training; 3 blocks are refused."""
    parts = ANIMA.tiny.build(seed=1, blocks=4)
    files = {k: str(v) for k, v in ANIMA.tiny.write_files(parts, tmp_path / "m", "t4").items()}
    (tmp_path / "prompts.txt").write_text("1girl, smile --w 64 --h 64 --s 2 --n bad\n")
    argv = [*model_flags(files), "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution",
            "64", "--max_data_loader_n_workers", "0", "--seed", "1", "--learning_rate", "1e-3", "--max_train_steps",
            "2", "--gradient_checkpointing", "--cache_latents", "--output_name", "ft", "--optimizer_type", "AdamW"]  # fmt: skip
    plain = load_file(anima_train.run([*argv, "--output_dir", str(tmp_path / "p")]).output)
    swapped = anima_train.run([*argv, "--output_dir", str(tmp_path / "a"), "--blocks_to_swap", "2", "--sample_prompts",
                               str(tmp_path / "prompts.txt"), "--sample_every_n_steps", "2"])  # fmt: skip
    offload = load_file(
        anima_train.run([*argv, "--output_dir", str(tmp_path / "b"), "--cpu_offload_checkpointing"]).output
    )
    a = load_file(swapped.output)
    assert a.keys() == plain.keys() == offload.keys() and all(torch.equal(offload[k], plain[k]) for k in plain)
    for key in plain:
        torch.testing.assert_close(a[key], plain[key], rtol=0, atol=1e-5)
    assert len(list((tmp_path / "a" / "sample").glob("ft_000002_00_*.png"))) == 1
    with pytest.raises(ConfigError, match="--blocks_to_swap 3"):
        anima_train.run([*argv, "--output_dir", str(tmp_path / "c"), "--blocks_to_swap", "3"])
