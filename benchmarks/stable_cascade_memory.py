"""``--plan_memory`` of real-size Stable Cascade stage C LoRA commands at 1024 px (the guide's anchors one card smaller:
stage C 3.6B LoRA ≤ 12 GiB, lite ≤ 6 GiB), from files without weights.

    python benchmarks/stable_cascade_memory.py [--variant 3.6b lite] [--workdir DIR] [--dim 16] [--extra "..."]

Writes the released architectures as the files users have (Stability's stage C single file, the CLIP-bigG text model
for ``--text_model_checkpoint_path`` and the EfficientNetV2-S ``effnet_encoder.safetensors``) holding their
safetensors headers only (benchmarks/plan_real_size.py's way: real names, shapes and bf16 dtypes, no tensor data),
then plans stable_cascade_train_c_network.py's command on them (``--plan_memory``): ``networks.lora`` rank 16, AdamW,
``--mixed_precision bf16 --gradient_checkpointing --cache_latents --cache_text_encoder_outputs
--network_train_unet_only``, batch 1, one 1024 px image. Prints one JSON line per variant: the plan's device and card
peaks per phase (MiB) and whether the card peak (CUDA context and the allocator's reserve included) meets the goal.
Use a fresh ``--workdir``: a second run reuses the disk caches and plans no caching phase.

Measured (2026-11-29, this planner): 3.6B card peak 10.07 GiB (the step: 7.76 GiB on the device, its bf16 weights
6.69 GiB; text caching 1.30 GiB), lite 3.65 GiB (step 2.37 GiB): both within their goals.
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

GOAL_MIB = {"3.6b": 12 * 1024, "lite": 6 * 1024}
FLAGS = {"text_model": "--text_model_checkpoint_path", "effnet": "--effnet_checkpoint_path"}
COMMON = ["--network_module", "networks.lora", "--network_alpha", "8", "--network_train_unet_only",
          "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--mixed_precision", "bf16",
          "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
          "--max_data_loader_n_workers", "0", "--seed", "0", "--max_train_steps", "1"]  # fmt: skip


def write_files(variant: str, folder: Path) -> list[str]:
    """The model flags of a command on ``variant``'s header-only files in ``folder``."""
    import torch
    from accelerate import init_empty_weights

    from library.families.stable_cascade import STABLE_CASCADE as family
    from library.families.stable_cascade.effnet import EfficientNetEncoder
    from library.families.stable_cascade.model import PRIOR_LITE, prior_factory
    from library.measure.phantom import PhantomDevice, _mark, header_only_writes

    with PhantomDevice(strict=False), header_only_writes():
        parts = family.reference_parts()
        with init_empty_weights():
            effnet = EfficientNetEncoder()
            prior = prior_factory(PRIOR_LITE)() if variant == "lite" else parts.denoiser
        parts = dataclasses.replace(parts, denoiser=prior, vae=effnet)
        for module in (parts.denoiser, parts.vae, *parts.text_encoders):
            module.to(torch.bfloat16).to_empty(device="cpu")
            for t in (*module.parameters(), *module.buffers()):
                _mark(t)
        model = family.save(parts, folder / f"stage_c_{variant}.safetensors")
        extra = family.tiny.write_files(parts, folder, variant)
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    if written > 2**26:
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    return ["--stage_c_checkpoint_path", str(model)] + [w for p, path in extra.items() for w in (FLAGS[p], str(path))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", nargs="+", default=["3.6b", "lite"], choices=list(GOAL_MIB))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--dim", default="16")
    parser.add_argument("--extra", default="", help="more flags for the command (e.g. '--train_batch_size 2')")
    args = parser.parse_args()

    import stable_cascade_train_c_network
    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-cascade-"))
    for variant in args.variant:
        folder = work / variant
        folder.mkdir(parents=True, exist_ok=True)
        model_flags = write_files(variant, folder)
        data = make_example_dataset(work / f"data1024-{variant}", size=1024)
        argv = [*model_flags, "--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "1024",
                "--output_dir", str(work / "out"), "--network_dim", args.dim, *COMMON, *args.extra.split(),
                "--plan_memory"]  # fmt: skip
        plan = plan_command(
            lambda argv=argv: stable_cascade_train_c_network.run(argv), out=lambda line: print(line, file=sys.stderr)
        )
        print(json.dumps({"variant": variant, "device_peak_mib": plan["device_peak_mib"],
                          "card_peak_mib": plan["card_peak_mib"], "host_peak_mib": plan["host_peak_mib"],
                          "goal_mib": GOAL_MIB[variant], "meets_goal": plan["card_peak_mib"] <= GOAL_MIB[variant],
                          "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
