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

    python benchmarks/bench_train.py --real sd1 sdxl [--steps 20] [--extra "--gradient_checkpointing"] [--tiny]

LoRA training (train_network.run) of a random-weight real-size SD1.5 at 512 px and SDXL at 1024 px
(benchmarks/real_size_model.py), batch 1, on CUDA when there is one: bf16 mixed precision, sdpa, UNet-only LoRA
dim 8, cached latents and text-encoder outputs (so a step is the UNet's forward and backward). Reports seconds per
step (median, the FLOP-counted step left out), ``torch.cuda.max_memory_allocated`` during the steps and over the
whole run, the FLOPs of one step (torch.utils.flop_counter.FlopCounterMode) and the model FLOP utilisation: FLOPs
per step / seconds per step / the GPU's dense bf16 peak (a table of known GPUs, or --peak_tflops). ``--tiny``
uses the tiny models instead (a dry run of the same path, e.g. on a CPU).
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
    from library.run import loop
    from library.run.demo import make_example_dataset, make_tiny_model

    model = make_tiny_model(workdir / "models", family)
    data = make_example_dataset(workdir / "data")
    stamps: list[float] = []
    original = loop.Trainer.step_done

    def step_done(self, loss):
        original(self, loss)
        stamps.append(time.time())

    loop.Trainer.step_done = step_done
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


# dense bf16 tensor-core peaks (TFLOP/s) by a substring of torch.cuda.get_device_name(); the first match wins
BF16_PEAK_TFLOPS = {"H100 PCIe": 756, "H100": 989, "H200": 989, "GH200": 989, "B200": 2250, "A100": 312,
                    "L40S": 362, "L4": 121, "A10": 125, "RTX 4090": 165, "RTX 3090": 71}  # fmt: skip
REAL_FLAGS = ["--mixed_precision", "bf16", "--sdpa", "--network_train_unet_only", "--cache_latents",
              "--cache_text_encoder_outputs"]  # fmt: skip


def gpu_peak_tflops(given: float | None) -> float | None:
    import torch

    if given or not torch.cuda.is_available():
        return given
    name = torch.cuda.get_device_name()
    return next((float(v) for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def real_child(family: str, steps: int, workdir: Path, tiny: bool, extra: list[str], peak: float | None) -> dict:
    """LoRA training at real size (or tiny) with per-step time, CUDA memory and the FLOPs of one step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from real_size_model import build
    from step_probe import run_training
    from torch.utils.flop_counter import FlopCounterMode

    from library.families import get_family
    from library.run.demo import make_example_dataset, make_tiny_model

    resolution = 64 if tiny else get_family(family).default_resolution()
    model = make_tiny_model(workdir / "models", family) if tiny else build(family, workdir / f"real-{family}", "bf16")
    data = make_example_dataset(workdir / f"data{resolution}", size=resolution)
    cuda = torch.cuda.is_available()
    counter = FlopCounterMode(display=False)
    counted, flop_step = {}, min(1, steps - 1)

    def on_start(i: int) -> None:
        if i == 0 and cuda:
            counted["setup_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            torch.cuda.reset_peak_memory_stats()
        if i == flop_step:
            counter.__enter__()
        if cuda:
            torch.cuda.synchronize()

    def on_end(i: int) -> None:
        if cuda:
            torch.cuda.synchronize()
        if i == flop_step:
            counter.__exit__(None, None, None)

    argv = [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", str(resolution), "--output_dir", str(workdir / "out"), "--network_module", "networks.lora",
        "--network_dim", "8", "--network_alpha", "8", "--learning_rate", "1e-4", "--train_batch_size", "1",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "0",
    ] + REAL_FLAGS + extra  # fmt: skip
    times = run_training(argv, family, on_start, on_end)
    timed = [b - a for i, (a, b) in enumerate(times) if i not in (0, flop_step)] or [times[-1][1] - times[-1][0]]
    s_per_step = statistics.median(timed)
    flops = counter.get_total_flops()
    return {
        "family": family,
        "size": "tiny" if tiny else "real",
        "resolution": resolution,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "flags": " ".join(REAL_FLAGS + extra),
        "s_per_step": round(s_per_step, 4),
        "steps_max_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        **counted,
        "gflop_per_step": round(flops / 1e9, 3),
        "achieved_tflops": round(flops / s_per_step / 1e12, 2),
        "mfu": round(flops / s_per_step / (peak * 1e12), 4) if peak else None,
        "peak_bf16_tflops": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--families", nargs="*", default=["sd1", "sdxl"])
    parser.add_argument("--full_finetune", action="store_true", help="real-size SD1.5 UNet: plain vs fused step")
    parser.add_argument("--resolution", type=int, default=512, help="--full_finetune: image side in pixels")
    parser.add_argument(
        "--real",
        nargs="*",
        choices=["sd1", "sdxl"],
        default=None,
        help="LoRA at real size (SD1.5 512 px, SDXL 1024 px) with random weights; GPU figures",
    )
    parser.add_argument("--tiny", action="store_true", help="--real: the tiny models instead (a dry run)")
    parser.add_argument("--extra", default="", help="--real: flags added to the training command line (one string)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="--real: the GPU's dense bf16 peak")
    parser.add_argument("--workdir", default=None, help="--real: where models and data go (default: a temp dir)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real is not None:
        return real(args)
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
        print(json.dumps(run_child(cmd, family)))


def real(args: argparse.Namespace) -> None:
    """--real: each family in a fresh process (the models are built once in --workdir)."""
    if args.child:
        print("RESULT " + json.dumps(real_child(args.child, args.steps, Path(args.workdir), args.tiny,
                                                args.extra.split(), gpu_peak_tflops(args.peak_tflops))))  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        for family in args.real or ["sd1", "sdxl"]:
            cmd = [sys.executable, __file__, "--real", "--child", family, "--steps", str(args.steps), "--workdir",
                   workdir, "--extra=" + args.extra] + (["--tiny"] if args.tiny else []) + (
                   ["--peak_tflops", str(args.peak_tflops)] if args.peak_tflops else [])  # fmt: skip
            print(json.dumps(run_child(cmd, family)), flush=True)


def run_child(cmd: list[str], what: str) -> dict:
    """Run a ``--child`` command; its RESULT line as a dict (its output shown and an error raised if it failed)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(out.stdout[-2000:], out.stderr[-3000:])
        raise SystemExit(f"{what}: benchmark failed")
    return json.loads(lines[-1][7:])


if __name__ == "__main__":
    main()
