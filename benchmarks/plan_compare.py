"""The planner's numbers before and after a change to it: the whole plan of each case, compared to the bit.

    python benchmarks/plan_compare.py record OUT.json [--real sd1 sdxl flux-dev] [--tiny sd1 flux-dev ...]
    python benchmarks/plan_compare.py compare BEFORE.json AFTER.json

``record`` plans each case (benchmarks/plan_real_size.py's real-size LoRA commands on header-only files, and
tests/test_plan_memory.py's tiny-model commands) in this process, one after the other, and writes per case the whole
plan (every phase's device bytes, host and CUDA figures, what holds each peak; library/measure/plan_report.py) with
the plan's wall and CPU seconds. ``compare`` prints each case's seconds before -> after and every plan value that
differs (exit 1 when one does): a change that only makes the planner faster leaves every value equal.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))
sys.path.insert(0, str(HERE / "tests"))


def _timed(plan) -> tuple[dict, float, float]:
    from library.measure.plan import plan_command

    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_command(plan, out=lambda line: None)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def real_case(name: str, work: Path) -> tuple[dict, float, float]:
    import importlib

    from plan_real_size import COMMON, SCRIPTS, write_files

    from library.run.demo import make_example_dataset

    script, resolution = SCRIPTS[name]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    model_flags = write_files(name, folder)
    data = make_example_dataset(work / f"data{resolution}", size=resolution)
    argv = [*model_flags, "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution",
            str(resolution), "--output_dir", str(work / "out"), "--max_train_steps", "1", *COMMON,
            "--plan_memory"]  # fmt: skip
    run = importlib.import_module(script).run
    return _timed(lambda: run(argv))


def tiny_case(name: str, work: Path) -> tuple[dict, float, float]:
    from test_plan_memory import command

    from library.run.demo import make_example_dataset

    data = make_example_dataset(work / "tiny_data")
    run, argv = command(name, work / "tiny", data, work / "tiny_out")
    return _timed(lambda: run([*argv, "--plan_memory"]))


def record(args: argparse.Namespace) -> None:
    from library.measure import simulated_device as sim_device

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-compare-"))
    (work / "tiny").mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, names, case in (("real", args.real, real_case), ("tiny", args.tiny, tiny_case)):
        for name in names:
            plan, wall, cpu = case(name, work)
            out[f"{kind} {name}"] = {"plan": plan, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
            cache = getattr(sim_device, "_META_OUTPUTS", None)  # the meta-output cache, where the planner has one
            stats = f"; meta kernels run {cache.runs}, answered from the cache {cache.hits}" if cache else ""
            print(f"{kind} {name}: plan {wall:.1f} s wall, {cpu:.1f} s CPU; device peak {plan['device_peak_mib']} MiB"
                  f"{stats}", file=sys.stderr, flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(out, indent=1))


def _diffs(before, after, path=""):
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if key not in before or key not in after:
                yield f"{path}/{key}: {before.get(key, '(absent)')} -> {after.get(key, '(absent)')}"
            else:
                yield from _diffs(before[key], after[key], f"{path}/{key}")
    elif before != after or type(before) is not type(after):
        yield f"{path}: {before!r} -> {after!r}"


def compare(args: argparse.Namespace) -> int:
    before, after = json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text())
    different = 0
    for case in before:
        if case not in after:
            print(f"{case}: not in {args.after}")
            continue
        b, a = before[case], after[case]
        diffs = list(_diffs(b["plan"], a["plan"]))
        different += bool(diffs)
        print(f"{case:<22} wall {b['wall_s']:7.1f} -> {a['wall_s']:6.1f} s   CPU {b['cpu_s']:7.1f} -> "
              f"{a['cpu_s']:6.1f} s   plan {'IDENTICAL' if not diffs else f'{len(diffs)} values differ'}")  # fmt: skip
        for line in diffs:
            print(f"    {line}")
    return 1 if different else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out")
    rec.add_argument("--real", nargs="*", default=["sd1", "sdxl", "flux-dev"])
    rec.add_argument("--tiny", nargs="*", default=["sd1", "sdxl", "flux-dev", "qwen_image", "sd3", "hunyuan_image"])
    rec.add_argument("--workdir", default=None)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.command == "record":
        record(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
