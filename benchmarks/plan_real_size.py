"""``--plan_memory`` on real-size SD1.5, SDXL, FLUX.1-dev and SD3.5-large LoRA commands, from files without weights.

    python benchmarks/plan_real_size.py [--family sd1 sdxl flux-dev sd3.5-large] [--workdir DIR] [--vram 12]

Writes each released architecture as the files users have (SD1.5 / SDXL / SD3.5 single files, FLUX.1's BFL
transformer with ``--clip_l --t5xxl --ae``) holding their safetensors headers only: the real key names, shapes and
dtypes (bf16; SD1.5 fp16) and no tensor data, so any read of a weight value would fail. Then times the plan of a LoRA
command on them (tools/plan_memory.py's path: the training script with ``--plan_memory``) and prints one JSON line per
family: the plan's wall and CPU seconds, its peaks, and the process's peak RSS (the phantoms cost no resident memory).
Plan one family per process for its own time (the first plan of a process also imports the libraries the run uses,
and later plans reuse the meta outputs earlier ones remembered: library/measure/meta_outputs.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

COMMON = ["--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "8",
          "--network_train_unet_only", "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--mixed_precision",
          "bf16", "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
          "--max_data_loader_n_workers", "0", "--seed", "0"]  # fmt: skip
SCRIPTS = {"sd1": ("train_network", 512), "sdxl": ("sdxl_train_network", 1024),
           "flux-dev": ("flux_train_network", 1024), "sd3.5-large": ("sd3_train_network", 1024)}  # fmt: skip


def phantom_parts(name: str, dtype):
    """The released architecture of ``name`` with every tensor a phantom (library/measure/phantom.py)."""
    import dataclasses

    from accelerate import init_empty_weights

    from library.families import get_family
    from library.measure.phantom import _mark

    family = get_family(name)
    parts = family.reference_parts()
    with init_empty_weights():
        if name in ("sd1", "sdxl"):
            from diffusers import AutoencoderKL

            from library.families.loading import shipped_configs

            vae = AutoencoderKL.from_config(shipped_configs({"sd1": "sd15", "sdxl": "sdxl-base"}[name])["vae"])
        elif name.startswith("flux"):
            from library.families.flux.configs import ae_factory, released

            vae = ae_factory(released(name)["vae"])()
        else:
            from library.families.sd3.configs import released, vae_factory

            vae = vae_factory(released(name)["vae"])()
    parts = dataclasses.replace(parts, vae=vae)
    for module in (parts.denoiser, parts.vae, *parts.text_encoders):
        module.to(dtype).to_empty(device="cpu")
        for t in (*module.parameters(), *module.buffers()):
            _mark(t)
    return parts


def write_files(name: str, folder: Path) -> list[str]:
    """The model flags of a command on ``name``'s header-only files in ``folder``."""
    import torch

    from library.families import get_family
    from library.measure.phantom import PhantomDevice, header_only_writes

    family = get_family(name)
    dtype = torch.float16 if name == "sd1" else torch.bfloat16
    with PhantomDevice(strict=False), header_only_writes():
        parts = phantom_parts(name, dtype)
        model = family.save(parts, folder / f"{name}.safetensors")
        extra = family.tiny.write_files(parts, folder, name) if name.startswith("flux") else {}
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    if written > 2**26:  # headers only: a few hundred KB
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    flags = ["--pretrained_model_name_or_path", str(model)]
    return flags + [w for part, path in extra.items() for w in (f"--{part}", str(path))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--vram", default=None)
    args = parser.parse_args()
    import importlib

    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-real-"))
    for name in args.family:
        script, resolution = SCRIPTS[name]
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.time()
        model_flags = write_files(name, folder)
        written = time.time() - start
        data = make_example_dataset(work / f"data{resolution}", size=resolution)
        argv = [*model_flags, "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution",
                str(resolution), "--output_dir", str(work / "out"), "--max_train_steps", "1", *COMMON,
                "--plan_memory", *(["--vram", args.vram] if args.vram else [])]  # fmt: skip
        run = importlib.import_module(script).run
        start, cpu = time.time(), time.process_time()
        plan = plan_command(lambda run=run, argv=argv: run(argv), out=lambda line: print(line, file=sys.stderr))
        seconds, cpu = time.time() - start, time.process_time() - cpu
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(json.dumps({"family": name, "plan_s": round(seconds, 1), "plan_cpu_s": round(cpu, 1), "files_written_s": round(written, 1),
                          "file_bytes": size, "device_peak_mib": plan["device_peak_mib"],
                          "card_peak_mib": plan["card_peak_mib"], "host_peak_mib": plan["host_peak_mib"],
                          "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                          "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
