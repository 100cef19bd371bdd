"""gen_img.py with adapters: a kohya LoRA against diffusers' load_lora_weights, several LoRAs against diffusers'
set_adapters, other algorithms merged vs live, and per-prompt multipliers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

import gen_img

pytest.importorskip("networks.inject", reason="needs the networks package (networks branch)")

BASE = ["--steps", "3", "--W", "64", "--H", "64", "--scale", "6"]
PROMPT = "a red cat --n blurry --d 21"


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def _pipe(tiny_dir, name):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_dir / name), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _theirs(pipe):
    return pipe("a red cat", negative_prompt="blurry", height=64, width=64, num_inference_steps=3, guidance_scale=6.0,
                generator=torch.Generator().manual_seed(21)).images[0]  # fmt: skip


def _kohya_lora(parts, family, path, seed, rank=4, alpha=2.0):
    """A kohya LoRA file written by hand (independent of our networks code): every Linear of the UNet's attention
    blocks and every attention/MLP projection of the text encoders, named by the family's kohya prefixes."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for prefix, root, rename, _ in family.adapter_roots(parts):
        for path_, module in root.named_modules():
            wanted = ("attn" in path_ or "ff.net" in path_) if prefix == "lora_unet" else ("layers.0." in path_)
            if not isinstance(module, nn.Linear) or not wanted:
                continue
            name = f"{prefix}_{rename(path_).replace('.', '_')}"
            out_f, in_f = module.weight.shape
            tensors[f"{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
            tensors[f"{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("family_name", ["sd1", "sdxl"])
def test_lora_equals_diffusers_load_lora_weights(tiny_parts, tiny_dir, tmp_path, family_name):
    from library.families import get_family

    lora = _kohya_lora(tiny_parts[family_name], get_family(family_name), tmp_path / "lora.safetensors", seed=1)
    argv = ["--ckpt", str(tiny_dir / family_name), "--prompt", PROMPT, *BASE]
    ours = gen_img.run([*argv, "--outdir", str(tmp_path / "a"), "--network_module", "networks.lora",
                         "--network_weights", str(lora), "--network_mul", "1.0"])  # fmt: skip
    base = gen_img.run([*argv, "--outdir", str(tmp_path / "b")])
    pipe = _pipe(tiny_dir, family_name)
    pipe.load_lora_weights(str(lora))
    theirs = _theirs(pipe)
    assert _max_diff(Image.open(ours[0]), theirs) <= 1
    assert _max_diff(Image.open(ours[0]), Image.open(base[0])) > 8  # the LoRA matters


def test_several_loras_equal_diffusers_set_adapters(tiny_parts, tiny_dir, tmp_path):
    from library.families import get_family

    family, parts = get_family("sd1"), tiny_parts["sd1"]
    a = _kohya_lora(parts, family, tmp_path / "a.safetensors", seed=2)
    b = _kohya_lora(parts, family, tmp_path / "b.safetensors", seed=3, rank=2, alpha=1.0)
    ours = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", PROMPT, *BASE, "--outdir", str(tmp_path),
                         "--network_module", "networks.lora", "lycoris.kohya", "--network_weights", str(a), str(b),
                         "--network_mul", "0.5", "0.8"])  # fmt: skip
    pipe = _pipe(tiny_dir, "sd1")
    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 0.8])
    assert _max_diff(Image.open(ours[0]), _theirs(pipe)) <= 1


def _our_network_file(tiny_parts, family_name, algo, path):
    """A LoHa / LoKr / DoRA file written by our networks code, with non-zero deltas."""
    import copy

    from library.families import get_family
    from networks import NetworkConfig, inject

    parts = copy.deepcopy(tiny_parts[family_name])
    args = ["algo=" + algo] if algo != "dora" else ["algo=lora", "dora_wd=True"]
    cfg = NetworkConfig.from_args(_network_args(["--network_module", "lycoris.kohya", "--network_dim", "4",
                                                 "--network_alpha", "2", "--network_args", *args]))  # fmt: skip
    network = inject(cfg, get_family(family_name).adapter_roots(parts))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    network.save(path)
    return path


def _network_args(argv):
    import argparse

    from networks import add_network_args

    parser = argparse.ArgumentParser()
    add_network_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("algo", ["loha", "lokr", "dora"])
def test_other_algorithms_live_equal_merged(tiny_parts, tiny_dir, tmp_path, algo):
    path = _our_network_file(tiny_parts, "sd1", algo, tmp_path / f"{algo}.safetensors")
    argv = ["--ckpt", str(tiny_dir / "sd1"), "--prompt", PROMPT, *BASE, "--network_module", "lycoris.kohya",
            "--network_weights", str(path), "--network_mul", "0.7"]  # fmt: skip
    live = gen_img.run([*argv, "--outdir", str(tmp_path / "live")])
    merged = gen_img.run([*argv, "--outdir", str(tmp_path / "merged"), "--network_merge"])
    base = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", PROMPT, *BASE, "--outdir", str(tmp_path / "b")])
    assert _max_diff(Image.open(live[0]), Image.open(merged[0])) <= 1
    assert _max_diff(Image.open(live[0]), Image.open(base[0])) > 0


def test_per_prompt_multiplier(tiny_parts, tiny_dir, tmp_path):
    from library.families import get_family

    lora = _kohya_lora(tiny_parts["sd1"], get_family("sd1"), tmp_path / "l.safetensors", seed=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{PROMPT} --am 0\n{PROMPT}\n{PROMPT} --am 0.5\n")
    paths = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--from_file", str(prompts), *BASE,
                          "--outdir", str(tmp_path / "o"), "--network_module", "networks.lora",
                          "--network_weights", str(lora), "--batch_size", "3"])  # fmt: skip
    base = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", PROMPT, *BASE, "--outdir", str(tmp_path / "b")])
    half = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", PROMPT, *BASE, "--outdir", str(tmp_path / "h"),
                         "--network_module", "networks.lora", "--network_weights", str(lora), "--network_mul", "0.5"])  # fmt: skip
    images = [Image.open(p) for p in paths]
    assert _max_diff(images[0], Image.open(base[0])) <= 1  # --am 0: the base model
    assert _max_diff(images[2], Image.open(half[0])) <= 1
    assert _max_diff(images[1], images[0]) > 0 and images[2].text["network-multipliers"] == "0.5"
    with pytest.raises(ValueError, match="needs a single unmerged network"):
        gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--from_file", str(prompts), *BASE, "--network_merge",
                      "--outdir", str(tmp_path / "x"), "--network_module", "networks.lora",
                      "--network_weights", str(lora)])  # fmt: skip
