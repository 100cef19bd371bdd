"""Memory of a LoRA training run per low-memory setting: peak RSS and peak tensor bytes (the table in
docs/training.md).

    python benchmarks/bench_memory.py --model MODEL --data TRAIN_DIR [--family sd1] [--resolution 512] [--steps 3]
        [--settings plain,gradient_checkpointing,...] [--threads 2] [--base "..."]

Each setting runs ``train_network.run`` (SDXL: with the SDXL family) in a fresh process: LoRA dim 8 on the UNet
only (``--network_train_unet_only``, so that ``--cache_text_encoder_outputs`` is allowed), batch 1, AdamW, fp32
unless the setting says otherwise, sdpa attention. Per run it reports

  peak RSS         the process's maximum resident set size (getrusage), load and caching included
  RSS at phases    after the model is loaded, after the caches, at the first step and at the end
  tensor peak      the most bytes held by live tensor storages during a training step (library/measure/tensor_memory.py),
                   and how much of it is above what was alive when the step began (weights, caches, optimizer)
  s/step           median wall seconds per step

and prints a markdown table with what each setting saves against ``plain``. Without ``--model`` a random-weight
real-size model of ``--family`` is built under ``--workdir`` (benchmarks/real_size_model.py; SD1.5 4 GB in fp32,
SDXL 7 GB in bf16) and a 2-image dataset at ``--resolution`` is made next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_probe, real_size_model
SETTINGS = {
    "plain": [],
    "gradient_checkpointing": ["--gradient_checkpointing"],
    "cache_latents": ["--cache_latents"],
    "cache_text_encoder_outputs": ["--cache_text_encoder_outputs"],
    "bf16": ["--mixed_precision", "bf16", "--full_bf16"],
    "fp8_base": ["--mixed_precision", "bf16", "--fp8_base"],
    "all": ["--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--mixed_precision",
            "bf16", "--full_bf16", "--fp8_base"],
}  # fmt: skip
MIB = 2.0**20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


class RssSampler(threading.Thread):
    """The process's RSS every ``interval`` seconds: the peak between two marks tells which phase sets it."""

    def __init__(self, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.interval, self.samples, self.done = interval, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.samples.append((time.time(), rss_mib()))

    def peak_between(self, start: float, end: float) -> float:
        return round(max([r for t, r in self.samples if start <= t <= end] or [0.0]), 1)


def _marked(function, label: str, marks: dict) -> object:
    """``function`` that also notes when it returned, under ``label``."""

    def wrapper(*a, **kw):
        out = function(*a, **kw)
        marks[label] = time.time()
        return out

    return wrapper


def child(argv: list[str], family: str) -> dict:
    """Run one training in this process with every step measured; returns the numbers."""
    sys.path.insert(0, str(ROOT))
    import resource

    from step_probe import run_training

    from library.measure.tensor_memory import TensorMemory
    from library.run import setup as run_setup

    sampler = RssSampler()
    sampler.start()
    marks: dict[str, float] = {"start": time.time()}
    for name, label in (("load_model", "loaded"), ("fill_caches", "cached")):
        setattr(run_setup, name, _marked(getattr(run_setup, name), label, marks))
    mem, steps = TensorMemory(), []

    def on_start(i: int) -> None:
        if i == 0:
            marks["first_step"] = time.time()
            mem.__enter__()  # counts what is alive now: weights, caches, optimizer state
        mem.reset_peak()
        steps.append({"live": mem.live_bytes["cpu"]})

    def on_end(i: int) -> None:
        steps[i]["peak"] = mem.peak_bytes["cpu"]

    try:
        times = run_training(argv, family, on_start, on_end)
    finally:
        if steps:
            mem.__exit__(None, None, None)
    end = time.time()
    sampler.done.set()
    sampler.join()
    peak = max(steps, key=lambda s: s["peak"])
    load_end, cache_end = marks.get("loaded", end), marks.get("cached", end)
    first = marks.get("first_step", end)
    return {
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_peak_load_mib": sampler.peak_between(marks["start"], load_end),
        "rss_peak_caching_mib": sampler.peak_between(load_end, cache_end),
        "rss_peak_setup_mib": sampler.peak_between(cache_end, first),
        "rss_peak_steps_mib": sampler.peak_between(first, times[-1][1]),
        "rss_peak_save_mib": sampler.peak_between(times[-1][1], end),
        "tensor_peak_mib": round(peak["peak"] / MIB, 1),
        "tensor_at_step_start_mib": round(peak["live"] / MIB, 1),
        "tensor_step_extra_mib": round((peak["peak"] - peak["live"]) / MIB, 1),
        "s_per_step": round(statistics.median(b - a for a, b in times), 2),
        "steps": len(times),
        "wall_s": round(end - marks["start"], 1),
    }


def meta_step(family_name: str, resolution: int, fp8: bool = True, checkpointing: bool = True) -> dict:
    """One LoRA step of the real-size model on the meta device: no arithmetic, exact shapes, dtypes and lifetimes.

    The setting of the ``all`` row, where nothing but the UNet and the adapter stays in memory: bf16 weights and
    adapter (``--full_bf16``), ``--fp8_base``, ``--gradient_checkpointing``, cached latents and text-encoder
    outputs, UNet-only LoRA dim 8, sdpa attention, AdamW. Tensor bytes only (no process RSS on meta).
    """
    sys.path.insert(0, str(ROOT))
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from real_size_model import CONFIGS
    from transformers import CLIPTextConfig

    import train_network
    from library.device.fp8 import store_in_fp8
    from library.families import get_family
    from library.families.base import Cond, Parts
    from library.families.encoders.clip import text_encoder_class
    from library.families.loading import shipped_configs
    from library.measure.tensor_memory import TensorMemory
    from library.run.runtime import set_attention
    from library.run.setup import enable_checkpointing
    from networks.config import NetworkConfig
    from networks.inject import prepare_network

    family, configs, bf16 = get_family(family_name), shipped_configs(CONFIGS[family_name]), torch.bfloat16
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(configs["unet"]).to(bf16)
        encoders = [text_encoder_class(spec.with_projection)(CLIPTextConfig.from_dict(c)).to(bf16)
                    for spec, c in zip(family.spec.text_encoders, configs["text_encoders"])]  # fmt: skip
        vae = AutoencoderKL.from_config(configs["vae"])  # only for Parts: freed in a cached run
    unet.requires_grad_(False)
    set_attention([unet], "sdpa")
    if fp8:
        store_in_fp8(unet, bf16)
    if checkpointing:
        enable_checkpointing(unet, [])
    parts = Parts(unet, vae, encoders, [], configs["scheduler"], family=family_name)
    flags = ["--network_module", "networks.lora", "--network_dim", "8", "--network_alpha", "8",
             "--network_train_unet_only"]  # fmt: skip
    network = prepare_network(NetworkConfig.from_args(train_network.build_parser().parse_args(flags)),
                              family.adapter_roots(parts), family.target_classes)  # fmt: skip
    network.to(device="meta", dtype=bf16)
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad], lr=1e-4)
    for module in (*encoders, vae):  # a cached run frees them (release_unused_parts); the adapter keeps the modules
        for param in module.parameters():
            param.data = torch.empty(0, device="meta")
    side, ctx = resolution // 8, configs["unet"]["cross_attention_dim"]
    pooled_dim = configs["text_encoders"][-1]["projection_dim"]
    # On meta, torch's SDPA takes the math path (the whole attention matrix, 1.5 GiB per SD1.5 layer at 512 px);
    # CPU and GPU training run a fused kernel that keeps O(tokens) for backward: measure that one.
    fused = lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_: (  # noqa: E731
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                                   scale=scale)[0])  # fmt: skip
    sdpa, torch.nn.functional.scaled_dot_product_attention = torch.nn.functional.scaled_dot_product_attention, fused
    with TensorMemory() as mem, torch.device("meta"):
        latents, noise = torch.randn(1, 4, side, side, dtype=bf16), torch.randn(1, 4, side, side)
        cond = Cond(torch.randn(1, 77, ctx, dtype=bf16), torch.randn(1, pooled_dim, dtype=bf16))
        time_ids = family.size_conditioning([[resolution] * 2], [[0, 0]], [[resolution] * 2])  # None for SD1
        time_ids = time_ids.to(bf16) if time_ids is not None else None
        pred = family.predict(unet, latents, torch.tensor([500]), cond, time_ids=time_ids)
        torch.nn.functional.mse_loss(pred.float(), noise).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    return {"family": family_name, "resolution": resolution, "fp8_base": fp8, "gradient_checkpointing": checkpointing,
            **mem.report("meta")}  # fmt: skip


def training_argv(args: argparse.Namespace, setting: str, out: Path) -> list[str]:
    return [
        "--pretrained_model_name_or_path", args.model, "--train_data_dir", args.data, "--caption_extension", ".txt",
        "--resolution", str(args.resolution), "--train_batch_size", "1", "--network_module", "networks.lora",
        "--network_dim", "8", "--network_alpha", "8", "--network_train_unet_only", "--optimizer_type", "AdamW",
        "--learning_rate", "1e-4", "--max_train_steps", str(args.steps), "--seed", "42", "--sdpa",
        "--max_data_loader_n_workers", "0", "--output_dir", str(out), "--output_name", setting,
        "--save_model_as", "safetensors",
    ] + SETTINGS[setting] + args.base.split()  # fmt: skip


def prepare_inputs(args: argparse.Namespace) -> None:
    """A random-weight real-size model and a small dataset when none is given."""
    work = Path(args.workdir)
    if args.model is None:
        from real_size_model import build

        args.model = str(build(args.family, work / f"real-{args.family}", "bf16" if args.family == "sdxl" else "fp32"))
    if args.data is None:
        sys.path.insert(0, str(ROOT))
        from library.run.demo import make_example_dataset

        args.data = str(make_example_dataset(work / f"data{args.resolution}", size=args.resolution))


def table(results: dict[str, dict]) -> str:
    """Markdown: each setting's peaks and what it saves against ``plain`` (MiB; negative = uses more)."""
    base = results.get("plain")
    lines = [
        "| setting | peak RSS MiB | saves | tensor peak MiB (in a step) | saves | of it above step start MiB | s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        flags = " ".join(SETTINGS[name]) or "(LoRA, UNet only, fp32)"

        def saved(key: str, r: dict = r, name: str = name) -> str:
            return "" if base is None or name == "plain" else f"{base[key] - r[key]:.0f}"

        lines.append(
            f"| `{flags}` | {r['peak_rss_mib']:.0f} | {saved('peak_rss_mib')} | {r['tensor_peak_mib']:.0f} "
            f"| {saved('tensor_peak_mib')} | {r['tensor_step_extra_mib']:.0f} | {r['s_per_step']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a diffusers folder or single file (default: build one)")
    parser.add_argument("--data", default=None, help="a train_data_dir (default: make 2 images)")
    parser.add_argument("--family", choices=["sd1", "sdxl"], default="sd1")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--base", default="", help="flags added to every setting (one string)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--workdir", default=str(ROOT / "benchmarks" / ".memory"))
    parser.add_argument("--meta", action="store_true", help="one step of the `all` setting on the meta device "
                        "(tensor bytes without arithmetic: e.g. SDXL at 1024 px on a small CPU)")  # fmt: skip
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.meta:
        print(json.dumps(meta_step(args.family, args.resolution)))
        return
    if args.child is not None:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(child(args.child, args.family)), flush=True)
        return
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    prepare_inputs(args)
    results = {}
    for name in names:
        out = Path(args.workdir) / "out"
        cmd = [sys.executable, __file__, "--family", args.family] + (["--threads", str(args.threads)] if args.threads
                                                                     else []) + ["--child"] + training_argv(args, name, out)  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"{name}: the run failed (exit {proc.returncode})")
        results[name] = json.loads(lines[-1][7:])
        print(json.dumps({"setting": name, **results[name]}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
