"""Two processes (accelerate launch --multi_gpu, gloo on the CPU): gradients are averaged so both processes hold the
same weights (the trainer checks this at the end and fails otherwise), and a resumed two-process run repeats the
uninterrupted one bit for bit. They stop together: a NaN loss on one process, Ctrl-C on one process and a failed save
on the main one each end both processes with one message and the usual files kept, instead of leaving the others
blocked in the next collective (which would hang here until the timeout). Without --seed both processes use rank 0's
seed, and a sampling round is shared between them. That two processes train what one process with their total batch
trains is checked for adapters, embeddings and full models in tests/test_fine_tune_multiprocess.py.

The five runs share one launch (one after another in the same two processes, as a user's five commands would be
five launches: what is checked is each run's own output, split at a marker line, and its exit status per process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from _launch import KEEP_PROCESS_GROUP, two_processes

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

now = {{}}
rank = int(os.environ["RANK"])
start, batch_loss, step_done, write = run_setup.start, loop.batch_loss, Trainer.step_done, Trainer._write_model
one = sampling_training._one

def started(cfg):
    run = start(cfg)
    with open(f"{{now['out']}}/seed_{{rank}}.txt", "w") as f:
        f.write(str(run.cfg.run.seed))
    return run

def loss(m, batch, generator, **kw):
    now["batches"] += 1
    value = batch_loss(m, batch, generator, **kw)
    if now["scenario"] == "nan" and rank == 1 and now["batches"] == 3:
        value = value * float("nan")
    return value

def done(self, value):
    step_done(self, value)
    if now["scenario"] == "interrupt" and rank == 1 and self.step == 2:
        os.kill(os.getpid(), signal.SIGINT)

def written(self, path, *, step=None, epoch=None):
    if now["scenario"] == "save" and step == 2:
        raise save_error(path, OSError(28, "No space left on device"))
    return write(self, path, step=step, epoch=epoch)

def sampled(*args, **kwargs):
    with open(f"{{now['out']}}/sampled_{{rank}}.txt", "a") as f:
        f.write(args[3].prompt + "\\n")
    return one(*args, **kwargs)

run_setup.start, loop.batch_loss, Trainer.step_done, Trainer._write_model = started, loss, done, written
sampling_training._one = sampled
{keep_group}
for scenario, out, argv in json.loads(open(sys.argv[1]).read()):  # one run after another
    now.update(scenario=scenario, out=out, batches=0)
    if rank == 0:
        for stream in (sys.stdout, sys.stderr):
            print(f"@@ {{scenario}}", file=stream, flush=True)
    code = train_network.main(argv)
    sys.stdout.flush(), sys.stderr.flush()
    with open(f"{{out}}/rc_{{rank}}.txt", "w") as f:
        f.write(str(code))
    torch.distributed.barrier()  # both done (and their output written) before the next marker
"""

SCENARIOS = {"nan": ["--seed", "3"], "save": ["--seed", "3"], "interrupt": ["--sample_every_n_steps", "2"]}
# the demo's run and its resume from the state it saves at step 2 (both before the stops: they end without an error)
DEMO = ["--demo", "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--network_dropout", "0.1"]
RESUMED = "uninterrupted/demo_lora-step00000002-state"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs in one launch: per scenario its folder, its part of stdout / stderr and each rank's status."""
    from library.run.demo import make_example_dataset, make_tiny_model

    tmp = tmp_path_factory.mktemp("stops")
    prompts = tmp / "prompts.txt"
    prompts.write_text("".join(f"prompt {i} --w 64 --h 64 --s 2 --d {i}\n" for i in range(3)))
    model, data = make_tiny_model(tmp / "model", "sd1"), make_example_dataset(tmp / "data")
    jobs = []
    for scenario, extra in {"uninterrupted": [], "resumed": ["--resume", str(tmp / RESUMED)]}.items():
        (tmp / scenario).mkdir()
        jobs.append((scenario, str(tmp / scenario), [*DEMO, "--demo_dir", str(tmp), "--output_dir",
                                                     str(tmp / scenario), *extra]))  # fmt: skip
    for scenario, extra in SCENARIOS.items():  # the interrupt last: its signal is the only one sent
        out = tmp / scenario
        out.mkdir()
        jobs.append((scenario, str(out), [
            "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module",
            "networks.lora", "--max_train_steps", "5", "--save_every_n_steps", "1", "--max_data_loader_n_workers",
            "0", "--save_model_as", "safetensors", "--sample_prompts", str(prompts), "--sample_every_n_steps", "4",
            *extra]))  # fmt: skip
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    wrapper = tmp / "wrapper.py"
    wrapper.write_text(_WRAPPER.format(root=str(ROOT), keep_group=KEEP_PROCESS_GROUP))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a process left waiting in a collective would block until gloo's 30-minute timeout: fail long before
    result = subprocess.run([*two_processes(quiet=True), str(wrapper), str(tmp / "jobs.json")], cwd=tmp, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    def part(text: str, scenario: str) -> str:  # a run's output: from its marker (process 0's) to the next one
        return text.split(f"@@ {scenario}\n", 1)[1].split("\n@@ ", 1)[0] if f"@@ {scenario}\n" in text else ""

    def rcs(out: Path) -> list[int]:
        return [int((out / f"rc_{i}.txt").read_text()) for i in (0, 1)]

    return {s: (tmp / s, part(result.stdout, s), part(result.stderr, s), rcs(tmp / s)) for s, _, _ in jobs}


def finite_file(path: Path) -> bool:
    return path.is_file() and all(torch.isfinite(t).all() for t in load_state_dict(path)[0].values())


def test_two_processes_agree_and_resume_exactly(runs):
    (a, stdout_a, stderr_a, rcs_a), (b, stdout_b, stderr_b, rcs_b) = runs["uninterrupted"], runs["resumed"]
    assert rcs_a == rcs_b == [0, 0], stdout_a[-2000:] + stderr_a[-3000:] + stdout_b[-2000:] + stderr_b[-3000:]
    for stdout, stderr in ((stdout_a, stderr_a), (stdout_b, stderr_b)):
        assert stdout.count("2 processes") == 1 and stdout.count("training finished") == 1
        assert stderr.count("INFO adapters:") == 1  # the main process logs; the other one does not repeat it
    state = a.parent / RESUMED
    assert (state / "rng_0.pt").exists() and (state / "rng_1.pt").exists()
    a, b = load_state_dict(a / "demo_lora.safetensors")[0], load_state_dict(b / "demo_lora.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_on_one_process_stops_both(runs):
    out, _, stderr, rcs = runs["nan"]
    assert rcs == [1, 1], rcs
    assert stderr.count("error: the loss became nan at step 3") == 1, stderr[-3000:]
    assert finite_file(out / "t-step00000001.safetensors") and finite_file(out / "t-step00000002.safetensors")
    assert not (out / "t-step00000003.safetensors").exists() and not (out / "t.safetensors").exists()


def test_ctrl_c_on_one_process_stops_both_with_a_state_and_sampling_is_shared(runs):
    """Without --seed: both processes run with one seed. The sampling round at step 2 is shared: process 0
    generates prompts 0 and 2, process 1 prompt 1, and process 0 saves them all. Process 1 is interrupted after
    step 2: both finish step 3 (the next time they compare notes), write one resumable state and stop."""
    out, stdout, stderr, rcs = runs["interrupt"]
    assert rcs == [1, 1], stdout[-2000:] + stderr[-3000:]
    assert stdout.count("another process was interrupted") == 1
    seeds = {(out / f"seed_{i}.txt").read_text() for i in (0, 1)}
    assert len(seeds) == 1, seeds
    state = out / "t-step00000003-state"
    assert (state / "rng_0.pt").is_file() and (state / "rng_1.pt").is_file()
    assert not (out / "t-step00000004.safetensors").exists()
    shares = [(out / f"sampled_{i}.txt").read_text().split("\n")[:-1] for i in (0, 1)]
    assert shares == [["prompt 0", "prompt 2"], ["prompt 1"]]
    assert len(list((out / "sample").glob("*.png"))) == 4  # all three, and the grid, written by process 0


def test_a_failed_save_stops_both_and_leaves_a_resumable_state(runs):
    out, stdout, stderr, rcs = runs["save"]
    assert rcs == [1, 1], stdout[-2000:] + stderr[-3000:]
    assert stderr.count("error: ") == 1 and "No space left on device" in stderr
    assert finite_file(out / "t-step00000001.safetensors")
    state = out / "t-step00000002-state"
    assert (state / "rng_0.pt").is_file() and (state / "rng_1.pt").is_file()
    assert not math.isnan(float((out / "seed_0.txt").read_text()))
