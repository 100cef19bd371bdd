"""Two processes (accelerate launch --multi_gpu, gloo on the CPU) stop together: a NaN loss on one process, Ctrl-C
on one process and a failed save on the main one each end both processes with one message and the usual files
kept, instead of leaving the others blocked in the next collective (which would hang here until the timeout).
Without --seed both processes use rank 0's seed, and a sampling round is shared between them."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from _launch import two_processes

from library.files.weights import load_state_dict

ROOT = Path(__file__).resolve().parents[1]

_WRAPPER = """
import json, os, signal, sys, torch
sys.path.insert(0, {root!r})
import train_network
import library.sampling.training as sampling_training
from library.run import loop, setup as run_setup
from library.run.trainer import Trainer
from library.files.weights import save_error

scenario, out = {scenario!r}, {out!r}
rank = int(os.environ["RANK"])
start, batch_loss, step_done, write = run_setup.start, loop.batch_loss, Trainer.step_done, Trainer._write_model
one = sampling_training._one
calls = {{"batches": 0, "sampled": 0}}

def started(cfg):
    run = start(cfg)
    with open(f"{{out}}/seed_{{rank}}.txt", "w") as f:
        f.write(str(run.cfg.run.seed))
    return run

def loss(m, batch, generator, **kw):
    calls["batches"] += 1
    value = batch_loss(m, batch, generator, **kw)
    if scenario == "nan" and rank == 1 and calls["batches"] == 3:
        value = value * float("nan")
    return value

def done(self, value):
    step_done(self, value)
    if scenario == "interrupt" and rank == 1 and self.step == 2:
        os.kill(os.getpid(), signal.SIGINT)

def written(self, path, *, step=None, epoch=None):
    if scenario == "save" and step == 2:
        raise save_error(path, OSError(28, "No space left on device"))
    return write(self, path, step=step, epoch=epoch)

def sampled(*args, **kwargs):
    calls["sampled"] += 1
    with open(f"{{out}}/sampled_{{rank}}.txt", "a") as f:
        f.write(args[3].prompt + "\\n")
    return one(*args, **kwargs)

run_setup.start, loop.batch_loss, Trainer.step_done, Trainer._write_model = started, loss, done, written
sampling_training._one = sampled
sys.exit(train_network.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from library.run.demo import make_example_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("inputs")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"prompt {i} --w 64 --h 64 --s 2 --d {i}\n" for i in range(3)))
    return make_tiny_model(root / "model", "sd1"), make_example_dataset(root / "data"), prompts


def launch(tmp: Path, scenario: str, inputs, *extra: str) -> subprocess.CompletedProcess:
    model, data, prompts = inputs
    out = tmp / scenario
    out.mkdir()
    wrapper = tmp / f"{scenario}.py"
    wrapper.write_text(_WRAPPER.format(root=str(ROOT), scenario=scenario, out=str(out)))
    cmd = [*two_processes(quiet=True), str(wrapper), "--pretrained_model_name_or_path", str(model),
           "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "64", "--output_dir",
           str(out), "--output_name", "t", "--network_module", "networks.lora", "--max_train_steps", "5",
           "--save_every_n_steps", "1", "--max_data_loader_n_workers", "0", "--save_model_as", "safetensors",
           "--sample_prompts", str(prompts), "--sample_every_n_steps", "4", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a process left waiting in a collective would block until gloo's 30-minute timeout: fail long before
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def finite_file(path: Path) -> bool:
    return path.is_file() and all(torch.isfinite(t).all() for t in load_state_dict(path)[0].values())


def test_a_nan_on_one_process_stops_both(tmp_path, inputs):
    result = launch(tmp_path, "nan", inputs, "--seed", "3")
    out = tmp_path / "nan"
    assert result.returncode != 0
    assert result.stderr.count("error: the loss became nan at step 3") == 1, result.stderr[-3000:]
    assert finite_file(out / "t-step00000001.safetensors") and finite_file(out / "t-step00000002.safetensors")
    assert not (out / "t-step00000003.safetensors").exists() and not (out / "t.safetensors").exists()


def test_ctrl_c_on_one_process_stops_both_with_a_state_and_sampling_is_shared(tmp_path, inputs):
    """Without --seed: both processes run with one seed. The sampling round at step 2 is shared: process 0
    generates prompts 0 and 2, process 1 prompt 1, and process 0 saves them all. Process 1 is interrupted after
    step 2: both finish step 3 (the next time they compare notes), write one resumable state and stop."""
    result = launch(tmp_path, "interrupt", inputs, "--sample_every_n_steps", "2")
    out = tmp_path / "interrupt"
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("another process was interrupted") == 1
    seeds = {(out / f"seed_{i}.txt").read_text() for i in (0, 1)}
    assert len(seeds) == 1, seeds
    state = out / "t-step00000003-state"
    assert (state / "rng_0.pt").is_file() and (state / "rng_1.pt").is_file()
    assert not (out / "t-step00000004.safetensors").exists()
    shares = [(out / f"sampled_{i}.txt").read_text().split("\n")[:-1] for i in (0, 1)]
    assert shares == [["prompt 0", "prompt 2"], ["prompt 1"]]
    assert len(list((out / "sample").glob("*.png"))) == 4  # all three, and the grid, written by process 0


def test_a_failed_save_stops_both_and_leaves_a_resumable_state(tmp_path, inputs):
    result = launch(tmp_path, "save", inputs, "--seed", "3")
    out = tmp_path / "save"
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1 and "No space left on device" in result.stderr
    assert finite_file(out / "t-step00000001.safetensors")
    state = out / "t-step00000002-state"
    assert (state / "rng_0.pt").is_file() and (state / "rng_1.pt").is_file()
    assert not math.isnan(float((out / "seed_0.txt").read_text()))
