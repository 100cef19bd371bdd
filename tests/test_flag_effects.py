"""Flags that used to be accepted and ignored now act: --weighted_captions, --disable_mmap_load_safetensors,
--wandb_api_key; --fused_backward_pass is refused for adapters (it is for full fine-tuning)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import train_network
from library.cli.parse import ConfigError, parse_args
from library.files import weights as weight_files
from library.run.config import read_config
from library.run.trackers import TrackerConfig
from library.run.train_step import encode_captions


def _argv(model, dataset, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(out), "--network_module", "networks.lora",
            "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "1", *extra]  # fmt: skip


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_weighted_captions_weigh_the_tokens_like_the_sampler(tiny_parts, family):
    from library.families import get_family
    from library.text.prompt_weighting import encode_weighted

    fam, parts = get_family(family), tiny_parts[family]
    with torch.no_grad():
        plain = encode_captions(fam, parts, ["a (red:1.5) circle"], None, None)
        weighted = encode_captions(fam, parts, ["a (red:1.5) circle"], None, None, weighted=True)
        sampler = encode_weighted(fam, parts, ["a (red:1.5) circle"], max_embeddings_multiples=1)
        unweighted = encode_captions(fam, parts, ["a red circle"], None, None, weighted=True)
        reference = fam.encode_prompt(parts, ["a red circle"])
    assert not torch.allclose(plain.hidden_states, weighted.hidden_states)  # brackets are not plain text any more
    torch.testing.assert_close(weighted.hidden_states, sampler.hidden_states)
    torch.testing.assert_close(unweighted.hidden_states, reference.hidden_states)


def test_weighted_captions_reach_the_training_step(tiny_dir, dataset, tmp_path):
    """The same run with and without the flag on "(sks shape:1.3)" captions trains different weights."""
    for sub in dataset.iterdir():
        for txt in sub.glob("*.txt"):
            txt.write_text("(sks shape:1.4), " + txt.read_text().split(", ", 1)[1])
    a = train_network.run(_argv(tiny_dir / "sd1", dataset, tmp_path / "a"))
    b = train_network.run(_argv(tiny_dir / "sd1", dataset, tmp_path / "b", "--weighted_captions"))
    assert a.losses != b.losses


def test_disable_mmap_reads_the_whole_file(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    weight_files.save_state_dict({"a": torch.arange(6.0).reshape(2, 3)}, path, {"k": "v"})
    read = []
    real = type(path).read_bytes
    monkeypatch.setattr(type(path), "read_bytes", lambda self: read.append(self) or real(self))
    mapped = weight_files.load_state_dict(path)
    assert not read
    with weight_files.without_mmap():
        whole = weight_files.load_state_dict(path)
    assert read == [path] and whole[1] == mapped[1] == {"k": "v"}
    torch.testing.assert_close(whole[0]["a"], mapped[0]["a"])


def test_disable_mmap_flag_loads_the_model_without_mmap(tiny_parts, dataset, tmp_path, monkeypatch):
    seen = []
    real = weight_files._read_whole_safetensors
    monkeypatch.setattr(weight_files, "_read_whole_safetensors", lambda p, d: seen.append(p) or real(p, d))
    from library.families import get_family

    model = tmp_path / "sd1.safetensors"
    get_family("sd1").save(tiny_parts["sd1"], model)
    train_network.run(_argv(model, dataset, tmp_path, "--disable_mmap_load_safetensors"))
    assert seen == [model]


def test_wandb_api_key_logs_in_when_wandb_is_used(monkeypatch, caplog):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(login=lambda key: calls.append(key)))
    TrackerConfig(log_with="wandb", wandb_api_key="k123").login()
    assert calls == ["k123"]
    TrackerConfig(log_with="tensorboard", logging_dir="x", wandb_api_key="k123").login()
    assert calls == ["k123"] and "--wandb_api_key is not used" in caplog.text


def test_wandb_needs_its_package_before_training(tiny_dir, dataset, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    args = parse_args(train_network.build_parser(), _argv(tiny_dir / "sd1", dataset, tmp_path, "--log_with", "wandb"))
    with pytest.raises(ConfigError, match="--log_with wandb needs the wandb package"):
        read_config(args)


def test_fused_backward_pass_is_refused_clearly(tiny_dir, dataset, tmp_path):
    argv = _argv(tiny_dir / "sd1", dataset, tmp_path, "--optimizer_type", "Adafactor", "--fused_backward_pass")
    with pytest.raises(
        ConfigError, match=r"--fused_backward_pass steps the optimizer .* it works for full fine-tuning \(fine_tune.py"
    ):
        read_config(
            parse_args(train_network.build_parser(), argv), ("sd1", "sd2"), train_network.AdapterMethod.from_args
        )


def test_cpu_threads_one_for_tiny_models_and_omp_num_threads_honoured(monkeypatch):
    from library.device.host import choose_cpu_threads

    cpu = torch.device("cpu")
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert choose_cpu_threads(cpu, 5_000_000).startswith("CPU threads: 1 (a tiny model")
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what accelerate launch --num_cpu_threads_per_process 2 sets
        line = choose_cpu_threads(cpu, 5_000_000)
        assert torch.get_num_threads() == 2 and "from OMP_NUM_THREADS" in line
        monkeypatch.delenv("OMP_NUM_THREADS")
        line = choose_cpu_threads(cpu, 900_000_000, num_processes=2)
        assert torch.get_num_threads() == max(1, (__import__("os").cpu_count() or 1) // 2) and "shared by 2" in line
    finally:
        torch.set_num_threads(1)


def test_the_run_says_how_many_cpu_threads(tiny_dir, dataset, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    with caplog.at_level("INFO"):
        train_network.run(_argv(tiny_dir / "sd1", dataset, tmp_path))
    assert "CPU threads: 1 (a tiny model" in caplog.text and torch.get_num_threads() == 1


def test_tracker_flags_without_a_tracker_say_so(tiny_dir, dataset, tmp_path, caplog):
    """The guide's command passes --log_prefix without --logging_dir: accepted (as sd-scripts) and noted."""
    argv = _argv(tiny_dir / "sd1", dataset, tmp_path, "--log_prefix", "xl-locon", "--wandb_run_name", "r")
    with caplog.at_level("WARNING"):
        read_config(parse_args(train_network.build_parser(), argv))
    assert "--log_prefix is not used: no tracker logs this run" in caplog.text
    assert "--wandb_run_name is not used" in caplog.text
