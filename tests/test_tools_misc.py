"""check_lora_weights.py, tools/show_metadata.py, tools/convert_model.py, tools/resize_images_to_resolution.py and
tools/cache_latents.py on tiny inputs."""

from __future__ import annotations

import json

import pytest
import torch
from _data_utils import make_png
from _tools_helpers import write_adapter
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from library.cli.parse import ConfigError
from library.families import get_family
from library.families.sd import SD1
from library.files.weights import load_state_dict
from networks import check_lora_weights
from tools import (
    cache_latents,
    convert_diffusers20_original_sd,
    convert_model,
    resize_images_to_resolution,
    show_metadata,
)


def run(main, *argv):
    return main([str(a) for a in argv])


# ---------------------------------------------------------------------------------------------- check / metadata
def test_check_lora_weights_lists_tensors_and_finds_problems(tiny_parts, tmp_path, capsys):
    path = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    assert run(check_lora_weights.run, path) is True
    out = capsys.readouterr().out
    state = load_state_dict(path)[0]
    key = next(k for k in state if k.endswith("lora_up.weight"))
    v = state[key].abs()
    assert f"{key},{str(tuple(state[key].shape)).replace(', ', '-')},{float(v.mean())},{float(v.min())}" in out
    modules = {k.split(".")[0] for k in state}  # kohya keys: <module>.<tensor>
    tensors = sum(1 for k in state if not k.endswith("alpha"))
    assert f"number of LoRA modules: {len(modules)} ({tensors} tensors)" in out and len(modules) < tensors
    state[key] = torch.full_like(state[key], float("nan"))
    other = next(k for k in state if k.endswith("lora_up.weight") and k != key)
    state[other] = torch.zeros_like(state[other])
    save_file(state, str(tmp_path / "bad.safetensors"))
    assert run(check_lora_weights.run, tmp_path / "bad.safetensors") is False
    out = capsys.readouterr().out
    assert f"problem: {key}: contains NaN or Inf" in out and "1 module(s) have ΔW = 0" in out


def test_show_metadata_prints_sorted_json(tiny_parts, tmp_path, capsys):
    path = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2, metadata={"ss_tag_frequency": "{}"})
    assert run(show_metadata.run, "--model", path) is True
    printed = json.loads(capsys.readouterr().out)
    assert printed == load_state_dict(path)[1] and list(printed) == sorted(printed)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "bare.safetensors"))
    assert run(show_metadata.run, "--model", tmp_path / "bare.safetensors") is False
    with pytest.raises(FileNotFoundError, match="no such file"):
        run(show_metadata.run, "--model", tmp_path / "nope.safetensors")


# ------------------------------------------------------------------------------------------------------ convert
def _same_model(a, b, dtype=None):
    for ma, mb in [(a.denoiser, b.denoiser), (a.vae, b.vae), *zip(a.text_encoders, b.text_encoders)]:
        sa, sb = ma.state_dict(), mb.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            want = sa[k].to(dtype) if dtype is not None and sa[k].is_floating_point() else sa[k]
            torch.testing.assert_close(sb[k], want, atol=0, rtol=0, msg=k)


def test_convert_keeps_the_model_and_its_v_prediction(tiny_dir, tmp_path):
    sd2 = get_family("sd2")
    original = sd2.load(tiny_dir / "sd2")
    assert original.prediction_type == "v_prediction"
    single = run(convert_model.run, tiny_dir / "sd2", tmp_path / "sd2.safetensors")
    with safe_open(str(single), framework="pt") as f:
        assert "v_pred" in f.keys() and f.metadata()["modelspec.prediction_type"] == "v"
    _same_model(original, sd2.load(single))
    folder = run(convert_diffusers20_original_sd.run, single, tmp_path / "sd2_fp16", "--fp16")
    back = sd2.load(folder, dtype=torch.float16)
    assert back.prediction_type == "v_prediction"
    with safe_open(str(folder / "unet" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert f.get_slice(next(iter(f.keys()))).get_dtype() == "F16"
    _same_model(original, back, torch.float16)
    again = run(convert_model.run, folder, tmp_path / "again.ckpt", "--epoch", 3)  # fp16 in, fp16 out (no up-cast)
    state, meta = load_state_dict(again)
    assert meta["epoch"] == "3" and state["model.diffusion_model.input_blocks.0.0.weight"].dtype == torch.float16


def test_convert_marks_sdxl_v_prediction_on_request(tiny_dir, tmp_path):
    out = run(convert_model.run, tiny_dir / "sdxl", tmp_path / "xl.safetensors", "--v_parameterization", "--bf16")
    loaded = get_family("sdxl").load(out)
    assert loaded.prediction_type == "v_prediction"
    assert load_state_dict(out)[0]["model.diffusion_model.out.2.weight"].dtype == torch.bfloat16


def test_convert_refuses_contradictions(tiny_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        run(convert_model.run, tiny_dir / "sd1", tmp_path / "x.safetensors", "--fp16", "--bf16", "--variant", "fp16")
    assert "choose one save precision" in str(e.value) and "--variant is not supported" in str(e.value)
    with pytest.raises(ConfigError, match="is an sd1 model, not sd2"):
        run(convert_model.run, tiny_dir / "sd1", tmp_path / "x.safetensors", "--v2")


# ------------------------------------------------------------------------------------------------ resize images
def test_resize_images_to_resolution(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_png(src / "a.png", 300, 200)
    make_png(src / "small.png", 40, 30, seed=1)
    (src / "a.txt").write_text("a caption")
    written = run(resize_images_to_resolution.run, src, dst, "--max_resolution", "100x100,64x64", "--divisible_by", 8,
                  "--copy_associated_files", "--save_as_png")  # fmt: skip
    sizes = {p.name: Image.open(p).size for p in written}
    s = (10000 / 60000) ** 0.5
    w, h = int(300 * s), int(200 * s)
    assert sizes["a+100x100.png"] == (w - w % 8, h - h % 8)
    s = (4096 / 60000) ** 0.5
    w, h = int(300 * s), int(200 * s)
    assert sizes["a+64x64.png"] == (w - w % 8, h - h % 8)
    assert sizes["small+100x100.png"] == (40, 24)  # never enlarged, only cropped to multiples of 8
    assert (dst / "a.txt").read_text() == "a caption" and (dst / "a+64x64.txt").read_text() == "a caption"
    with pytest.raises(ConfigError, match="'100by100' is not WIDTHxHEIGHT"):
        run(resize_images_to_resolution.run, src, dst, "--max_resolution", "100by100")


# ------------------------------------------------------------------------------------------------- cache latents
def test_cache_latents_fills_the_cache_training_reads(tiny_dir, tmp_path, monkeypatch):
    import train_network
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    flags = ["--pretrained_model_name_or_path", tiny_dir / "sd1", "--train_data_dir", data, "--caption_extension",
             ".txt", "--resolution", "64", "--cache_dir", tmp_path / "cache", "--flip_aug"]  # fmt: skip
    calls = []
    original = type(SD1).encode_latents

    def counting(self, parts, pixels, generator=None):
        calls.append(pixels.shape[0])
        return original(self, parts, pixels, generator)

    monkeypatch.setattr(type(SD1), "encode_latents", counting)
    run_ = run(cache_latents.run, *flags)
    images = sum(len(d.records) for d in run_.plan.datasets)
    assert sum(calls) == 2 * images  # every image, flipped and not
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 2 * images
    calls.clear()
    run(train_network.run, *flags, "--cache_latents", "--output_dir", tmp_path / "out", "--network_module",
        "networks.lora", "--max_train_steps", 1, "--max_data_loader_n_workers", 0, "--seed", 1)  # fmt: skip
    assert calls == []  # training found every latent in the cache
