"""The low-memory settings on the tiny models.

Frozen parts whose outputs are all cached are freed before training (library/run/run_setup.py release_unused_parts): the
run trains exactly as with them kept, and a freed part refuses to run with a clear message. ``--fp8_base`` stores
the frozen weights (UNet and text encoders) in float8 and trains the same with ``--gradient_checkpointing``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import train_network
from library.files.weights import load_state_dict
from library.run import setup as run_setup

CACHED = ["--cache_latents", "--cache_text_encoder_outputs", "--network_train_unet_only"]


def args_for(model, dataset, out, *extra):
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module", "networks.lora",
        "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3", "--train_batch_size", "2",
        "--max_train_steps", "3", "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
    ]  # fmt: skip


def run_keeping(monkeypatch, family, argv, release=True):
    """Train; returns (result, run) with ``run`` the session's Run (its parts as training left them)."""
    runs = []
    start = run_setup.start
    names = ("sdxl",) if family == "sdxl" else ("sd1", "sd2")
    with monkeypatch.context() as m:
        m.setattr(run_setup, "start", lambda cfg: runs.append(start(cfg)) or runs[-1])
        if not release:
            m.setattr(run_setup, "release_unused_parts", lambda run: [])
        return train_network.run(argv, family_names=names), runs[-1]


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_cached_parts_are_freed_and_training_is_unchanged(tiny_dir, dataset, tmp_path, monkeypatch, family):
    kept, kept_run = run_keeping(monkeypatch, family, args_for(tiny_dir / family, dataset, tmp_path / "a", *CACHED),
                                 release=False)  # fmt: skip
    freed, run = run_keeping(monkeypatch, family, args_for(tiny_dir / family, dataset, tmp_path / "b", *CACHED))
    assert freed.losses == kept.losses  # bitwise
    a, b = load_state_dict(kept.output)[0], load_state_dict(freed.output)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for module in (run.parts.vae, *run.parts.text_encoders):
        assert all(p.is_meta for p in module.parameters())  # the memory is given back
    assert not any(p.is_meta for p in kept_run.parts.vae.parameters())
    with pytest.raises(RuntimeError, match="freed after --cache_text_encoder_outputs"):
        run.parts.text_encoders[0](torch.zeros(1, 77, dtype=torch.long))


def test_only_what_is_cached_is_freed(tiny_dir, dataset, tmp_path, monkeypatch):
    _, run = run_keeping(monkeypatch, "sd1", args_for(tiny_dir / "sd1", dataset, tmp_path, "--cache_latents"))
    assert all(p.is_meta for p in run.parts.vae.parameters())
    assert not any(p.is_meta for p in run.parts.text_encoders[0].parameters())  # encodes captions every step


def test_sampling_keeps_every_part(tiny_dir, dataset, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2\n")
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "out", *CACHED, "--sample_prompts", str(prompts),
                    "--sample_every_n_steps", "3")  # fmt: skip
    result, run = run_keeping(monkeypatch, "sd1", argv)
    assert not any(p.is_meta for m in (run.parts.vae, *run.parts.text_encoders) for p in m.parameters())
    assert list((tmp_path / "out" / "sample").glob("*.png"))  # the sample needed the VAE and the text encoder
    assert result.steps == 3


def test_fp8_base_stores_fp8_and_checkpointing_trains_the_same(tiny_dir, dataset, tmp_path, monkeypatch):
    fp8 = ["--mixed_precision", "bf16", "--fp8_base"]
    plain, run = run_keeping(monkeypatch, "sd1", args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *fp8))
    te_linear = next(m for m in run.parts.text_encoders[0].modules() if isinstance(m, torch.nn.Linear))
    assert te_linear.weight.dtype == torch.float8_e4m3fn  # the text encoder is cast too, not only the UNet
    assert run.parts.denoiser.conv_in.weight.dtype == torch.float8_e4m3fn
    ckpt, _ = run_keeping(
        monkeypatch, "sd1", args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *fp8, "--gradient_checkpointing")
    )
    assert ckpt.losses == plain.losses  # the recomputed forward is the same forward
    a, b = load_state_dict(plain.output)[0], load_state_dict(ckpt.output)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lowram", [False, True])
def test_only_lowram_gives_freed_memory_back_on_cpu(tiny_dir, dataset, tmp_path, monkeypatch, lowram):
    """glibc's mmap threshold (a lower peak RSS, a slower step) is set by --lowram only: the default keeps glibc's
    own behaviour. The run stops once set up (model loaded); the settings are recorded, not made in this process."""
    calls = []
    monkeypatch.setattr(run_setup, "return_freed_memory", lambda device: calls.append("freed") or True)
    monkeypatch.setattr(run_setup, "reuse_heap_for_small_models", lambda device, n: calls.append("reuse") or True)

    class SetUp(Exception):
        pass

    def stop(run):
        raise SetUp  # model loaded, parameters counted

    monkeypatch.setattr(run_setup, "release_unused_parts", stop)
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path, *(["--lowram"] if lowram else []))
    with pytest.raises(SetUp):
        train_network.run(argv)
    assert calls == (["freed", "reuse"] if lowram else [])  # a tiny model then serves its small blocks from the heap


FREED = """
import sys, torch
from library.device.host import return_freed_memory, reuse_heap_for_small_models
if sys.argv[1] != "off":
    assert return_freed_memory(torch.device("cpu"))
    assert not reuse_heap_for_small_models(torch.device("cpu"), 10**9)  # a real-size model: no change
if sys.argv[1] == "tiny":
    assert reuse_heap_for_small_models(torch.device("cpu"), 10**6)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
del_first = torch.ones(1 << 22)  # 16 MiB freed: glibc's default now keeps smaller blocks in its heap
del del_first
blocks = [torch.ones(1 << 19) for _ in range(100)]  # 100 x 2 MiB, touched
keep = torch.ones(1 << 19)  # above them in the heap: no trimming from the top
before = rss()
del blocks
print((before - rss()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_activations_leave_the_process_on_cpu():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    given_back = {
        mode: float(
            subprocess.run(
                [sys.executable, "-c", FREED, mode], capture_output=True, text=True, env=env, check=True
            ).stdout
        )  # fmt: skip
        for mode in ("off", "on", "tiny")
    }
    # MiB of the 200 freed (100 blocks of 2 MiB): a tiny model's process keeps them for its next step
    assert given_back["on"] > 190 and given_back["off"] < 20 and given_back["tiny"] < 20, given_back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diffusers_folder_read_tensor_by_tensor_equals_diffusers(tiny_dir, dtype):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from library.families import get_family
    from library.files.weights import SafetensorsReader

    parts = get_family("sd1").load(tiny_dir / "sd1", dtype=dtype)
    for module, cls, sub in ((parts.denoiser, UNet2DConditionModel, "unet"), (parts.vae, AutoencoderKL, "vae")):
        ref = cls.from_pretrained(tiny_dir / "sd1", subfolder=sub, torch_dtype=dtype).state_dict()
        ours = module.state_dict()
        assert ours.keys() == ref.keys()
        assert all(ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]) for k in ref)
    reader = SafetensorsReader(next((tiny_dir / "sd1" / "unet").glob("*.safetensors")))
    key = "conv_in.weight"
    assert reader.shape(key) == reader[key].shape and len(reader) == len(list(reader))
