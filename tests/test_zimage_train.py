"""Z-Image trained through musubi-tuner's scripts on the tiny files: the documented LoRA line with its dataset TOML,
whose file applied by diffusers' ZImagePipeline loader and, converted by networks/convert_z_image_lora_to_comfy.py,
by ComfyUI's key rule (by hand: q / k / v as row slices of the fused qkv) equals our injected network; LoKr through
lycoris.kohya applied live equals it merged; the full fine-tune reads back exactly and resumes bit for bit; the
generate script writes an image; every musubi-tuner flag is ours or refused by name."""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file, save_file

import zimage_train_network
from library.families.base import Parts
from library.families.zimage import ZIMAGE
from library.families.zimage import model as M
from library.files.weights import read_metadata
from networks.inject import network_from_file

pytest_plugins = ["_zimage_helpers"]


def _inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 5, 16, generator=g)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return x, torch.tensor([0.3, 0.7]), ctx, mask


def _comfy_merged(denoiser, comfy_sd):
    """ComfyUI's Z-Image rule by hand on its own (original) layout: diffusion_model.<diffusers path> -> that
    module's weight, attention.to_q / to_k / to_v as row slices 0 / dim / 2·dim of qkv, to_out.0 as out;
    W += α/r · up @ down. Returns the model in diffusers' names again."""
    native = {k: v.clone() for k, v in M.to_original(denoiser.state_dict()).items()}
    modules = {k.split(".lora_")[0].rsplit(".alpha", 1)[0] for k in comfy_sd}
    for name in modules:
        path = name[len("diffusion_model.") :]
        up, down = comfy_sd[f"{name}.lora_B.weight"].float(), comfy_sd[f"{name}.lora_A.weight"].float()
        delta = float(comfy_sd[f"{name}.alpha"]) / down.shape[0] * (up @ down)
        stem, _, leaf = path.rpartition(".attention.")
        if leaf in ("to_q", "to_k", "to_v"):
            qkv = native[f"{stem}.attention.qkv.weight"]
            i = ("to_q", "to_k", "to_v").index(leaf) * delta.shape[0]
            qkv[i : i + delta.shape[0]] += delta
        else:
            native[M.original_name(path + ".weight")] += delta
    out = copy.deepcopy(denoiser)
    out.load_state_dict(dict(M.DiffusersView(native).items()))
    return out


def test_documented_command_line_lora_in_diffusers_and_comfy(zimage_files, dataset, tmp_path):
    """musubi-tuner's docs/zimage.md line with its dataset TOML runs; the file names the main blocks' attention and
    feed-forward Linears only (refiners and modulations excluded as musubi-tuner's module does); applied by diffusers'
    loader and by ComfyUI's rule after conversion it equals our injected network."""
    from _zimage_helpers import doc_command, musubi_toml
    from diffusers import ZImagePipeline

    import networks.convert_z_image_lora_to_comfy as convert

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    result = zimage_train_network.run(doc_command(zimage_files, toml, tmp_path / "out", "--network_alpha", "8"))
    meta = read_metadata(result.output)
    assert meta["ss_network_module"] == "networks.lora_zimage" and meta["ss_discrete_flow_shift"] == "2.0"
    assert meta["modelspec.architecture"] == "z-image/lora" and meta["ss_base_model_version"] == "zimage"
    sd = load_file(str(result.output))
    names = {k.split(".")[0] for k in sd}
    leaves = ("attention_to_q", "attention_to_k", "attention_to_v", "attention_to_out_0", "feed_forward_w1",
              "feed_forward_w2", "feed_forward_w3")  # fmt: skip
    assert names == {f"lora_unet_layers_{i}_{leaf}" for i in range(2) for leaf in leaves}
    for k in [k for k in sd if k.endswith("lora_up.weight")]:
        sd[k] = torch.randn_like(sd[k]) * 0.05  # trained ups are tiny after 2 steps: make the comparison telling
    save_file(sd, str(tmp_path / "lora.safetensors"))
    convert.run([str(tmp_path / "lora.safetensors"), str(tmp_path / "comfy.safetensors")])
    comfy = load_file(str(tmp_path / "comfy.safetensors"))
    assert all(k.startswith("diffusion_model.layers.") for k in comfy)
    convert.run(["--reverse", str(tmp_path / "comfy.safetensors"), str(tmp_path / "back.safetensors")])
    back = load_file(str(tmp_path / "back.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    base = zimage_files["parts"].denoiser
    ours = copy.deepcopy(base)
    net = network_from_file(tmp_path / "lora.safetensors", ZIMAGE.adapter_roots(Parts(ours, None, [], [], {}, "z")))
    net.set_multiplier(1.0)
    x, tau, ctx, mask = _inputs()
    with torch.no_grad():
        want = M.forward(ours, x, tau, ctx, mask)
        assert (want - M.forward(base, x, tau, ctx, mask)).abs().max() > 1e-3  # the LoRA changes the output
        torch.testing.assert_close(M.forward(_comfy_merged(base, comfy), x, tau, ctx, mask), want, atol=1e-4,
                                   rtol=1e-4)  # fmt: skip
        for file in ("lora.safetensors", "comfy.safetensors"):
            diff = copy.deepcopy(base)
            state = ZImagePipeline.lora_state_dict(str(tmp_path / file))
            ZImagePipeline.load_lora_into_transformer(state[0] if isinstance(state, tuple) else state, transformer=diff)
            torch.testing.assert_close(M.forward(diff, x, tau, ctx, mask), want, atol=1e-4, rtol=1e-4)


def test_loss_falls(zimage_files, dataset, tmp_path):
    """zimage_train.py, ten epochs on the four images at a high learning rate: the last four steps' loss is under a
    quarter of the first four's (the tiny random DiT starts far off, so its whole fine-tune must learn)."""
    from _zimage_helpers import musubi_toml

    import zimage_train

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    argv = ["--dit", zimage_files["dit"], "--vae", zimage_files["vae"], "--text_encoder", zimage_files["text_encoder"],
            "--dataset_config", str(toml), "--mixed_precision", "no", "--timestep_sampling", "shift",
            "--discrete_flow_shift", "2.0", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
            "--max_data_loader_n_workers", "0", "--seed", "42", "--output_name", "ft", "--output_dir",
            str(tmp_path / "out"), "--max_train_epochs", "10"]  # fmt: skip
    result = zimage_train.run(argv)
    assert len(result.losses) == 20
    assert sum(result.losses[-4:]) < sum(result.losses[:4]) / 4


def test_lycoris_lokr_trains_and_merges(zimage_files, dataset, tmp_path):
    """LoKr through lycoris.kohya on the DiT's blocks (what Z-Image users ask for): its file applied live equals it
    merged into the weights."""
    from _zimage_helpers import doc_command, musubi_toml

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    extra = ["--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=4", "--network_dim", "4"]
    result = zimage_train_network.run(doc_command(zimage_files, toml, tmp_path / "out", *extra))
    sd = load_file(str(result.output))
    assert sd and all(k.startswith("lora_unet_") for k in sd) and any("lokr_w1" in k for k in sd)
    for k in [k for k in sd if "lokr_w" in k]:
        sd[k] = torch.randn_like(sd[k]) * 0.3
    save_file(sd, str(tmp_path / "lokr.safetensors"))
    base = zimage_files["parts"].denoiser
    live, merged = copy.deepcopy(base), copy.deepcopy(base)
    net = network_from_file(tmp_path / "lokr.safetensors", ZIMAGE.adapter_roots(Parts(live, None, [], [], {}, "z")))
    net.set_multiplier(1.0)
    other = network_from_file(tmp_path / "lokr.safetensors", ZIMAGE.adapter_roots(Parts(merged, None, [], [], {}, "z")))
    other.set_multiplier(1.0)
    other.merge_into_base()
    x, tau, ctx, mask = _inputs(5)
    with torch.no_grad():
        a, b = M.forward(live, x, tau, ctx, mask), M.forward(merged, x, tau, ctx, mask)
        assert (a - M.forward(base, x, tau, ctx, mask)).abs().max() > 1e-3
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_full_finetune_reads_back_and_resumes(zimage_files, dataset, tmp_path):
    """zimage_train.py with --full_bf16 and --mem_eff_save: the DiT file (diffusers names) reads back exactly, the
    weights moved, and --resume from a state at step 2 equals the uninterrupted 4-step run bit for bit."""
    from _zimage_helpers import musubi_toml

    import zimage_train
    from library.families.zimage.options import ZImageOptions

    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    argv = ["--dit", zimage_files["dit"], "--vae", zimage_files["vae"], "--text_encoder", zimage_files["text_encoder"],
            "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16", "--full_bf16", "--mem_eff_save",
            "--timestep_sampling", "shift", "--weighting_scheme", "none", "--discrete_flow_shift", "2.0",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-3", "--gradient_checkpointing",
            "--max_data_loader_n_workers", "0", "--seed", "42", "--output_name", "ft"]  # fmt: skip
    straight = zimage_train.run([*argv, "--output_dir", str(tmp_path / "s"), "--max_train_steps", "4"])
    zimage_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "2", "--save_state"])
    resumed = zimage_train.run([*argv, "--output_dir", str(tmp_path / "r"), "--max_train_steps", "4", "--resume",
                                str(tmp_path / "r" / "ft-state")])  # fmt: skip
    a, b = load_file(str(straight.output)), load_file(str(resumed.output))
    base = zimage_files["parts"].denoiser.state_dict()
    assert a.keys() == b.keys() == base.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k].float(), base[k].bfloat16().float()) for k in a)
    parts = ZIMAGE.load(straight.output, vae=zimage_files["vae"],
                        options=ZImageOptions(text_encoder=zimage_files["text_encoder"]))  # fmt: skip
    assert all(torch.equal(v, a[k].float()) for k, v in parts.denoiser.state_dict().items())


def test_generate_image_script(zimage_files, tmp_path):
    """zimage_generate_image.py's musubi-tuner line writes a PNG; --flow_shift changes the image of the same seed."""
    import numpy as np
    from PIL import Image

    import zimage_generate_image

    base = ["--dit", zimage_files["dit"], "--vae", zimage_files["vae"], "--text_encoder", zimage_files["text_encoder"],
            "--prompt", "a cat", "--image_size", "32", "32", "--infer_steps", "2", "--seed", "1", "--device", "cpu"]  # fmt: skip
    (a,) = zimage_generate_image.run([*base, "--save_path", str(tmp_path / "a")])
    (b,) = zimage_generate_image.run([*base, "--save_path", str(tmp_path / "b"), "--flow_shift", "5.0"])
    pa, pb = np.asarray(Image.open(a)), np.asarray(Image.open(b))
    assert pa.shape == (32, 32, 3) and not np.array_equal(pa, pb)


# every flag of musubi-tuner's zimage_train_network.py (its training/parser_common.py + zimage_setup_parser)
MUSUBI_FLAGS = """--async_upload --base_weights --base_weights_multiplier --block_swap_h2d_only --block_swap_ring_size
--blocks_to_swap --compile --compile_backend --compile_cache_size_limit --compile_dynamic --compile_fullgraph
--compile_mode --config_file --cuda_allow_tf32 --cuda_cudnn_benchmark --dataset_config --ddp_gradient_as_bucket_view
--ddp_static_graph --ddp_timeout --dim_from_weights --disable_numpy_memmap --discrete_flow_shift --dit --dynamo_backend
--dynamo_dynamic --dynamo_fullgraph --dynamo_mode --flash3 --flash_attn --flow_shift --fp8_base --full_bf16 --full_fp16
--gradient_accumulation_steps --gradient_checkpointing --gradient_checkpointing_cpu_offload --guidance_scale
--img_in_txt_in_offloading --learning_rate --logit_mean --logit_std --lr_scheduler --lr_warmup_steps
--max_data_loader_n_workers --max_grad_norm --max_timestep --max_train_epochs --max_train_steps --metadata_arch
--min_timestep --mixed_precision --mode_scale --network_alpha --network_args --network_dim --network_dropout
--network_module --network_weights --num_timestep_buckets --optimizer_args --optimizer_type --output_dir --output_name
--persistent_data_loader_workers --preserve_distribution_shape --resume --sage_attn --sample_at_first
--sample_every_n_epochs --sample_every_n_steps --sample_prompts --save_every_n_epochs --save_state --sdpa --seed
--show_timesteps --sigmoid_scale --split_attn --timestep_sampling --use_pinned_memory_for_block_swap --vae --vae_dtype
--weighting_scheme --xformers --fp8_scaled --text_encoder --fp8_llm --use_32bit_attention""".split()


def test_every_musubi_flag_is_read_or_refused_by_name():
    """Each flag of musubi-tuner's Z-Image LoRA script is one of ours; the musubi-only ones are refused by name."""
    from library.cli.parse import unsupported_problems
    from library.families.zimage.options import MUSUBI_ONLY

    parser = zimage_train_network.build_parser()
    assert [f for f in MUSUBI_FLAGS if f not in parser._option_string_actions] == []
    for flag, (kwargs, _) in MUSUBI_ONLY.items():
        value = [] if kwargs.get("action") == "store_true" else ["1"]
        args = parser.parse_args([flag, *value])
        assert any(p.startswith(f"{flag} is not supported yet") for p in unsupported_problems(parser, args)), flag
