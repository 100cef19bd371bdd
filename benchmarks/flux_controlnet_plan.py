"""``--plan_memory`` of flux_train_control_net.py on the real-size FLUX.1-dev, from files without weights.

    python benchmarks/flux_controlnet_plan.py [--swap 0 18] [--vram 24] [--workdir DIR]

The released FLUX.1-dev (transformer, CLIP-L, T5-XXL, AE) as header-only files (benchmarks/plan_real_size.py), the
demo's 4 images at 1024 px with themselves as conditioning images, and sd-scripts' kind of ControlNet command:
bf16, AdamW, gradient checkpointing, cached latents and text-encoder outputs, batch 1; one plan per
``--blocks_to_swap`` value. Prints one JSON line per plan: the device and host peaks and each phase's device MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

COMMON = ["--optimizer_type", "AdamW", "--learning_rate", "2e-5", "--mixed_precision", "bf16",
          "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
          "--max_data_loader_n_workers", "0", "--seed", "0", "--max_train_steps", "1", "--resolution", "1024",
          "--caption_extension", ".txt", "--plan_memory"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swap", nargs="+", type=int, default=[0, 18])
    parser.add_argument("--vram", default=None)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from plan_real_size import write_files

    import flux_train_control_net
    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-flux-cn-"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    model_flags = write_files("flux-dev", work / "model")
    data = make_example_dataset(work / "data", size=1024) / "10_sks shape"
    shutil.copytree(data, data.parent / "cond", dirs_exist_ok=True)
    for swap in args.swap:
        argv = [*model_flags, "--train_data_dir", str(data), "--conditioning_data_dir", str(data.parent / "cond"),
                "--output_dir", str(work / "out"), *COMMON, "--blocks_to_swap", str(swap),
                *(["--vram", args.vram] if args.vram else [])]  # fmt: skip
        start = time.time()
        plan = plan_command(lambda argv=argv: flux_train_control_net.run(argv), out=lambda s: print(s, file=sys.stderr))
        print(json.dumps({"blocks_to_swap": swap, "plan_s": round(time.time() - start, 1),
                          "device_peak_mib": plan["device_peak_mib"], "card_peak_mib": plan["card_peak_mib"],
                          "host_peak_mib": plan["host_peak_mib"],
                          "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
