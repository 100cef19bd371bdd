"""The host memory check before the model load (library/run/load_memory.py): a run on a host whose available memory
is below what the load holds warns once, before any weight is read, naming the files and their bytes; a host with
room does not warn; the bound reads the files' headers only.

Oracles: the tensor bytes of the tiny model's files counted here independently (safetensors' own reader: every
tensor's element count at the run's load dtype); a file cut right after its header.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import train_network
from library.families.registry import get_family
from library.run import load_memory
from library.run.memory_watch import GiB, HostMemory


@pytest.fixture(scope="module")
def model(tiny_dir):
    return tiny_dir / "sd1"


def _argv(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module",
            "networks.lora", "--network_dim", "2", "--max_train_steps", "1", "--max_data_loader_n_workers", "0",
            "--seed", "1", *extra]  # fmt: skip


def _tensor_bytes(files: list[Path], element_size: int) -> int:
    """Every tensor's element count (safetensors' reader) at ``element_size`` bytes: the oracle of the bound."""
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                total += torch.Size(f.get_slice(key).get_shape()).numel() * element_size
    return total


def _load_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "before loading" in r.getMessage()
    ]


def test_a_host_short_of_memory_warns_once_before_the_load(model, dataset, tmp_path, monkeypatch, caplog):
    """Available memory faked at 512 MiB (below the 544 MiB a started run takes before its load): one warning before
    loading, naming every weight file of the folder; the total equals the tensor bytes at bf16 (every part of a bf16 LoRA run loads
    in bf16); the trackers get it with the first step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loaded = []
    monkeypatch.setattr(load_memory, "host_memory", lambda: HostMemory(GiB // 2, 32 * GiB, 0))
    monkeypatch.setattr(get_family("sd1"), "load", _recording(get_family("sd1").load, loaded, caplog))
    logs = tmp_path / "logs"
    result = train_network.run(_argv(model, dataset, tmp_path / "out", "--mixed_precision", "bf16",
                                     "--logging_dir", str(logs)))  # fmt: skip
    assert result.steps == 1
    (message,) = _load_warnings(caplog)
    assert loaded == [1]  # warned before the load
    files = sorted(model.rglob("*.safetensors"))
    need = _tensor_bytes(files, 2)
    assert f"holds at least {need / 2**20:.2f} MiB on the host" in message
    assert all(f"{f.parent.name}/{f.name}" in message for f in files) and "0.50 of 32.0 GiB are available" in message
    assert "out-of-memory killer" in message and "--plan_memory --ram GB" in message
    assert "--mixed_precision" not in message  # given already
    found = load_memory.load_bound(load_memory.files_read(get_family("sd1"), model, None, None), [torch.bfloat16])
    assert sum(f.bytes for f in found) == need
    events = EventAccumulator(str(next(logs.rglob("events.out.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("memory/warning")]
    assert [e.step for e in events.Tensors(tag)] == [1]


def _recording(load, loaded, caplog):
    def recorded(*args, **kwargs):
        loaded.append(len(_load_warnings(caplog)))
        return load(*args, **kwargs)

    return recorded


def test_the_warning_comes_only_when_the_load_and_the_libraries_exceed_what_is_available(tmp_path):
    found = [load_memory.FileBytes(tmp_path / "a.safetensors", 3 * GiB)]
    fits = HostMemory(3 * GiB + load_memory.OVERHEAD, 64 * GiB, 0)
    assert load_memory.warning(found, fits, None, "") is None
    short = HostMemory(fits.available - 1, 64 * GiB, 0)
    assert "3.00 GiB" in load_memory.warning(found, short, 4 * GiB, "") and "4.0 GiB of swap free" in (
        load_memory.warning(found, short, 4 * GiB, "")
    )


def test_the_bound_reads_the_headers_only(model, tmp_path):
    """The tiny model's folder with every file cut right after its header: the same bound (fp32 and bf16); the
    dtype variant beside its plain file is not read; a pickle counts its size."""
    cut = tmp_path / "cut"
    for file in model.rglob("*"):
        target = cut / file.relative_to(model)
        if file.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        data = file.read_bytes()
        size = 8 + int.from_bytes(data[:8], "little") if file.suffix == ".safetensors" else len(data)
        target.write_bytes(data[:size])
    save_file({"w": torch.zeros(4, dtype=torch.float16)}, cut / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    family = get_family("sd1")
    for dtype in (torch.float32, torch.bfloat16):
        full = load_memory.load_bound(load_memory.files_read(family, model, None, None), [dtype, torch.float32])
        short = load_memory.load_bound(load_memory.files_read(family, cut, None, None), [dtype, torch.float32])
        assert [f.bytes for f in full] == [f.bytes for f in short]
        assert sum(f.bytes for f in full) == _tensor_bytes(sorted(model.rglob("*.safetensors")), dtype.itemsize)
    (tmp_path / "v.ckpt").write_bytes(b"x" * 1000)
    assert load_memory.load_bound(load_memory.weight_files([tmp_path / "v.ckpt"]), [torch.float16])[0].bytes == 1000


def test_a_plan_and_lowram_on_a_gpu_skip_the_check(model, tmp_path):
    """The same short host: warned; inside a --plan_memory plan (which counts the host itself) and with --lowram on
    a GPU (each weight goes to the card as it is read) nothing is checked."""
    from types import SimpleNamespace

    from library.cli import plan_flags
    from library.run.memory_watch import WatchConfig

    def check(lowram: bool, device: str) -> str | None:
        cfg = SimpleNamespace(memory_watch=WatchConfig(), run=SimpleNamespace(lowram=lowram), family=get_family("sd1"),
                              model=SimpleNamespace(path=model, vae=None), options=None, args={})  # fmt: skip
        acc = SimpleNamespace(device=SimpleNamespace(type=device), is_local_main_process=True)
        return load_memory.check_before_load(cfg, acc, [torch.float32], lambda: HostMemory(0, 8 * GiB, 0))

    assert "--lowram" in check(False, "cuda") and "--lowram" not in check(False, "cpu")
    assert check(True, "cuda") is None and check(True, "cpu") is not None
    with plan_flags.planning(tmp_path):
        assert check(False, "cuda") is None
