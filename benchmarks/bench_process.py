"""Whole training processes, side by side (run by hand): start-up, seconds per step, CPU seconds and peak RSS.

    python benchmarks/bench_process.py --case demo --runs 3 --threads 1 --repos . OTHER_CHECKOUT
    python benchmarks/bench_process.py --case real --runs 3 --threads 2 --workdir DIR --repos . OTHER_CHECKOUT
    python benchmarks/bench_process.py --case real --runs 2 --steps 4 --threads 1 --workdir DIR \
        --variant "" --variant=--lowram

Each run is a fresh interpreter (this venv's python, ``OMP_NUM_THREADS`` = ``--threads``) that imports
``train_network`` from the checkout given and calls its ``main()`` (the command line, as ``python train_network.py``)
with the case's flags plus the variant's, under ``/usr/bin/time -v``. The sides (every checkout of ``--repos`` with
every flag set of ``--variant``) alternate run by run (A B A B ...), so a slow moment of the machine hits all.

Per run, in seconds from the launch of the process: ``imports`` (``import train_network`` done), ``first_step`` (the
first step asks for its first batch loss: model loaded, latents cached; with ``--steps 0``, the default, the process
exits there, so the run measures the start-up alone), ``wall`` (exit); ``s_per_step``, ``cpu_s_per_step`` (all
threads), ``sys_s_per_step`` (of it, in the kernel) and ``page_faults_per_step`` (minor): medians over the
intervals between the ends of steps 2..N (``--steps`` >= 3); ``cpu_s``: the process's user + system CPU seconds (CPU
seconds are the figures to compare on a busy machine); ``peak_rss_mib``: the process's maximum resident set.

Cases: ``demo`` is ``train_network.py --demo`` (tiny SD1, 64 px, batch 2; its files are made once before the timed
runs); ``real`` is a random-weight real-size SD1.5 (benchmarks/real_size_model.py, fp32, built once under
``--workdir``) at 512 px, batch 1, ``--cache_latents --network_train_unet_only --sdpa``, LoRA dim 8, 4 images.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vs_sdscripts import parse_time_v  # noqa: E402

CHILD = r"""
import json, os, resource, sys, time
stamps = {"step_ends": []}
sys.path.insert(0, sys.argv[1])
import train_network
from library.run import loop
from library.run.trainer import Trainer
stamps["imports"] = time.time()
loss, done = loop.batch_loss, Trainer.step_done
def batch_loss(*a, **kw):
    stamps.setdefault("first_step", time.time())
    if sys.argv[2] == "stop":  # start-up only: leave as the first step begins
        print("STAMPS " + json.dumps(stamps), flush=True)
        os._exit(0)
    return loss(*a, **kw)
def step_done(self, value):
    done(self, value)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stamps["step_ends"].append((time.time(), time.process_time(), usage.ru_stime, usage.ru_minflt))
loop.batch_loss, Trainer.step_done = batch_loss, step_done
code = train_network.main(sys.argv[3:])
print("STAMPS " + json.dumps(stamps), flush=True)
sys.exit(code)
"""


def case_argv(case: str, workdir: Path, steps: int) -> list[str]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from library.run.demo import make_example_dataset

    if case == "demo":
        return ["--demo", "--demo_dir", str(workdir / "demo"), "--max_train_steps", str(steps)]
    from real_size_model import build

    model = build("sd1", workdir / "real-sd1", "fp32")
    data = make_example_dataset(workdir / "data512", size=512)
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", "512", "--output_dir", str(workdir / "out"), "--output_name", "real", "--network_module",
        "networks.lora", "--network_dim", "8", "--network_alpha", "8", "--learning_rate", "1e-4",
        "--train_batch_size", "1", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
        "--seed", "0", "--sdpa", "--cache_latents", "--network_train_unet_only",
    ]  # fmt: skip


def run_once(repo: Path, argv: list[str], threads: int, log: Path, stop: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    timing = log.with_suffix(".time")
    cmd = ["/usr/bin/time", "-v", "-o", str(timing), sys.executable, "-c", CHILD, str(repo)]
    cmd += ["stop" if stop else "train", *argv]
    start = time.time()
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    wall = time.time() - start
    log.write_text(out.stdout + out.stderr)
    lines = [line for line in out.stdout.splitlines() if line.startswith("STAMPS ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{repo}: run failed (exit {out.returncode}), see {log}")
    stamps = json.loads(lines[-1][7:])
    ends = stamps.pop("step_ends")

    result = {name: round(t - start, 2) for name, t in stamps.items()}
    if len(ends) >= 3:  # steps 2..N: wall s, CPU s (all threads) and minor page faults, medians
        for k, name in enumerate(("s_per_step", "cpu_s_per_step", "sys_s_per_step", "page_faults_per_step")):
            result[name] = round(statistics.median(b[k] - a[k] for a, b in zip(ends, ends[1:])), 2)
    usage = parse_time_v(timing)  # /usr/bin/time -v's fields, read as the sd-scripts comparison reads them
    return {**result, "wall": round(wall, 2), "cpu_s": round(usage["cpu_s"], 2),
            "peak_rss_mib": round(usage["peak_rss_mb"])}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["demo", "real"], default="demo")
    parser.add_argument("--repos", nargs="+", default=[str(ROOT)], help="checkouts measured in turn")
    parser.add_argument("--variant", action="append", default=None,
                        help="a flag set measured in turn (repeat; --variant=--lowram; default: none)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="runs per side")
    parser.add_argument("--steps", type=int, default=0, help="0: stop as the first step begins (start-up only)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", default=None, help="models, data and logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cmdline, stop = case_argv(args.case, workdir, max(args.steps, 1)), args.steps == 0
        sides = [(Path(repo).resolve(), variant) for repo in args.repos for variant in args.variant or [""]]
        if args.case == "demo":  # the demo's files are made by the first run: make them untimed
            run_once(sides[0][0], cmdline, args.threads, workdir / "warmup.log", stop)
        results: dict[int, list[dict]] = {i: [] for i in range(len(sides))}
        for n in range(args.runs):
            for i, (repo, variant) in enumerate(sides):
                got = run_once(repo, cmdline + variant.split(), args.threads, workdir / f"run{n}-side{i}.log", stop)
                results[i].append(got)
                print(json.dumps({"repo": str(repo), "flags": variant, "run": n, **got}), flush=True)
        for i, (repo, variant) in enumerate(sides):
            runs = results[i]
            medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(json.dumps({"repo": str(repo), "flags": variant, "case": args.case, "threads": args.threads,
                              "runs": len(runs), "median": medians}))  # fmt: skip


if __name__ == "__main__":
    main()
