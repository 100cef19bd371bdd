"""Pivotal tuning: train_network.py trains new token embeddings with the adapter (--embedding tok=word:n).

Oracles: diffusers (load_lora_weights + load_textual_inversion) and gen_img give the training sample's pixels from
the two files; the bundled copy equals the embedding file; a resumed run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _token_helpers import TOKEN, token_dataset
from PIL import Image

import gen_img
import train_network
from library.cli.parse import ConfigError
from library.files.weights import load_state_dict


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return token_dataset(tmp_path_factory.mktemp("data"))


def args_for(model, dataset, out, *extra, steps=4):
    return [
        "--pretrained_model_name_or_path", str(model),
        "--train_data_dir", str(dataset),
        "--caption_extension", ".txt",
        "--resolution", "64",
        "--output_dir", str(out),
        "--output_name", "pv",
        "--network_module", "networks.lora",
        "--network_dim", "4",
        "--learning_rate", "1e-2",
        "--embedding", f"{TOKEN}=shape:2",
        "--embedding_lr", "5e-2",
        "--train_batch_size", "2",
        "--max_train_steps", str(steps),
        "--max_data_loader_n_workers", "0",
        "--seed", "1",
        *extra,
    ]  # fmt: skip


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def test_lora_and_embedding_files_samples_and_diffusers(tiny_dir, dataset, tmp_path):
    from diffusers import DiffusionPipeline

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a photo of {TOKEN} --d 4 --n bad --w 64 --h 64 --s 3 --l 6\n")
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path, "--save_every_n_steps", "2", "--stop_embedding_training",
                    "2", "--bundle_embeddings", "--sample_prompts", str(prompts), "--sample_every_n_steps", "4",
                    "--sample_sampler", "ddim")  # fmt: skip
    result = train_network.run(argv)
    emb_file = tmp_path / "pv_embeddings" / f"{TOKEN}.safetensors"
    rows = load_state_dict(emb_file)[0]["emb_params"]
    at_2 = load_state_dict(tmp_path / "pv-step00000002_embeddings" / f"{TOKEN}.safetensors")[0]["emb_params"]
    assert rows.shape == (2, 32) and torch.equal(rows, at_2)  # --stop_embedding_training 2: kept as after step 2
    lora = load_state_dict(result.output)[0]
    assert torch.equal(lora.pop(f"bundle_emb.{TOKEN}.string_to_param.*"), rows)  # the bundled copy
    assert lora and all(k.startswith("lora_") for k in lora)
    lora_at_2 = load_state_dict(tmp_path / "pv-step00000002.safetensors")[0]
    assert any(not torch.equal(lora[k], lora_at_2[k]) for k in lora)  # the adapter kept training

    # our sample during training == gen_img with the two files == diffusers with the two files
    sample = next((tmp_path / "sample").glob("pv_000004_00_*.png"))
    ours = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", f"a photo of {TOKEN} --d 4 --n bad",
                         "--network_module", "networks.lora", "--network_weights", str(result.output),
                         "--textual_inversion_embeddings", str(emb_file), "--outdir", str(tmp_path / "img"),
                         "--steps", "3", "--W", "64", "--H", "64", "--scale", "6", "--sampler", "ddim"])  # fmt: skip
    assert _max_diff(Image.open(sample), Image.open(ours[0])) <= 1
    pipe = DiffusionPipeline.from_pretrained(str(tiny_dir / "sd1"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora, adapter_name="pv")  # diffusers rejects bundle_emb keys: the plain adapter
    pipe.load_textual_inversion(str(emb_file), token=TOKEN)
    theirs = pipe(f"a photo of {TOKEN}", negative_prompt="bad", height=64, width=64, num_inference_steps=3,
                  guidance_scale=6.0, generator=torch.Generator().manual_seed(4)).images[0]  # fmt: skip
    assert _max_diff(Image.open(ours[0]), theirs) <= 1


def test_resume_with_embeddings_is_exact_and_sdxl_writes_both_encoders(tiny_dir, dataset, tmp_path):
    common = ["--save_every_n_steps", "2", "--save_state", "--stop_embedding_training", "3", "--ema"]
    full = train_network.run(args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common))
    state = tmp_path / "a" / "pv-step00000002-state"
    resumed = train_network.run(args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common, "--resume", str(state)))
    assert resumed.losses == full.losses
    for name in ("pv.safetensors", f"pv_embeddings/{TOKEN}.safetensors", f"pv-ema_embeddings/{TOKEN}.safetensors"):
        a, b = load_state_dict(tmp_path / "a" / name)[0], load_state_dict(tmp_path / "b" / name)[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    xl = train_network.run(args_for(tiny_dir / "sdxl", dataset, tmp_path / "xl", steps=2), family_names=("sdxl",))
    tensors = load_state_dict(tmp_path / "xl" / "pv_embeddings" / f"{TOKEN}.safetensors")[0]
    assert {k: v.shape[0] for k, v in tensors.items()} == {"clip_l": 2, "clip_g": 2} and xl.steps == 2
    assert not any(k.startswith("bundle_emb") for k in load_state_dict(xl.output)[0])  # only with --bundle_embeddings


def test_rotation_removes_the_embeddings_of_removed_adapter_files(tiny_dir, dataset, tmp_path):
    """--save_last_n_steps deletes an old adapter file together with its _embeddings folder (epochs: test_saving)."""
    rotating = ["--save_every_n_steps", "1", "--save_last_n_steps", "2"]
    train_network.run(args_for(tiny_dir / "sd1", dataset, tmp_path, *rotating, steps=6))
    adapters = sorted(p.stem for p in tmp_path.glob("pv-*.safetensors"))
    folders = sorted(p.name.removesuffix("_embeddings") for p in tmp_path.glob("pv-*_embeddings"))
    assert adapters == ["pv-step00000003", "pv-step00000004", "pv-step00000005"], adapters
    assert folders == adapters and all((tmp_path / f"{a}_embeddings" / f"{TOKEN}.safetensors").is_file()
                                       for a in adapters)  # fmt: skip


def test_bad_embedding_flags(tiny_dir, dataset, tmp_path):
    with pytest.raises(ConfigError) as e:
        train_network.run(
            args_for(
                tiny_dir / "sd1",
                dataset,
                tmp_path,
                "--embedding",
                "nope",
                "--embedding",
                "x=y:0",
                "--stop_embedding_training",
                "0",
                "--network_args",
                "algo=lorra",
            )
        )
    msg = str(e.value)
    assert "--embedding 'nope'" in msg and "'x=y:0'" in msg and "--stop_embedding_training must be >= 1" in msg
    assert "lorra" in msg  # the network's problems are reported with them
    with pytest.raises(ValueError, match="already in the tokenizer's vocabulary"):
        train_network.run(args_for(tiny_dir / "sd1", dataset, tmp_path, "--embedding", "photo=cat"))
