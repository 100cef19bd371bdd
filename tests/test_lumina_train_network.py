"""lumina_train_network.py end to end on tiny Lumina 2 files: sd-scripts' docs/lumina_train_network.md command line
runs unchanged but for the paths (Alpha-VLLM single file with --gemma2 --ae, and a diffusers folder); every saved
module maps to an Alpha-VLLM key of the right shape by ComfyUI's rule (``attention.qkv`` fused; Gemma's adapters
are left out over its cached outputs); the metadata names the family; networks.lora_lumina's network_args select and rank modules by
sd-scripts' rules (re-typed from its ``create_modules``); the attention flags without their package are refused."""

from __future__ import annotations

import importlib.util

import pytest
from _lumina_helpers import write_layouts
from _networks_helpers import make_config
from _train_helpers import assert_comfyui_loads, write_dataset_toml

import lumina_train_network
from library.cli.problems import ConfigError
from library.families.lumina import LUMINA2
from library.families.lumina.tiny import build_tiny_lumina
from library.files.weights import load_state_dict, read_metadata
from networks.inject import prepare_network

SYSTEM = "You are an assistant designed to generate high-quality images based on user prompts."


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_layouts(build_tiny_lumina(seed=0), tmp_path_factory.mktemp("lumina_files"))


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "my_lumina_dataset_config.toml")


def doc_command(files: dict, toml, out, layout: str) -> list[str]:
    """docs/lumina_train_network.md's example with the tiny files for its paths; changed: --max_train_epochs 1
    (2 steps; the doc's 10 train the same way), no loader workers and a seed."""
    model = ([f"--pretrained_model_name_or_path={files['model']}", f"--gemma2={files['gemma2']}",
              f"--ae={files['ae']}"] if layout == "model"
             else [f"--pretrained_model_name_or_path={files['folder']}"])  # fmt: skip
    return [
        *model, f"--dataset_config={toml}", f"--output_dir={out}", "--output_name=my_lumina_lora",
        "--save_model_as=safetensors", "--network_module=networks.lora_lumina", "--network_dim=8",
        "--network_alpha=8", "--learning_rate=1e-4", "--optimizer_type=AdamW", "--lr_scheduler=constant",
        "--timestep_sampling=nextdit_shift", "--discrete_flow_shift=6.0", "--model_prediction_type=raw",
        f"--system_prompt={SYSTEM}", "--max_train_epochs=1", "--save_every_n_epochs=1", "--mixed_precision=bf16",
        "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs",
        "--max_data_loader_n_workers", "0", "--seed", "1",
    ]  # fmt: skip


@pytest.mark.parametrize("layout", ["model", "folder"])
def test_docs_command_line_runs(layouts, dataset_toml, tmp_path, layout, caplog):
    """As written (with --cache_text_encoder_outputs and no --network_train_unet_only): the transformer's adapters
    train and Gemma gets none, with one warning (sd-scripts builds Gemma's and trains them over the cache, where they
    get no gradient)."""
    with caplog.at_level("WARNING"):
        result = lumina_train_network.run(doc_command(layouts, dataset_toml, tmp_path, layout))
    assert result.steps == 2 and not result.failed
    assert sum("only the denoiser's adapters train" in r.getMessage() for r in caplog.records) == 1
    assert not any(k.startswith("lora_te") for k in load_state_dict(result.output)[0])
    shapes = {k: tuple(v.shape) for k, v in load_state_dict(layouts["model"])[0].items()}
    assert_comfyui_loads(str(result.output), shapes, names="Alpha-VLLM", fused="attention_qkv")
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == "lumina-2/lora" and meta["ss_base_model_version"] == "lumina2"
    assert meta["ss_network_module"] == "networks.lora_lumina" and meta["ss_timestep_sampling"] == "nextdit_shift"


def names_and_ranks(*args: str) -> dict[str, int]:
    parts = build_tiny_lumina(seed=0)
    cfg = make_config(*args, module="networks.lora_lumina", dim=4, alpha=4.0)
    network = prepare_network(cfg, LUMINA2.adapter_roots(parts), LUMINA2.target_classes)
    state = network.state_dict_for_file()
    return {k.split(".")[0]: v.shape[0] for k, v in state.items() if k.endswith("lora_down.weight")}


def test_network_args_follow_sd_scripts_rules():
    """sd-scripts' create_modules: JointTransformerBlock / FinalLayer Linears and Gemma's attention / MLP by default;
    the first type dim whose identifier is in the name (attention, mlp, modulation, refiner; 0 skips);
    embedder_dims for x / t / cap embedders (t_embedder_mlp_* then takes mlp_dim); train_blocks filters the blocks;
    split_qkv holds q, k, v as one rank-3r LoRA."""
    default = names_and_ranks()
    unet = {n for n in default if n.startswith("lora_unet_")}
    assert len(unet) == 2 * 6 + 2 * 6 + 2 * 5 + 2 and len(default) - len(unet) == 2 * 7
    assert "lora_unet_final_layer_adaLN_modulation_1" in unet and not any("embedder" in n for n in unet)
    ranks = names_and_ranks("attn_dim=2", "mod_dim=0", "refiner_dim=3", "mlp_dim=5", "embedder_dims=[6,7,0]")
    assert ranks["lora_unet_layers_0_attention_qkv"] == ranks["lora_unet_noise_refiner_0_attention_out"] == 2
    assert not any("modulation" in n for n in ranks)
    assert (
        ranks["lora_unet_context_refiner_1_feed_forward_w2"] == 3 and ranks["lora_unet_layers_1_feed_forward_w1"] == 4
    )
    assert ranks["lora_unet_x_embedder"] == 6 and ranks["lora_unet_t_embedder_mlp_0"] == 5
    assert not any("cap_embedder" in n for n in ranks) and ranks["lora_te_layers_0_self_attn_q_proj"] == 4
    refiners = names_and_ranks("train_blocks=refiners", "embedder_dims=[1,0,0]")
    assert {n.split("_")[2] for n in refiners if n.startswith("lora_unet_")} == {"noise", "context", "x"}
    split = names_and_ranks("split_qkv=True")
    assert split["lora_unet_layers_0_attention_qkv"] == 12 and split["lora_unet_layers_0_attention_out"] == 4
    with pytest.raises(ConfigError, match="train_blocks=double"):
        make_config("train_blocks=double", module="networks.lora_lumina")
    cfg = make_config("rank_dropout=0.1", "module_dropout=0.2", "loraplus_unet_lr_ratio=4", "verbose=True",
                      module="networks.lora_lumina")  # fmt: skip
    assert (cfg.rank_dropout, cfg.module_dropout, cfg.loraplus_unet_lr_ratio) == (0.1, 0.2, 4.0)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_attention_flags_without_their_package_are_refused(layouts, dataset_toml, tmp_path):
    argv = [*doc_command(layouts, dataset_toml, tmp_path, "model"), "--use_flash_attn"]
    with pytest.raises(ConfigError, match="--use_flash_attn needs the flash_attn package"):
        lumina_train_network.run(argv)
