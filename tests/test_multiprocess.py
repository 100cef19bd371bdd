"""Two processes on CPU (accelerate launch --multi_gpu, gloo): gradients are averaged so both processes hold the
same weights (the trainer checks this at the end and fails otherwise), and a resumed two-process run repeats the
uninterrupted one bit for bit. That two processes train what one process with their total batch trains is checked
for adapters, embeddings and full models in tests/test_fine_tune_multiprocess.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from _launch import KEEP_PROCESS_GROUP, two_processes

from library.files.weights import load_state_dict

ROOT = Path(__file__).resolve().parents[1]

# the launched processes run train_network.py's command lines one after another (one start-up for both runs)
_RUNS = """
import json, sys
sys.path.insert(0, {root!r})
import train_network
{keep_group}
for argv in json.loads(open(sys.argv[1]).read()):
    train_network.run(argv)
"""


def _launch(tmp: Path, *runs: list[str]) -> subprocess.CompletedProcess:
    common = ["--demo", "--demo_dir", str(tmp), "--max_train_steps", "4", "--save_every_n_steps", "2",
              "--save_state", "--network_dropout", "0.1"]  # fmt: skip
    (tmp / "runs.json").write_text(json.dumps([[*common, *extra] for extra in runs]))
    (tmp / "runs.py").write_text(_RUNS.format(root=str(ROOT), keep_group=KEEP_PROCESS_GROUP))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU, also on a one-GPU machine
    cmd = [*two_processes(), str(tmp / "runs.py"), str(tmp / "runs.json")]
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_two_processes_agree_and_resume_exactly(tmp_path):
    state = tmp_path / "a" / "demo_lora-step00000002-state"
    both = _launch(tmp_path, ["--output_dir", str(tmp_path / "a")],
                   ["--output_dir", str(tmp_path / "b"), "--resume", str(state)])  # fmt: skip
    assert both.stdout.count("2 processes") == 2 and both.stdout.count("training finished") == 2
    assert both.stderr.count("INFO adapters:") == 2  # the main process logs; the other one does not repeat it
    assert (state / "rng_0.pt").exists() and (state / "rng_1.pt").exists()
    a = load_state_dict(tmp_path / "a" / "demo_lora.safetensors")[0]
    b = load_state_dict(tmp_path / "b" / "demo_lora.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
