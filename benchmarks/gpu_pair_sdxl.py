"""sdtrain against kohya-ss/sd-scripts on the same CUDA GPU: a real-size SDXL LoRA at 1024 px, s/step (part of
benchmarks/gpu_check.sh when sd-scripts is carried along).

    python benchmarks/gpu_pair_sdxl.py --sdscripts SDS_DIR --sds_site SITE --tokcache TOKCACHE [--steps 20]

Both sides train the same random-weight real-size SDXL (benchmarks/real_size_model.py, a diffusers folder in bf16,
built once) on the same two 1024 px images with the same flags: ``--mixed_precision bf16 --sdpa --cache_latents
--cache_text_encoder_outputs --network_train_unet_only``, LoRA dim 16 / alpha 8 (``networks.lora``), AdamW, batch 1.
sd-scripts runs from SDS_DIR with its own pinned packages installed in SITE (transformers 4.54.1, diffusers 0.32.1,
huggingface_hub 0.34.3, tokenizers 0.21.4, accelerate 1.6.0, voluptuous, imagesize; the machine's torch), sdtrain
from this checkout. The sides run one after the other (sd-scripts first), each in its own process.

Step times come from the "steps" progress bar both projects update once per optimizer step: a ``sitecustomize``
written to a temporary folder first on PYTHONPATH stamps every update (``torch.cuda.synchronize`` first); s/step is
the median interval of steps 3..N. Prints one JSON line per side and one with the ratio (sdtrain / sd-scripts).
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
HOOK = """
import os, time
_stamps = os.environ.get("PAIR_STAMPS")
if _stamps:
    import tqdm.std as _t
    _update = _t.tqdm.update
    def update(self, n=1):
        result = _update(self, n)
        if (getattr(self, "desc", "") or "").strip().startswith("steps"):
            try:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            except Exception:
                pass
            with open(_stamps, "a") as f:
                f.write(f"{time.time()}\\n")
        return result
    _t.tqdm.update = update
"""


def flags(model: Path, data: Path, out: Path, steps: int, tokcache: Path, resolution: int) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", str(resolution), "--train_batch_size", "1",
            "--max_train_steps", str(steps), "--network_module", "networks.lora", "--network_dim", "16",
            "--network_alpha", "8", "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
            "--mixed_precision", "bf16", "--sdpa", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
            "--seed", "42", "--max_data_loader_n_workers", "0", "--output_dir", str(out), "--output_name", "lora",
            "--save_model_as", "safetensors", "--tokenizer_cache_dir", str(tokcache)]  # fmt: skip


def run_side(name: str, cmd: list[str], cwd: Path, pythonpath: list[str], work: Path, timeout: float) -> dict:
    stamps = work / f"{name}.stamps"
    stamps.unlink(missing_ok=True)
    env = dict(os.environ, PAIR_STAMPS=str(stamps), HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(pythonpath))
    env.pop("TQDM_DISABLE", None)
    start = time.time()
    with open(work / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    times = [float(t) for t in stamps.read_text().split()] if stamps.exists() else []
    intervals = [b - a for a, b in zip(times, times[1:])][1:]  # steps 3..N
    return {"side": name, "rc": rc, "wall_s": round(time.time() - start, 1), "steps_stamped": len(times),
            "s_per_step": round(statistics.median(intervals), 4) if intervals else None,
            "first_step_s": round(times[0] - start, 1) if times else None,
            "log_tail": (work / f"{name}.log").read_text()[-600:] if rc else ""}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdscripts", required=True, help="sd-scripts' source folder")
    parser.add_argument("--sds_site", required=True, help="the folder sd-scripts' own packages are installed in")
    parser.add_argument("--tokcache", required=True, help="--tokenizer_cache_dir with the CLIP-L and bigG tokenizers")
    parser.add_argument("--sds_python", default=sys.executable, help="the interpreter for sd-scripts (default: this)")
    parser.add_argument(
        "--sds_path",
        default="",
        help="folders added to sd-scripts' PYTHONPATH (e.g. a torchvision stand-in on a machine without torchvision)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per side")
    parser.add_argument("--model", default=None, help="an SDXL diffusers folder (default: the real-size one, built)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from real_size_model import build

    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpupair-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    data = work / "data"
    if not data.exists():
        make_example_dataset(work / "four", size=args.resolution)
        (data / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:4]:  # two images and their captions
            (data / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    start = time.time()
    model = Path(args.model).resolve() if args.model else build("sdxl", work / "sdxl-real", "bf16")
    print(json.dumps({"built": str(model), "s": round(time.time() - start, 1)}), flush=True)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    sds = Path(args.sdscripts).resolve()
    rows = []
    for name, cmd, cwd, path in (
        (
            "sd-scripts",
            [args.sds_python, "sdxl_train_network.py"],
            sds,
            [str(hook), str(Path(args.sds_site).resolve()), *filter(None, args.sds_path.split(os.pathsep))],
        ),
        ("sdtrain", [sys.executable, str(ROOT / "sdxl_train_network.py")], ROOT, [str(hook), *inherited, str(ROOT)]),
    ):
        tokcache = Path(args.tokcache).resolve()
        argv = flags(model, data, work / name, args.steps, tokcache, args.resolution)
        row = run_side(name, cmd + argv, cwd, path, work, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    a, b = (r["s_per_step"] for r in rows)
    first = [r["first_step_s"] for r in rows]
    print(json.dumps({"pair": f"sdxl_lora_{args.resolution}_bf16", "steps": args.steps,
                      "s_per_step_ratio": round(b / a, 3) if a and b else None,
                      "first_step_ratio": round(first[1] / first[0], 3) if all(first) else None}))  # fmt: skip


if __name__ == "__main__":
    main()
