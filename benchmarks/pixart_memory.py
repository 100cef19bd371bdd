"""``--plan_memory`` of a real-size PixArt LoRA command at 1024 px (goal: PixArt-Σ ≤ 8 GiB on the card with the T5
cache), from files without weights.

    python benchmarks/pixart_memory.py [--family pixart_sigma pixart_alpha] [--workdir DIR] [--dim 16] [--extra "..."]

Writes the released architecture as the files users have (the official transformer single file, ``--t5xxl`` T5-XXL
and ``--vae``: the SDXL VAE for Σ, the SD VAE for α) holding their safetensors headers only (benchmarks/
plan_real_size.py's way: real names, shapes and bf16 dtypes, no tensor data), then plans pixart_train_network.py's
command on them (the training script with ``--plan_memory``): ``networks.lora`` rank 16, AdamW, ``--mixed_precision
bf16 --gradient_checkpointing --cache_latents --cache_text_encoder_outputs --network_train_unet_only``, batch 1, one
1024 px image, no samples. Prints one JSON line per family: the plan's device and card peaks per phase (MiB) and
whether the card peak (CUDA context and the allocator's reserve included) is within 8 GiB.

Measured (2026-11-29, this planner): PixArt-Σ card peak 11.71 GiB in bf16, its text-caching phase (T5-XXL's bf16
weights, 9.16 GiB) the peak, the step 1.78 GiB; with ``--extra=--fp8_base`` (T5 and the transformer stored in
float8) 7.77 GiB: text caching 5.85 GiB, step 1.23 GiB (two planned steps), within the 8 GiB goal (docs/pixart.md's
rows: benchmarks/docs_memory_tables.py --table pixart, checked against these JSON lines). Use a fresh
``--workdir``: a second run reuses the disk caches and plans no caching phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

GOAL_MIB = 8 * 1024
COMMON = ["--network_module", "networks.lora", "--network_alpha", "8", "--network_train_unet_only",
          "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--mixed_precision", "bf16",
          "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
          "--max_data_loader_n_workers", "0", "--seed", "0", "--max_train_steps", "1"]  # fmt: skip


def write_files(name: str, folder: Path) -> list[str]:
    """The model flags of a command on ``name``'s header-only files in ``folder``."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    from library.families import get_family
    from library.families.loading import shipped_configs
    from library.measure.phantom import PhantomDevice, _mark, header_only_writes

    family = get_family(name)
    with PhantomDevice(strict=False), header_only_writes():
        parts = family.reference_parts()
        with init_empty_weights():
            vae = AutoencoderKL.from_config(shipped_configs("sdxl-base" if name == "pixart_sigma" else "sd15")["vae"])
        parts = dataclasses.replace(parts, vae=vae)
        for module in (parts.denoiser, parts.vae, *parts.text_encoders):
            module.to(torch.bfloat16).to_empty(device="cpu")
            for t in (*module.parameters(), *module.buffers()):
                _mark(t)
        model = family.save(parts, folder / f"{name}.safetensors")
        extra = family.tiny.write_files(parts, folder, name)
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    if written > 2**26:
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    return ["--pretrained_model_name_or_path", str(model)] + [
        w for p, path in extra.items() for w in (f"--{p}", str(path))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=["pixart_sigma"], choices=["pixart_sigma", "pixart_alpha"])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--dim", default="16")
    parser.add_argument("--extra", default="", help="more flags for the command (e.g. '--train_batch_size 2')")
    args = parser.parse_args()

    import pixart_train_network
    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-pixart-"))
    for name in args.family:
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        model_flags = write_files(name, folder)
        data = make_example_dataset(work / "data1024", size=1024)
        argv = [*model_flags, "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "1024",
                "--output_dir", str(work / "out"), "--network_dim", args.dim, *COMMON, *args.extra.split(),
                "--plan_memory"]  # fmt: skip
        plan = plan_command(
            lambda argv=argv: pixart_train_network.run(argv), out=lambda line: print(line, file=sys.stderr)
        )
        print(json.dumps({"family": name, "extra": args.extra, "device_peak_mib": plan["device_peak_mib"],
                          "card_peak_mib": plan["card_peak_mib"], "host_peak_mib": plan["host_peak_mib"],
                          "meets_8_gib": plan["card_peak_mib"] <= GOAL_MIB,
                          "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
