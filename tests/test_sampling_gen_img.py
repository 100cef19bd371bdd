"""gen_img.py end to end on the tiny models, textual inversion against diffusers, flags and their errors."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from PIL import Image

import gen_img
from library.cli.parse import ConfigError

BASE = ["--steps", "3", "--W", "64", "--H", "64", "--scale", "6"]


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def _pipe(tiny_dir, name):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_dir / name), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_prompt_file_images_and_chunks(tiny_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("# two prompts\na red cat --d 11 --n blurry\na (dog:1.3) --w 72 --ss euler_a --f dog.png\n")
    out = tmp_path / "out"
    paths = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--from_file", str(prompts), "--outdir", str(out), *BASE])
    assert [p.parent for p in paths] == [out, out] and paths[1].name == "dog.png"
    assert re.fullmatch(r"im_\d{14}_000_11\.png", paths[0].name)
    cat, dog = Image.open(paths[0]), Image.open(paths[1])
    assert cat.size == (64, 64) and dog.size == (72, 64)
    assert cat.text["prompt"] == "a red cat" and cat.text["negative-prompt"] == "blurry" and cat.text["seed"] == "11"
    assert cat.text["steps"] == "3" and cat.text["scale"] == "6.0" and cat.text["sampler"] == "ddim"
    assert dog.text["sampler"] == "euler_a" and dog.text["model"] == "sd1"
    again = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a red cat --d 11 --n blurry",
                          "--outdir", str(out), *BASE])  # fmt: skip
    assert np.array_equal(np.asarray(Image.open(again[0])), np.asarray(cat))  # same seed: same pixels


def test_seeds_images_per_prompt_and_batches(tiny_dir, tmp_path):
    argv = ["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a cat", "--seed", "9", "--images_per_prompt", "3",
            "--sequential_file_name", *BASE]  # fmt: skip
    one = gen_img.run([*argv, "--outdir", str(tmp_path / "a")])
    batched = gen_img.run([*argv, "--outdir", str(tmp_path / "b"), "--batch_size", "2"])
    assert [p.name for p in one] == ["im_000000.png", "im_000001.png", "im_000002.png"]
    seeds = [Image.open(p).text["seed"] for p in one]
    assert len(set(seeds)) == 3 and seeds == [Image.open(p).text["seed"] for p in batched]
    assert all(_max_diff(Image.open(a), Image.open(b)) <= 1 for a, b in zip(one, batched))
    single = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a cat", "--seed", "9",
                           "--outdir", str(tmp_path / "c"), *BASE])  # fmt: skip
    assert Image.open(single[0]).text["seed"] == "9"  # one image: the seed itself, as sd-scripts


@pytest.mark.parametrize("family_name", ["sd1", "sdxl"])
def test_textual_inversion_rows_equal_diffusers(tiny_parts, tiny_dir, tmp_path, family_name):
    from safetensors.torch import save_file

    from library.families import get_family
    from library.text.textual_inversion import add_embedding

    family, parts = get_family(family_name), copy.deepcopy(tiny_parts[family_name])
    widths = [te.get_input_embeddings().weight.shape[1] for te in parts.text_encoders]
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(2, w, generator=g) for k, w in zip(family.ti_embedding_keys, widths)}
    path = tmp_path / "mychar.safetensors"
    save_file(tensors, str(path))
    ids = add_embedding(family, parts, path)
    pipe = _pipe(tiny_dir, family_name)
    pairs = [("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")][: len(widths)]
    for (te_name, tok_name), key, our_ids, te in zip(pairs, family.ti_embedding_keys, ids, parts.text_encoders):
        theirs_te, theirs_tok = getattr(pipe, te_name), getattr(pipe, tok_name)
        pipe.load_textual_inversion(tensors[key], token="mychar", text_encoder=theirs_te, tokenizer=theirs_tok)
        their_ids = theirs_tok.convert_tokens_to_ids(["mychar", "mychar_1"])
        assert their_ids == our_ids
        ours = te.get_input_embeddings().weight[our_ids]
        assert torch.equal(ours, theirs_te.get_input_embeddings().weight[their_ids])
        assert torch.equal(ours, tensors[key])


def test_textual_inversion_image_equals_diffusers(tiny_dir, tmp_path):
    """A1111 .pt embedding used in a prompt: gen_img vs diffusers with load_textual_inversion, same seed."""
    path = tmp_path / "mychar.pt"
    torch.save({"string_to_param": {"*": torch.randn(3, 32) * 0.5}, "name": "mychar", "step": 100}, path)
    out = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a photo of mychar --d 4 --n bad",
                        "--textual_inversion_embeddings", str(path), "--outdir", str(tmp_path), *BASE])  # fmt: skip
    pipe = _pipe(tiny_dir, "sd1")
    pipe.load_textual_inversion(str(path))
    theirs = pipe("a photo of mychar", negative_prompt="bad", height=64, width=64, num_inference_steps=3,
                  guidance_scale=6.0, generator=torch.Generator().manual_seed(4)).images[0]  # fmt: skip
    assert _max_diff(Image.open(out[0]), theirs) <= 1
    plain = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a photo of mychar --d 4 --n bad",
                          "--outdir", str(tmp_path / "plain"), *BASE])  # fmt: skip
    assert _max_diff(Image.open(out[0]), Image.open(plain[0])) > 0  # the embedding changed the image


def test_embedding_errors(tiny_parts, tmp_path):
    from safetensors.torch import save_file

    from library.families import get_family
    from library.text.textual_inversion import add_embedding, read_embedding

    save_file({"clip_l": torch.zeros(1, 32), "clip_g": torch.zeros(1, 32)}, str(tmp_path / "xl.safetensors"))
    with pytest.raises(ValueError, match="a sd1 embedding needs one tensor"):
        read_embedding(tmp_path / "xl.safetensors", get_family("sd1"))
    save_file({"emb_params": torch.zeros(1, 16)}, str(tmp_path / "narrow.safetensors"))
    with pytest.raises(ValueError, match="width 16, but text encoder 1 .* has width 32"):
        add_embedding(get_family("sd1"), copy.deepcopy(tiny_parts["sd1"]), tmp_path / "narrow.safetensors")


def test_bad_flags_reported_at_once(tiny_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        gen_img.run(["--ckpt", str(tmp_path / "missing"), "--prompt", "a --w 50", "--W", "100",
                      "--network_module", "networks.lora", "--textual_inversion_embeddings", "nope.pt"])  # fmt: skip
    text = str(e.value)
    assert "--ckpt" in text and "--prompt: --w: 50 must be a multiple of 8" in text and "--W 100" in text
    assert "--network_module has 1 value(s) but --network_weights has 0" in text and "nope.pt: no such file" in text
    with pytest.raises(ConfigError, match="--highres_fix_scale is not supported"):
        gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a", "--highres_fix_scale", "1.5"])
    with pytest.raises(ConfigError, match="exactly one of them"):
        gen_img.run(["--ckpt", str(tiny_dir / "sd1")])
