"""Where a training step's time goes: torch.profiler over a few steps of a demo run, the top operators printed.

    python benchmarks/profile_step.py --family sd1 [--steps 16] [--first 10 --count 4] [-- extra train_network flags]

Prints the wall time per profiled step, the host time outside any operator (Python, data, our own bookkeeping), and
the operators with the most self CPU time and (on a GPU) the most device time. Use it to tell a step that waits on
the GPU from one that waits on the host.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sd1", choices=["sd1", "sdxl"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--first", type=int, default=10, help="first profiled step (0-based)")
    parser.add_argument("--count", type=int, default=4, help="profiled steps")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rows", type=int, default=25)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    import torch
    from step_probe import run_training
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="profile-step-"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    wall: list[float] = []

    def on_start(i: int) -> None:
        if i == args.first:
            if cuda:
                torch.cuda.synchronize()
            prof.__enter__()
            wall.append(time.perf_counter())

    def on_end(i: int) -> None:
        if i == args.first + args.count - 1:
            if cuda:
                torch.cuda.synchronize()
            wall.append(time.perf_counter())
            prof.__exit__(None, None, None)

    argv = ["--demo", "--demo_dir", str(work / "demo"), "--output_dir", str(work / "out"),
            "--max_train_steps", str(args.steps), "--seed", "0", "--max_data_loader_n_workers", "0", *extra]  # fmt: skip
    run_training(argv, args.family, on_start, on_end)
    if len(wall) != 2:
        raise SystemExit(f"profile_step.py: the run ended before step {args.first + args.count}")
    events = prof.key_averages()
    step_s = (wall[1] - wall[0]) / args.count
    cpu_ops_s = sum(e.self_cpu_time_total for e in events) / 1e6 / args.count
    print(f"{args.family} {' '.join(extra)}: {step_s * 1000:.1f} ms per step ({args.count} steps), operators' self CPU "
          f"time {cpu_ops_s * 1000:.1f} ms per step, launches per step "
          f"{sum(e.count for e in events if e.key.startswith('cudaLaunchKernel')) / args.count:.0f}")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows // 2))


if __name__ == "__main__":
    main()
