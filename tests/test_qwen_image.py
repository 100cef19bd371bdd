"""Qwen-Image on the tiny files: the shared Qwen2.5-VL encoder (template, dropped tokens, file layouts) against
transformers' own Qwen2.5-VL; the DiT's layouts read the same weights; musubi-tuner's documented
qwen_image_train_network.py command line with its dataset TOML, whose LoRA applied by ComfyUI's rule (by hand) and by
diffusers' QwenImagePipeline loader equals our injected network; the loss falls; bad input is refused before
training with a message naming the flag / table."""

from __future__ import annotations

import copy

import pytest
import torch
from _qwen_image_commands import doc_command, musubi_toml
from safetensors.torch import load_file, save_file

import qwen_image_train_network
from library.cli.problems import ConfigError
from library.families.encoders import qwen25vl
from library.families.qwen_image import QWEN_IMAGE
from library.families.qwen_image import model as M
from library.families.qwen_image.loading import load_dit
from library.files.weights import read_metadata

pytest_plugins = ["_qwen_image_helpers"]
CAPTIONS = ["a red cube on a table", ""]


def test_prompt_equals_transformers_qwen25vl(qwen_files):
    """Our text path (language model alone, template, 34 tokens dropped) equals transformers'
    Qwen2_5_VLForConditionalGeneration's last hidden states over the caption tokens (musubi-tuner's
    get_qwen_prompt_embeds); the template head is 34 tokens; Qwen3's <think> is text for Qwen2.5-VL."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    parts = qwen_files["parts"]
    tok = parts.tokenizers[0]
    assert len(tok(qwen25vl.QWEN_IMAGE_TEMPLATE.split("{}")[0]).input_ids) == qwen25vl.QWEN_IMAGE_DROP
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645 and len(tok("<think>").input_ids) > 1
    text = {k: v for k, v in qwen25vl.TINY_TEXT.items() if k != "rope_scaling"}
    cfg = Qwen2_5_VLConfig(text_config=dict(text, rope_scaling=qwen25vl.TINY_TEXT["rope_scaling"]),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                              out_hidden_size=16))  # fmt: skip
    vlm = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    vlm.model.language_model.load_state_dict(parts.text_encoders[0].state_dict())
    ids, mask = qwen25vl.tokenize(tok, CAPTIONS)
    with torch.no_grad():
        ref = vlm(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        ours, ours_mask = qwen25vl.encode(parts.text_encoders[0], tok, CAPTIONS)
    for i in range(len(CAPTIONS)):
        n = int(mask[i].sum()) - qwen25vl.QWEN_IMAGE_DROP
        assert int(ours_mask[i].sum()) == n
        torch.testing.assert_close(ours[i, :n], ref[i, qwen25vl.QWEN_IMAGE_DROP : qwen25vl.QWEN_IMAGE_DROP + n])
        assert not ours[i, n:].any()


def test_text_encoder_layouts_load_the_same(qwen_files, tmp_path):
    """ComfyUI's model.-prefixed file, a transformers model.language_model. file with a vision tower and lm_head, a
    split -0000k-of-00002 file and a ComfyUI fp8_scaled file (weights x scale_weight) load the same language model."""
    base = load_file(qwen_files["text_encoder"])
    want = qwen25vl.load(qwen_files["text_encoder"], torch.float32).state_dict()
    new = {k.replace("model.", "model.language_model.", 1): v for k, v in base.items()}
    new |= {"model.visual.patch_embed.proj.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(3, 16)}
    save_file(new, str(tmp_path / "tf.safetensors"))
    keys = sorted(base)
    save_file({k: base[k] for k in keys[: len(keys) // 2]}, str(tmp_path / "te-00001-of-00002.safetensors"))
    save_file({k: base[k] for k in keys[len(keys) // 2 :]}, str(tmp_path / "te-00002-of-00002.safetensors"))
    scaled = {}
    for k, v in base.items():
        if k.endswith(".weight") and v.ndim == 2 and "embed" not in k:
            scale = v.abs().max() / 448
            scaled[k] = (v / scale).to(torch.float8_e4m3fn)
            scaled[k[: -len("weight")] + "scale_weight"] = scale.reshape(1)
        else:
            scaled[k] = v
    scaled["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, str(tmp_path / "fp8.safetensors"))
    for name, tol in (("tf.safetensors", 0), ("te-00001-of-00002.safetensors", 0), ("fp8.safetensors", 0.07)):
        got = qwen25vl.load(tmp_path / name, torch.float32).state_dict()
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=tol * float(want[k].abs().max()) + 1e-7, rtol=0)
    with pytest.raises(ValueError, match="--text_encoder .*no Qwen2.5-VL language model"):
        qwen25vl.load(qwen_files["vae"], torch.float32)


def test_dit_layouts_load_the_same(qwen_files, tmp_path):
    """The bare file, ComfyUI's model.diffusion_model. file and a diffusers folder (save_pretrained) read the same
    DiT; an Edit-2511 file is refused by name."""
    base = load_file(qwen_files["dit"])
    want = qwen_files["parts"].denoiser.state_dict()
    save_file({"model.diffusion_model." + k: v for k, v in base.items()}, str(tmp_path / "comfy.safetensors"))
    qwen_files["parts"].denoiser.save_pretrained(tmp_path / "pipe" / "transformer")
    for path in (tmp_path / "comfy.safetensors", tmp_path / "pipe"):
        got = load_dit(path, torch.float32, "cpu").state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    save_file({**base, "__index_timestep_zero__": torch.zeros(1)}, str(tmp_path / "e2511.safetensors"))
    with pytest.raises(ValueError, match="Edit-2511"):
        load_dit(tmp_path / "e2511.safetensors", torch.float32, "cpu")


def _merged(denoiser, lora_sd, multiplier=1.0):
    """ComfyUI's rule by hand: lora_unet_ + the file's module path with dots as underscores; W += m·α/r·up@down."""
    out = copy.deepcopy(denoiser)
    modules = dict(out.named_modules())
    names = {k.split(".")[0] for k in lora_sd}
    by_kohya = {"lora_unet_" + p.replace(".", "_"): p for p in modules}
    for name in names:
        mod = modules[by_kohya[name]]
        up, down = lora_sd[f"{name}.lora_up.weight"].float(), lora_sd[f"{name}.lora_down.weight"].float()
        alpha = float(lora_sd[f"{name}.alpha"]) if f"{name}.alpha" in lora_sd else down.shape[0]
        with torch.no_grad():
            mod.weight += multiplier * alpha / down.shape[0] * (up @ down)
    return out


def test_documented_command_line_with_musubi_toml(qwen_files, dataset, tmp_path):
    """musubi-tuner's docs/qwen_image.md line with its dataset TOML runs; the file names every Linear of the blocks
    (ComfyUI's rule); applied by hand and by diffusers' QwenImagePipeline loader it equals our injected network."""
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    result = qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", "--network_alpha", "8"))
    meta = read_metadata(result.output)
    assert meta["ss_network_module"] == "networks.lora_qwen_image" and meta["ss_timestep_sampling"] == "shift"
    assert meta["modelspec.architecture"] == "qwen-image/lora" and meta["ss_base_model_version"] == "qwen_image"
    sd = load_file(str(result.output))
    names = {k.split(".")[0] for k in sd}
    assert len(names) == 14 * 2 and all(n.startswith("lora_unet_transformer_blocks_") for n in names)
    for k in [k for k in sd if k.endswith("lora_up.weight")]:
        sd[k] = torch.randn_like(sd[k]) * 0.05  # trained ups are tiny after 2 steps: make the comparison telling
    save_file(sd, str(tmp_path / "lora.safetensors"))
    base = qwen_files["parts"].denoiser
    merged = _merged(base, sd)
    # our injected network on the same file (live, not merged)
    from library.families.base import Parts
    from networks.inject import network_from_file

    ours = copy.deepcopy(base)
    roots = QWEN_IMAGE.adapter_roots(Parts(ours, None, [], [], {}, "qwen_image"))
    net = network_from_file(tmp_path / "lora.safetensors", roots)
    net.set_multiplier(1.0)
    g = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 4, 16, generator=g)
    sigma = torch.tensor([0.6])
    with torch.no_grad():
        want = M.forward(merged, x, sigma, ctx, None)
        assert (want - M.forward(base, x, sigma, ctx, None)).abs().max() > 1e-3  # the LoRA changes the output
        from diffusers import QwenImagePipeline

        diff = copy.deepcopy(base)
        state = QwenImagePipeline.lora_state_dict(str(tmp_path / "lora.safetensors"))
        state = state[0] if isinstance(state, tuple) else state
        QwenImagePipeline.load_lora_into_transformer(state, transformer=diff)
        torch.testing.assert_close(M.forward(diff, x, sigma, ctx, None), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(M.forward(ours, x, sigma, ctx, None), want, atol=1e-4, rtol=1e-4)


def test_loss_falls(qwen_files, dataset, tmp_path):
    """Ten epochs at a high learning rate on the four images: the loss of the last epoch is below the first's."""
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    result = qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", "--max_train_epochs", "12",
                                                      "--learning_rate", "3e-3", "--optimizer_type", "AdamW",
                                                      "--timestep_sampling", "uniform", "--save_every_n_epochs", "12"))  # fmt: skip
    assert result.output.is_file() and len(result.losses) == 24
    assert sum(result.losses[-4:]) < sum(result.losses[:4])


@pytest.mark.parametrize(
    ("extra", "toml_extra", "message"),
    [
        (["--model_version", "layered"], "", "--model_version layered is not supported yet"),
        ([], 'control_directory = "x"\n', "datasets\\[0\\]: control_directory: the edit models' control images"),
        ([], "frame_stride = 2\n", "frame_stride: video datasets are not supported"),
        ([], "colour = 2\n", "unknown key 'colour'"),
    ],
)
def test_refused_before_training(qwen_files, dataset, tmp_path, extra, toml_extra, message):
    toml = musubi_toml(dataset, tmp_path / "dataset.toml", toml_extra)
    with pytest.raises(ConfigError, match=message):
        qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_full_finetune_reads_back_and_resumes(qwen_files, dataset, tmp_path):
    """qwen_image_train.py (musubi-tuner's line less the LoRA flags): the DiT file reads back exactly, the weights
    moved, and --resume from a state at step 2 equals the uninterrupted 4-step run bit for bit."""
    import qwen_image_train
    from library.families.qwen_image.options import QwenImageOptions

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    argv = ["--dit", qwen_files["dit"], "--vae", qwen_files["vae"], "--text_encoder", qwen_files["text_encoder"],
            "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16", "--timestep_sampling", "shift",
            "--weighting_scheme", "none", "--discrete_flow_shift", "2.2", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-3", "--gradient_checkpointing", "--max_data_loader_n_workers", "0", "--seed", "42",
            "--output_name", "ft"]  # fmt: skip
    straight = qwen_image_train.run([*argv, "--output_dir", str(tmp_path / "s"), "--max_train_steps", "4"])
    qwen_image_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "2", "--save_state"])
    resumed = qwen_image_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "4", "--resume",
                                    str(tmp_path / "r" / "ft-state")])  # fmt: skip
    a, b, base = load_file(str(straight.output)), load_file(str(resumed.output)), load_file(qwen_files["dit"])
    assert a.keys() == b.keys() == base.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)
    parts = QWEN_IMAGE.load(straight.output, vae=qwen_files["vae"],
                            options=QwenImageOptions(text_encoder=qwen_files["text_encoder"]))  # fmt: skip
    assert all(torch.equal(v, a[k]) for k, v in parts.denoiser.state_dict().items())


def test_generate_image_script(qwen_files, tmp_path):
    """qwen_image_generate_image.py's musubi-tuner line writes a PNG; --flow_shift (a static shift) changes the
        image of the same seed; --control_image_path is refused for the original model with the reason (the edit models':
    tests/test_qwen_image_edit_training.py)."""
    import numpy as np
    from PIL import Image

    import qwen_image_generate_image

    base = ["--dit", qwen_files["dit"], "--vae", qwen_files["vae"], "--text_encoder", qwen_files["text_encoder"],
            "--prompt", "a cat", "--image_size", "32", "32", "--infer_steps", "2", "--seed", "1"]  # fmt: skip
    (a,) = qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "a")])
    (b,) = qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "b"), "--flow_shift", "5.0"])
    pa, pb = np.asarray(Image.open(a)), np.asarray(Image.open(b))
    assert pa.shape == (32, 32, 3) and not np.array_equal(pa, pb)
    (d,) = qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "d"), "--fp8_vl"])  # float8 Qwen2.5-VL
    assert np.asarray(Image.open(d)).shape == (32, 32, 3)
    with pytest.raises(ConfigError, match="--control_image_path: for the edit models; add --model_version"):
        qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "c"), "--control_image_path", "x.png"])


def test_lycoris_loha_trains_and_merges(qwen_files, dataset, tmp_path):
    """LoHa through lycoris.kohya on the DiT's blocks: its file applied live equals it merged into the weights."""
    from library.families.base import Parts
    from networks.inject import network_from_file

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    extra = ["--network_module", "lycoris.kohya", "--network_args", "algo=loha", "--network_dim", "4"]
    result = qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", *extra))
    sd = load_file(str(result.output))
    assert sd and all(k.startswith("lora_unet_") for k in sd) and any("hada_w1_a" in k for k in sd)
    for k in [k for k in sd if "hada_w1_a" in k or "hada_w2_a" in k]:
        sd[k] = torch.randn_like(sd[k]) * 0.3
    save_file(sd, str(tmp_path / "loha.safetensors"))
    base = qwen_files["parts"].denoiser
    live, merged = copy.deepcopy(base), copy.deepcopy(base)
    net = network_from_file(tmp_path / "loha.safetensors", QWEN_IMAGE.adapter_roots(Parts(live, None, [], [], {}, "q")))
    net.set_multiplier(1.0)
    other = network_from_file(tmp_path / "loha.safetensors",
                              QWEN_IMAGE.adapter_roots(Parts(merged, None, [], [], {}, "q")))  # fmt: skip
    other.set_multiplier(1.0)
    other.merge_into_base()
    g = torch.Generator().manual_seed(5)
    x, ctx, sigma = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 4, 16, generator=g), torch.tensor([0.4])
    with torch.no_grad():
        a, b = M.forward(live, x, sigma, ctx, None), M.forward(merged, x, sigma, ctx, None)
        assert (a - M.forward(base, x, sigma, ctx, None)).abs().max() > 1e-3
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# every flag of musubi-tuner's qwen_image_train_network.py (its training/parser_common.py + qwen_image_setup_parser +
# add_model_version_args, extracted from kohya-ss/musubi-tuner's source)
MUSUBI_FLAGS = """--async_upload --base_weights --base_weights_multiplier --block_swap_h2d_only --block_swap_ring_size
--blocks_to_swap --compile --compile_backend --compile_cache_size_limit --compile_dynamic --compile_fullgraph
--compile_mode --config_file --cuda_allow_tf32 --cuda_cudnn_benchmark --dataset_config --ddp_gradient_as_bucket_view
--ddp_static_graph --ddp_timeout --dim_from_weights --disable_numpy_memmap --discrete_flow_shift --dit --dynamo_backend
--dynamo_dynamic --dynamo_fullgraph --dynamo_mode --flash3 --flash_attn --flow_shift --fp8_base --full_bf16 --full_fp16
--gradient_accumulation_steps --gradient_checkpointing --gradient_checkpointing_cpu_offload --guidance_scale
--huggingface_path_in_repo --huggingface_repo_id --huggingface_repo_type --huggingface_repo_visibility
--huggingface_token --img_in_txt_in_offloading --learning_rate --log_config --log_prefix --log_tracker_config
--log_tracker_name --log_with --logging_dir --logit_mean --logit_std --lr_decay_steps --lr_scheduler
--lr_scheduler_args --lr_scheduler_min_lr_ratio --lr_scheduler_num_cycles --lr_scheduler_power
--lr_scheduler_timescale --lr_scheduler_type --lr_warmup_steps --max_data_loader_n_workers --max_grad_norm
--max_timestep --max_train_epochs --max_train_steps --metadata_arch --metadata_author --metadata_description
--metadata_license --metadata_reso --metadata_tags --metadata_title --min_timestep --mixed_precision --mode_scale
--network_alpha --network_args --network_dim --network_dropout --network_module --network_weights --no_metadata
--num_timestep_buckets --optimizer_args --optimizer_type --output_dir --output_name --persistent_data_loader_workers
--preserve_distribution_shape --resume --resume_from_huggingface --sage_attn --sample_at_first
--sample_every_n_epochs --sample_every_n_steps --sample_prompts --save_every_n_epochs --save_every_n_steps
--save_last_n_epochs --save_last_n_epochs_state --save_last_n_steps --save_last_n_steps_state --save_precision
--save_state --save_state_on_train_end --save_state_to_huggingface --scale_weight_norms --sdpa --seed --show_timesteps
--sigmoid_scale --split_attn --timestep_sampling --training_comment --use_pinned_memory_for_block_swap --vae
--vae_dtype --wandb_api_key --wandb_run_name --weighting_scheme --xformers --fp8_scaled --text_encoder --fp8_vl
--num_layers --remove_first_image_from_target --edit --edit_plus --model_version""".split()


def test_every_musubi_flag_is_read_or_refused_by_name():
    """Each flag of musubi-tuner's Qwen-Image LoRA script is one of ours; the musubi-only ones are refused with a
    message naming the flag."""
    from library.cli.parse import unsupported_problems
    from library.families.qwen_image.options import MUSUBI_ONLY

    parser = qwen_image_train_network.build_parser()
    assert [f for f in MUSUBI_FLAGS if f not in parser._option_string_actions] == []
    for flag, (kwargs, _) in MUSUBI_ONLY.items():
        value = [] if kwargs.get("action") == "store_true" else ["1"]
        args = parser.parse_args([flag, *value])
        assert any(p.startswith(f"{flag} is not supported yet") for p in unsupported_problems(parser, args)), flag


def test_sampling_during_training_with_cfg(qwen_files, dataset, tmp_path):
    """A sample prompt with a negative prompt of another length is drawn during training (CFG batches both, zero-padded
    to one length with their masks; before, the concatenation failed): one 64 px PNG that is not blank."""
    import numpy as np
    from PIL import Image

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    (tmp_path / "prompts.txt").write_text("a red cube on a long wooden table --w 64 --h 64 --s 2 --l 4.0 --n bad\n")
    extra = ["--sample_prompts", str(tmp_path / "prompts.txt"), "--sample_every_n_epochs", "1"]
    qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", *extra))
    pngs = sorted((tmp_path / "out" / "sample").glob("*.png"))
    assert pngs
    png = pngs[-1]
    pixels = np.asarray(Image.open(png))
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0


def test_musubi_jsonl_dataset(qwen_files, dataset, tmp_path):
    """musubi-tuner's image_jsonl_file ({"image_path", "caption"} per line) is read as sd-scripts' fine-tune
    metadata: two images, one repeat, batch 1 -> 2 steps in the epoch."""
    import json

    images = sorted((dataset / "10_sks shape").glob("*.png"))[:2]
    lines = [json.dumps({"image_path": str(p), "caption": f"jsonl caption {i}"}) for i, p in enumerate(images)]
    (tmp_path / "meta.jsonl").write_text("\n".join(lines) + "\n")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [64, 64]\nbatch_size = 1\n\n[[datasets]]\nimage_jsonl_file = '
                    f'"{(tmp_path / "meta.jsonl").as_posix()}"\n')  # fmt: skip
    from library.data import dataset_config

    configs, _ = dataset_config.load_dataset_configs(
        dataset_config.DataArgs(dataset_config=str(toml)), size_multiple=16
    )
    assert configs[0].subsets[0].kind == "finetune" and configs[0].resolutions[0] == (64, 64)
    result = qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out"))
    assert result.steps == 2


def test_sigma_sampling_is_musubi_tuners_table():
    """--timestep_sampling sigma (musubi-tuner's default): σ from its unshifted training table (linspace(1, 0, 1001),
    --discrete_flow_shift not applied, as musubi-tuner), the DiT's timestep 1000 σ with no + 1, x_σ by the flow rule.
    (Checked by hand: the same u gives musubi-tuner's FlowMatchDiscreteScheduler timesteps and get_sigmas values.)"""
    from library.families.qwen_image.objective import QwenFlowConfig, QwenFlowObjective
    from library.objectives.losses import LossConfig

    objective = QwenFlowObjective(QwenFlowConfig(timestep_sampling="sigma", discrete_flow_shift=2.2), LossConfig())
    latents = torch.randn(64, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    ex = objective.example(latents, torch.Generator().manual_seed(0))
    table = torch.linspace(1, 0, 1001)
    assert ex.sigmas.shape == (64,) and set(ex.sigmas.tolist()) <= set(table.tolist())
    assert torch.equal(ex.timesteps, ex.sigmas * 1000)  # no +1 on this path
    noisy = (1 - ex.sigmas.view(-1, 1, 1, 1)) * latents + ex.sigmas.view(-1, 1, 1, 1) * ex.noise
    torch.testing.assert_close(ex.noisy, noisy)
    assert 0.4 < ex.sigmas.mean().item() < 0.6  # uniform over the table, unshifted (2.2 would give ~0.65)
