"""``--plan_memory`` of the ControlNet trainers on the released SD1.5 (512 px) and SDXL (1024 px) architectures,
written as header-only files (benchmarks/plan_real_size.py): no weights are read, so it runs on a laptop.

    python benchmarks/controlnet_memory.py [--family sd1 sdxl] [--vram 12]

Prints the plan table per family (stderr) and one JSON line with the peaks (stdout). The commands: AdamW, bf16,
``--gradient_checkpointing --cache_latents`` (SDXL also ``--cache_text_encoder_outputs``), batch 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

COMMON = ["--optimizer_type", "AdamW", "--learning_rate", "1e-5", "--mixed_precision", "bf16",
          "--gradient_checkpointing", "--cache_latents", "--sdpa", "--max_data_loader_n_workers", "0", "--seed", "0",
          "--max_train_steps", "1"]  # fmt: skip
SCRIPTS = {
    "sd1": ("train_control_net", 512, []),
    "sdxl": ("sdxl_train_control_net", 1024, ["--cache_text_encoder_outputs", "--control_net_lr", "1e-4"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--vram", default=None)
    args = parser.parse_args()
    from plan_real_size import write_files

    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(tempfile.mkdtemp(prefix="plan-controlnet-"))
    for name in args.family:
        script, resolution, extra = SCRIPTS[name]
        folder = work / name
        folder.mkdir(parents=True)
        model_flags = write_files(name, folder)
        data = make_example_dataset(work / f"data{resolution}", size=resolution) / "10_sks shape"  # self-paired
        argv = [*model_flags, "--train_data_dir", str(data), "--conditioning_data_dir", str(data),
                "--caption_extension", ".txt", "--resolution", str(resolution), "--output_dir", str(work / "out"),
                *COMMON, *extra, "--plan_memory", *(["--vram", args.vram] if args.vram else [])]  # fmt: skip
        run = importlib.import_module(script).run
        start = time.time()
        plan = plan_command(lambda run=run, argv=argv: run(argv), out=lambda line: print(line, file=sys.stderr))
        print(json.dumps({"family": name, "script": script + ".py", "resolution": resolution,
                          "plan_s": round(time.time() - start, 1), "device_peak_mib": plan["device_peak_mib"],
                          "card_peak_mib": plan["card_peak_mib"],
                          "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
