"""Two processes on CPU (accelerate launch --multi_gpu, gloo): gradients are averaged so both processes hold the
same weights (the trainer checks this at the end and fails otherwise), and a resumed two-process run repeats the
uninterrupted one bit for bit. That two processes train what one process with their total batch trains is checked
for adapters, embeddings and full models in tests/test_fine_tune_multiprocess.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from _launch import two_processes

from library.files.weights import load_state_dict

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*two_processes(), str(ROOT / "train_network.py"), "--demo",
           "--demo_dir", str(tmp), "--output_dir", str(tmp / out), "--max_train_steps", "4", "--save_every_n_steps",
           "2", "--save_state", "--network_dropout", "0.1", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU, also on a one-GPU machine
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_two_processes_agree_and_resume_exactly(tmp_path):
    first = _launch(tmp_path, "a")
    assert "2 processes" in first.stdout and "training finished" in first.stdout
    assert first.stderr.count("INFO adapters:") == 1  # the main process logs; the other one does not repeat it
    state = tmp_path / "a" / "demo_lora-step00000002-state"
    assert (state / "rng_0.pt").exists() and (state / "rng_1.pt").exists()
    _launch(tmp_path, "b", "--resume", str(state))
    a = load_state_dict(tmp_path / "a" / "demo_lora.safetensors")[0]
    b = load_state_dict(tmp_path / "b" / "demo_lora.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
