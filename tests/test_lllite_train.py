"""sdxl_train_control_net_lllite.py end to end on the tiny SDXL, in-process: the LLLite docs' TOML example trains
and writes sd-scripts' file, a resumed run repeats the uninterrupted one bit for bit, and bad flags are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors import safe_open

import sdxl_train_control_net_lllite as script
from library.cli.problems import ConfigError
from library.families.registry import FAMILIES
from networks.lllite import find_targets, unet_root


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The demo's shapes as training images and their inverted greyscale as conditioning images."""
    from library.run.demo import make_example_dataset

    root = make_example_dataset(tmp_path_factory.mktemp("lllite")) / "10_sks shape"
    cond = root.parent / "cond"
    cond.mkdir()
    for img in sorted(root.glob("*.png")):
        ImageOps.invert(Image.open(img).convert("L")).convert("RGB").save(cond / img.name)
    return root, cond


def _files(tmp_path: Path, model: Path, pairs, **extra: object) -> Path:
    """The LLLite docs' config (CPU values where the docs name CUDA-only ones) and dataset TOML."""
    images, cond = pairs
    tmp_path.mkdir(parents=True, exist_ok=True)
    dataset = tmp_path / "dataset.toml"
    dataset.write_text(
        "[general]\nflip_aug = false\ncolor_aug = false\nresolution = [64, 64]\n\n[[datasets]]\nbatch_size = 2\n"
        f'enable_bucket = false\n\n[[datasets.subsets]]\nimage_dir = "{images}"\ncaption_extension = ".txt"\n'
        f'conditioning_data_dir = "{cond}"\n'
    )
    values = {
        "pretrained_model_name_or_path": str(model), "max_train_steps": 4, "max_data_loader_n_workers": 0,
        "seed": 42, "gradient_checkpointing": True, "optimizer_type": "adamw", "learning_rate": 2e-3,
        "output_dir": str(tmp_path / "out"), "output_name": "lllite", "save_model_as": "safetensors",
        "vae_batch_size": 4, "cache_latents": True, "cache_text_encoder_outputs": True, "network_dim": 4,
        "cond_emb_dim": 8, "dataset_config": str(dataset), **extra,
    }  # fmt: skip
    config = tmp_path / "config.toml"
    config.write_text("\n".join(f"{k} = {_toml(v)}" for k, v in values.items()) + "\n")
    return config


def _toml(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else repr(v))


def test_docs_example_trains_writes_sd_scripts_file_and_resumes_exactly(tiny_dir, tiny_parts, pairs, tmp_path):
    """The docs' config trains 2 steps into sd-scripts' file; 1 step + --resume repeats it bit for bit."""
    model = tiny_dir / "sdxl"
    prompts = tmp_path / "prompts.txt"
    guide = sorted(pairs[1].glob("*.png"))[0]
    common = "sks shape --w 64 --h 64 --d 3 --s 2 --l 1"
    prompts.write_text(f"{common} --cn {guide}\n{common}\n")  # samples 00 (with the image) and 01
    sampling = {"sample_prompts": str(prompts), "sample_every_n_steps": 2}
    full = script.run(["--config_file", str(_files(tmp_path / "a", model, pairs, max_train_steps=2, **sampling))])
    assert full is not None and full.output is not None
    samples = {p.stem.split("_")[2]: np.asarray(Image.open(p)) for p in (tmp_path / "a" / "out" / "sample").glob("*.png")
               if "grid" not in p.name}  # fmt: skip
    assert set(samples) == {"00", "01"}
    assert not np.array_equal(samples["00"], samples["01"])  # --cn: the trained LLLite sees the guide image
    with safe_open(str(full.output), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        ups = [f.get_tensor(k) for k in keys if k.endswith(".up.0.weight")]
    want = {t.name for t in find_targets(unet_root(FAMILIES["sdxl"].adapter_roots(tiny_parts["sdxl"])))}
    assert {k.split(".")[0] for k in keys} == want
    layers = ("conditioning1.0", "conditioning1.2", "conditioning1.4", "down.0", "mid.0", "up.0")
    assert {k.partition(".")[2] for k in keys} == {f"{m}.{p}" for m in layers for p in ("weight", "bias")}
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/control-net-lllite"
    assert any(u.abs().sum() > 0 for u in ups)  # the zero-initialised up projections trained

    half = _files(tmp_path / "b", model, pairs, max_train_steps=1, save_state=True)
    script.run(["--config_file", str(half)])
    state = next((tmp_path / "b" / "out").glob("*-state"))
    again = _files(tmp_path / "c", model, pairs, max_train_steps=2)
    resumed = script.run(["--config_file", str(again), "--resume", str(state)])
    a, b = (safe_open(str(r.output), "pt") for r in (full, resumed))
    for k in keys:
        assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    _gen_img_applies_the_file(model, full.output, sorted(pairs[1].glob("*.png")), tmp_path / "gen")


def _gen_img_applies_the_file(model: Path, lllite: Path, guides: list[Path], out: Path) -> None:
    """gen_img.py --control_net_lllite_models: the guide image changes the image; multiplier 0 is no LLLite."""
    import gen_img

    line = "sks shape --w 64 --h 64 --d 5 --s 2 --l 1\n"
    prompts = out / "p.txt"
    out.mkdir(parents=True)
    prompts.write_text(line)
    base = ["--ckpt", str(model), "--from_file", str(prompts), "--sampler", "euler", "--sequential_file_name"]
    net = ["--control_net_lllite_models", str(lllite)]

    def gen(name: str, *extra: str) -> list[np.ndarray]:
        return [np.asarray(Image.open(p)) for p in gen_img.run([*base, "--outdir", str(out / name), *extra])]

    plain = gen("plain")
    assert np.array_equal(gen("zero", *net, "--control_net_multipliers", "0", "--guide_image_path", str(guides[0]))[0],
                          plain[0])  # fmt: skip
    prompts.write_text(line * 2)  # images 0 and 1: the same seed, guide images 0 and 1
    with_a, with_b = gen("guided", *net, "--guide_image_path", str(guides[0]), str(guides[1]))
    assert not np.array_equal(with_a, with_b) and not np.array_equal(with_a, plain[0])


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--cond_emb_dim", "7"], "--cond_emb_dim: an even number"),
        (["--network_dropout", "1.5"], "--network_dropout: must be between 0 and 1"),
        (["--network_weights", "missing.safetensors"], "file not found"),
    ],
)
def test_bad_flags_are_refused_before_training(tiny_dir, pairs, tmp_path, flags, expect):
    with pytest.raises(ConfigError, match=expect):
        script.run(["--config_file", str(_files(tmp_path, tiny_dir / "sdxl", pairs)), *flags])
