"""The precision and attention matrix on a CUDA GPU, on the tiny demo models, in one process (part of gpu_check.sh).

    python benchmarks/gpu_runs.py [--steps 30] [--workdir DIR]

For SD1 and SDXL, each of: ``--mixed_precision fp16``, ``--full_fp16`` (a real GradScaler on fp16 gradients),
bf16, ``--full_bf16``, ``--fp8_base``, ``--fp8_base`` with LoCon on the convolutions and gradient checkpointing
(cuDNN's convolution backward with float8-stored weights), ``--sdpa``, ``--xformers`` (skipped when the package is
missing), and seed 004's low-VRAM combination with cached latents and a sampling round. A run passes when it
finishes its steps with a finite loss. Prints one JSON line per run: status, seconds per step (median of steps
3..N), ``torch.cuda.max_memory_allocated`` and the last loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "fp16": ["--mixed_precision", "fp16"],
    "full_fp16": ["--mixed_precision", "fp16", "--full_fp16", "--optimizer_type", "AdamW8bit"],  # AdamW: refused
    "full_fp16_adafactor": ["--mixed_precision", "fp16", "--full_fp16", "--optimizer_type", "Adafactor",
                            "--optimizer_args", "relative_step=False", "scale_parameter=False", "warmup_init=False"],
    "bf16": ["--mixed_precision", "bf16"],
    "full_bf16": ["--mixed_precision", "bf16", "--full_bf16"],
    "fp8_base": ["--mixed_precision", "bf16", "--fp8_base"],
    "fp8_base_locon_ckpt": ["--mixed_precision", "bf16", "--fp8_base", "--gradient_checkpointing", "--network_args",
                            "conv_dim=4", "conv_alpha=1"],
    "sdpa": ["--mixed_precision", "bf16", "--sdpa"],
    "xformers": ["--mixed_precision", "bf16", "--xformers"],
    "low_vram_sampling": ["--mixed_precision", "fp16", "--fp8_base", "--gradient_checkpointing", "--cache_latents",
                          "--no_half_vae", "--gradient_accumulation_steps", "2", "--sample_every_n_steps", "10"],
}  # fmt: skip


def one(family: str, name: str, flags: list[str], steps: int, work: Path) -> dict:
    import torch

    cuda = torch.cuda.is_available()  # False only in a --cpu dry run

    import train_network
    from library.families.registry import trained_together

    if name == "xformers":
        try:
            import xformers.ops  # noqa: F401
        except ImportError:
            return {"family": family, "run": name, "status": "skipped", "why": "xformers is not installed"}
    stamps: list[float] = []
    step_done = train_network.Trainer.step_done

    def stamped(self, loss):
        step_done(self, loss)
        if cuda:
            torch.cuda.synchronize()
        stamps.append(time.time())

    train_network.Trainer.step_done = stamped
    prompts = work / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 4\n")
    argv = ["--demo", "--demo_dir", str(work / "demo"), "--output_dir", str(work / "out" / family / name),
            "--max_train_steps", str(steps), "--seed", "0", "--max_data_loader_n_workers", "0", *flags]  # fmt: skip
    if "--sample_every_n_steps" in flags:
        argv += ["--sample_prompts", str(prompts)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        result = train_network.run(argv, family_names=trained_together(family))
    except Exception as e:  # noqa: BLE001 - a failing run is a result, and the next one still runs
        return {"family": family, "run": name, "status": "error", "error": f"{type(e).__name__}: {e}"[:400],
                "where": traceback.format_exc().splitlines()[-3:]}  # fmt: skip
    finally:
        train_network.Trainer.step_done = step_done
    per_step = [b - a for a, b in zip(stamps[2:], stamps[3:])]
    ok = result is not None and result.failed is None and result.steps == steps
    return {
        "family": family,
        "run": name,
        "status": "pass" if ok else "fail",
        "failed": None if result is None else result.failed,
        "steps": None if result is None else result.steps,
        "s_per_step": round(statistics.median(per_step), 4) if per_step else None,
        "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "last_loss": round(result.losses[-1], 5) if result is not None and result.losses else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    parser.add_argument("--families", default="sd1,sdxl", help="comma list of sd1, sdxl")
    parser.add_argument("--cpu", action="store_true", help="a dry run of this script on the CPU (no GPU figures)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("gpu_runs.py: no CUDA GPU visible to torch (--cpu: a dry run on the CPU)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    failures = 0
    for family in args.families.split(","):
        for name in args.runs.split(","):
            row = one(family, name, RUNS[name], args.steps, work)
            failures += row["status"] in ("fail", "error")
            print(json.dumps(row), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
