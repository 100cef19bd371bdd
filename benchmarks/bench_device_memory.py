"""Device memory per phase of a real-size LoRA run, on the simulated device (any CPU) or on a CUDA GPU.

    python benchmarks/bench_device_memory.py --family sdxl --resolution 1024            # meta stands in for the GPU
    python benchmarks/bench_device_memory.py --family sd1 --resolution 512 --device cuda
    python benchmarks/bench_device_memory.py --family sdxl --repo OLD_CHECKOUT          # the same run on older code

The run is train_network.run / sdxl_train_network.run unchanged, on the released architecture (SD1.5: UNet 860 M,
CLIP-L, VAE; SDXL: UNet 2.57 G, CLIP-L + bigG, VAE) with the low-VRAM settings of OneTrainer's anchors (seed 001):
``--mixed_precision bf16 --fp8_base --cache_latents --cache_text_encoder_outputs --gradient_checkpointing``, UNet-only
LoRA dim 16 / alpha 8, AdamW, batch 1, one training image, one sample (4 steps, euler_a) after two steps (the
second one's backward beside the AdamW state the first one made), and the save. Only ``family.load`` is replaced: it
hands over the real-size modules without reading a file (random weights on CUDA; on the simulated device
uninitialised host memory, which costs no resident memory until it is cast).

``--device meta`` (default): library/measure/simulated_device.py counts the bytes of every tensor on the device, phase by
phase (load, latent caching, text caching, step, sampling, save), with real shapes and lifetimes and no arithmetic.
Attention is counted as the fused kernel a GPU runs (on meta, torch's SDPA would take its math path and hold the
whole attention matrix). ``--device cuda``: ``torch.cuda.max_memory_allocated`` per phase.

``--repo`` runs the same measurement against another checkout (its library and scripts; this file's phase and
simulation modules), non-strict (the byte count without the device checks, which older code may fail).
Prints one JSON line: the settings and the peak MiB per phase.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SETTINGS = ["--mixed_precision", "bf16", "--fp8_base", "--cache_latents", "--cache_text_encoder_outputs",
            "--gradient_checkpointing"]  # fmt: skip
CONFIGS = {"sd1": "sd15", "sdxl": "sdxl-base"}


def load_own(name: str, path: Path) -> None:
    """Import this checkout's ``library/<name>.py`` (``name``: dotted, e.g. ``measure.phases``) as ``library.<name>``
    (for runs against another checkout)."""
    spec = importlib.util.spec_from_file_location(f"library.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"library.{name}"] = module
    spec.loader.exec_module(module)


def real_size_loader(family, device: str):
    """``family.load`` that returns the released architecture built in memory (see the module docstring)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    from library.families.base import Parts
    from library.families.encoders.clip import text_encoder_class
    from library.families.loading import shipped_configs
    from library.families.tokenizers import load_tokenizers

    def dtype_of(dtype, part):
        return getattr(dtype, part, dtype) if not isinstance(dtype, torch.dtype) else dtype

    def load(path, *, dtype=torch.float32, **options):
        configs = shipped_configs(CONFIGS[family.name])
        target = options.get("device", "cpu")

        def build(factory, dt):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dt)  # made in the run's dtype: no float32 copy on the way
            try:
                if device == "cuda":  # random weights, made on the GPU (fast), then where the run wants them
                    with torch.device("cuda"):
                        module = factory()
                    module = module.to(target).eval().requires_grad_(False)
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()  # making the weights is not part of the run's load
                    return module
                with init_empty_weights():
                    module = factory()
                return module.to_empty(device=target).eval().requires_grad_(False)
            finally:
                torch.set_default_dtype(previous)

        unet = build(lambda: UNet2DConditionModel.from_config(configs["unet"]), dtype_of(dtype, "denoiser"))
        vae = build(lambda: AutoencoderKL.from_config(configs["vae"]), dtype_of(dtype, "vae"))
        tes = [build(lambda s=s, c=c: text_encoder_class(s.with_projection)(CLIPTextConfig.from_dict(c)),
                     dtype_of(dtype, "text_encoders"))
               for s, c in zip(family.spec.text_encoders, configs["text_encoders"])]  # fmt: skip
        tokenizers = load_tokenizers(family.spec.text_encoders, None, None)
        scheduler = {k: v for k, v in configs["scheduler"].items() if not k.startswith("_")}
        return Parts(unet, vae, tes, tokenizers, scheduler, family.name, f"real-size {family.name}",
                     text_encoder_extras=[{} for _ in tes])  # fmt: skip

    return load


def fused_attention():
    """On meta, count SDPA as the fused kernel a GPU runs (torch's math path would hold the attention matrix)."""
    import torch

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        if q.device.type != "meta":
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(CONFIGS), default="sdxl")
    parser.add_argument("--resolution", type=int, default=None, help="default: 512 (sd1), 1024 (sdxl)")
    parser.add_argument("--device", choices=["meta", "cuda"], default="meta")
    parser.add_argument("--repo", default=str(HERE), help="the checkout whose code runs (default: this one)")
    parser.add_argument("--extra", default="", help="flags added to the run (one string)")
    parser.add_argument("--no_sample", action="store_true", help="skip the sampling round")
    parser.add_argument("--steps", type=int, default=2, help="cuda: > 2 also gives s/step, FLOPs per step and MFU")
    parser.add_argument("--plain", action="store_true", help="without the low-VRAM flags (bf16, sdpa, cached)")
    parser.add_argument(
        "--without",
        default="",
        help="low-VRAM flags to leave out, without dashes, comma-separated (e.g. fp8_base,gradient_checkpointing)",
    )
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    if repo != HERE:
        load_own("measure.tensor_memory", HERE / "library" / "measure" / "tensor_memory.py")
        load_own("measure.phases", HERE / "library" / "measure" / "phases.py")
        load_own("measure.simulated_device", HERE / "library" / "measure" / "simulated_device.py")
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    import train_network
    from library.families import get_family
    from library.families.registry import trained_together
    from library.run.demo import make_example_dataset, make_tiny_model

    family = get_family(args.family)
    resolution = args.resolution or family.default_resolution()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="devmem-"))
    data = work / "data"
    if not data.exists():
        make_example_dataset(work / "four", size=resolution)
        (data / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (data / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    prompts = work / "prompts.txt"
    prompts.write_text(f"a red circle --w {resolution} --h {resolution} --s 4\n")
    # the path names the family (a tiny diffusers folder of it); its weights are never read: family.load is replaced
    model = make_tiny_model(work / "tiny", args.family)
    family.load = real_size_loader(family, args.device)
    settings = ["--mixed_precision", "bf16", "--sdpa", "--cache_latents", "--cache_text_encoder_outputs"] if args.plain \
        else [f for f in SETTINGS if f.lstrip("-") not in args.without.split(",")]  # fmt: skip
    argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
            "--resolution", str(resolution), "--output_dir", str(work / "out"), "--output_name", "lora",
            "--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "8",
            "--network_train_unet_only", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
            "--train_batch_size", "1", "--max_train_steps", str(args.steps), "--max_data_loader_n_workers", "0",
            "--seed", "0", "--save_model_as", "safetensors", "--sample_sampler", "euler_a", *settings,
            *args.extra.split()]  # fmt: skip
    if not args.no_sample:
        argv += ["--sample_prompts", str(prompts), "--sample_every_n_steps", str(args.steps)]
    names = trained_together(args.family)
    speed = speed_probe() if args.device == "cuda" and args.steps > 2 else None
    start = time.time()
    measured: dict[str, dict[str, int]] = {}
    if args.device == "meta":
        from library.measure.simulated_device import simulated_device

        fused_attention()
        with simulated_device(strict=repo == HERE) as sim:
            result = train_network.run(argv, family_names=names)
        table = sim.phase_table()
    else:
        from library.measure.phases import cuda_phase_peaks, instrumented

        with instrumented(cuda_phase_peaks(measured)) as peaks:
            result = train_network.run(argv, family_names=names)
        table = peaks.table()
    out = {"family": args.family, "resolution": resolution, "device": args.device, "repo": str(repo),
           "settings": " ".join(settings + args.extra.split()), "steps": result.steps,
           "peak_mib": table, "highest_mib": max(table.values()), "wall_s": round(time.time() - start, 1)}  # fmt: skip
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        # what the card held: the allocator's reserved peak, and the driver's used memory (context included)
        out["reserved_mib"] = {k: round(v["reserved"] / 2**20, 1) for k, v in measured.items()}
        out["device_used_mib"] = {k: round(v["device_used"] / 2**20, 1) for k, v in measured.items()}
    if speed is not None:  # step 2 ran under FlopCounterMode, which keeps tensors a plain step frees (SDXL 1024 with
        # fp8 + checkpointing: 9.7 GB on an H200 and on the simulated device, 3.3 GB without the counter)
        out["peak_mib"].pop("step", None)
        out["highest_mib"] = max(out["peak_mib"].values())
        out["step_peak"] = "not measured in a speed run (the FLOP-counted step keeps extra tensors); use --steps 2"
        out.update(speed.report())
    print(json.dumps(out))


class speed_probe:  # noqa: N801 - used like a function
    """Step times (synchronized) and the FLOPs of step 2 (torch.utils.flop_counter), hooked on Trainer.step_done."""

    def __init__(self) -> None:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from library.run.trainer import Trainer

        self.stamps: list[float] = []
        self.counter = FlopCounterMode(display=False)
        step_done = Trainer.step_done

        def stamped(trainer, loss):
            step_done(trainer, loss)
            torch.cuda.synchronize()
            self.stamps.append(time.time())
            if trainer.step == 1:
                self.counter.__enter__()
            elif trainer.step == 2:
                self.counter.__exit__(None, None, None)

        Trainer.step_done = stamped

    def report(self) -> dict:
        import torch

        sys.path.insert(0, str(HERE / "benchmarks"))
        from bench_train import BF16_PEAK_TFLOPS

        per_step = [b - a for i, (a, b) in enumerate(zip(self.stamps, self.stamps[1:])) if i >= 1]  # not the FLOP step
        s_per_step = statistics.median(per_step)
        flops = self.counter.get_total_flops()
        name = torch.cuda.get_device_name()
        peak = next((float(v) for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
        return {"s_per_step": round(s_per_step, 4), "gflop_per_step": round(flops / 1e9, 1),
                "achieved_tflops": round(flops / s_per_step / 1e12, 2),
                "mfu": round(flops / s_per_step / (peak * 1e12), 4) if peak else None}  # fmt: skip


if __name__ == "__main__":
    main()
