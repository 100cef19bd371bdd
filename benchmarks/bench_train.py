"""Training speed and memory on the tiny models (run by hand; numbers go into the issue notes).

    python benchmarks/bench_train.py [--steps 40] [--threads N] [--families sd1 sdxl]

For each family, in a fresh process: time from process start to the end of the first optimizer step, seconds per
step over the remaining steps (median of per-step times), and peak resident memory. Settings match the
sd-scripts yardstick: plain LoRA (dim 8) on UNet + text encoder, 64 px, batch 2, AdamW, fp32, no caching.

    python benchmarks/bench_train.py --full_finetune [--resolution 512] [--steps 3] [--threads N]

Full fine-tune of a real-size SD1.5 UNet (random weights, 860 M parameters) with Adafactor (sd-scripts' fine-tune
settings: relative_step=False, scale_parameter=False), gradient checkpointing, bf16 autocast on CPU, batch 1:
peak resident memory and seconds per step with the ordinary optimizer step and with --fused_backward_pass
(library/optim/fused.py), each in a fresh process.
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


def child(family: str, steps: int, workdir: Path) -> dict:
    start = time.time()
    sys.path.insert(0, str(ROOT))
    import resource

    import torch

    import train_network
    from library.demo import make_example_dataset, make_tiny_model

    model = make_tiny_model(workdir / "models", family)
    data = make_example_dataset(workdir / "data")
    stamps: list[float] = []
    original = train_network.Trainer.step_done

    def step_done(self, loss):
        original(self, loss)
        stamps.append(time.time())

    train_network.Trainer.step_done = step_done
    setup_done = time.time()
    argv = [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(workdir / "out"), "--network_module", "networks.lora",
        "--network_dim", "8", "--network_alpha", "8", "--learning_rate", "1e-4", "--train_batch_size", "2",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "0",
    ]  # fmt: skip
    scripts = {"sd1": ("sd1", "sd2"), "sdxl": ("sdxl",)}
    train_network.run(argv, family_names=scripts[family])
    per_step = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "family": family,
        "threads": torch.get_num_threads(),
        "time_to_first_step_s": round(stamps[0] - start, 2),
        "of_which_tiny_model_and_data_s": round(setup_done - start, 2),
        "s_per_step_median": round(statistics.median(per_step), 4),
        "s_per_step_mean": round(statistics.mean(per_step), 4),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def full_child(mode: str, steps: int, resolution: int) -> dict:
    """One real-size SD1.5 UNet trained ``steps`` steps; ``mode`` "plain" or "fused"."""
    sys.path.insert(0, str(ROOT))
    import resource

    import torch
    from diffusers import UNet2DConditionModel
    from transformers.optimization import Adafactor

    from library.families.loading import shipped_configs
    from library.optim.fused import FusedStep, chunk_parameters

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(shipped_configs("sd15")["unet"])
    unet.enable_gradient_checkpointing()
    unet.train()
    params = list(unet.parameters())
    optimizer = Adafactor(params, lr=1e-6, relative_step=False, scale_parameter=False, warmup_init=False)
    if mode == "fused":
        FusedStep(optimizer, chunk_parameters(params, None))
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    side = resolution // 8
    times = []
    for _ in range(steps):
        start = time.time()
        x, noise = torch.randn(1, 4, side, side), torch.randn(1, 4, side, side)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = unet(x, torch.tensor([500]), torch.randn(1, 77, 768)).sample
        torch.nn.functional.mse_loss(pred.float(), noise).backward()
        optimizer.step()  # fused: the hooks already stepped every parameter during backward
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time() - start)
    return {
        "mode": mode,
        "resolution": resolution,
        "threads": torch.get_num_threads(),
        "parameters_m": round(sum(p.numel() for p in params) / 1e6, 1),
        "rss_after_model_mib": round(loaded_rss, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "s_per_step": [round(t, 2) for t in times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--families", nargs="*", default=["sd1", "sdxl"])
    parser.add_argument("--full_finetune", action="store_true", help="real-size SD1.5 UNet: plain vs fused step")
    parser.add_argument("--resolution", type=int, default=512, help="--full_finetune: image side in pixels")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.child in ("plain", "fused"):
            print("RESULT " + json.dumps(full_child(args.child, args.steps, args.resolution)))
            return
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(child(args.child, args.steps, Path(tmp))))
        return
    runs = ["plain", "fused"] if args.full_finetune else args.families
    for family in runs:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            family,
            "--steps",
            str(args.steps),
            "--resolution",
            str(args.resolution),
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(out.stdout[-2000:], out.stderr[-3000:])
            raise SystemExit(f"{family}: benchmark failed")
        print(json.dumps(json.loads(lines[-1][7:])))


if __name__ == "__main__":
    main()
