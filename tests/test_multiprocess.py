"""Two processes on CPU (accelerate launch --multi_gpu, gloo): gradients are averaged so both processes hold the
same weights (the trainer checks this at the end and fails otherwise), and a resumed two-process run repeats the
uninterrupted one bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from library.weight_files import load_state_dict

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "train_network.py"), "--demo",
           "--demo_dir", str(tmp), "--output_dir", str(tmp / out), "--max_train_steps", "4", "--save_every_n_steps",
           "2", "--save_state", "--network_dropout", "0.1", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
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


_TI_WRAPPER = """
import sys, torch
sys.path.insert(0, {root!r})
import train_textual_inversion
from library.trainer import Trainer

finish = Trainer.finish

def finish_and_dump(self):
    torch.save([p.detach().clone() for p in self.params], {out!r} + f"/rows_{{self.acc.process_index}}.pt")
    return finish(self)

Trainer.finish = finish_and_dump
sys.exit(0 if train_textual_inversion.run(sys.argv[1:]).output else 1)
"""


def test_two_process_textual_inversion_ends_with_identical_embeddings(tmp_path):
    from library.demo import make_example_dataset, make_tiny_model

    model, data = make_tiny_model(tmp_path / "model", "sd1"), make_example_dataset(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    wrapper = tmp_path / "ti.py"
    wrapper.write_text(_TI_WRAPPER.format(root=str(ROOT), out=str(out)))
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(wrapper), "--pretrained_model_name_or_path",
           str(model), "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "64",
           "--output_dir", str(out), "--token_string", "shapetok", "--init_word", "shape", "--num_vectors_per_token",
           "2", "--use_object_template", "--learning_rate", "5e-2", "--max_train_steps", "4",
           "--max_data_loader_n_workers", "0", "--save_model_as", "safetensors"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "2 processes" in result.stdout
    rows = [torch.load(out / f"rows_{i}.pt", weights_only=True) for i in (0, 1)]
    assert len(rows[0]) == 1 and torch.equal(rows[0][0], rows[1][0])
    saved = load_state_dict(out / "shapetok.safetensors")[0]["emb_params"]
    assert torch.equal(saved, rows[0][0]) and not torch.equal(saved[0], saved[1])
