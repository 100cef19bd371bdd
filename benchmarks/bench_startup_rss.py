"""Peak RSS of whole tiny training runs whose caches are already written, two checkouts side by side (run by hand).

    python benchmarks/bench_startup_rss.py --base OTHER_CHECKOUT --cases sd1,qwen_image,hunyuan_image,anima --pairs 2

Each run is this venv's python running the family's training script of a checkout (``OMP_NUM_THREADS=1``) under
``/usr/bin/time -v``; the sides alternate (base, this checkout, base, ...) after one untimed run of this checkout that
fills the caches (the ``--demo`` folder; Qwen-Image's with our caching scripts, musubi-tuner's workflow; HunyuanImage
and Anima a ``--cache_dir``), so every timed run reads its text-encoder outputs from disk and needs no tokenizer.
Prints one JSON line per run (rc, peak RSS MB, CPU s, wall s) and whether both sides wrote the same LoRA, bit for
bit. Models: the peer kit's tiny files (``ASSETS/models/tiny-<family>``) and its 8 images (``ASSETS/data/train``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--seed", "1", "--max_data_loader_n_workers", "0", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
          "--network_dim", "4", "--network_alpha", "2", "--max_train_steps", "4", "--output_name", "lora"]  # fmt: skip


def cases(models: Path, images: Path, work: Path) -> dict[str, list[str]]:
    q, h, a = models / "tiny-qwen_image", models / "tiny-hunyuan_image", models / "tiny-anima"
    sd = ["--train_data_dir", str(images), "--resolution", "64", "--caption_extension", ".txt", "--cache_latents",
          "--cache_text_encoder_outputs", "--network_train_unet_only", "--mixed_precision", "bf16"]  # fmt: skip
    return {
        "sd1": ["train_network.py", "--demo", "--demo_dir", str(work / "demo"), "--seed", "1", "--max_train_steps",
                "4", "--max_data_loader_n_workers", "0"],
        "qwen_image": ["qwen_image_train_network.py", "--dit", str(q / "tiny_dit.safetensors"), "--vae",
                       str(q / "tiny_vae.safetensors"), "--text_encoder", str(q / "tiny_te.safetensors"),
                       "--network_module", "networks.lora_qwen_image", "--timestep_sampling", "shift",
                       "--discrete_flow_shift", "2.2", "--weighting_scheme", "none", "--sdpa", "--mixed_precision",
                       "bf16", "--dataset_config", str(work / "qwen.toml"), *COMMON],
        "hunyuan_image": ["hunyuan_image_train_network.py", "--pretrained_model_name_or_path",
                          str(h / "tiny_dit.safetensors"), "--text_encoder", str(h / "tiny_qwen.safetensors"), "--byt5",
                          str(h / "tiny_byt5.safetensors"), "--vae", str(h / "tiny_vae.safetensors"),
                          "--network_module", "networks.lora_hunyuan_image", "--model_prediction_type", "raw",
                          "--discrete_flow_shift", "5.0", "--attn_mode", "torch", *COMMON, *sd, "--cache_dir",
                          str(work / "hunyuan_cache")],
        "anima": ["anima_train_network.py", "--pretrained_model_name_or_path", str(a / "tiny_dit.safetensors"),
                  "--qwen3", str(a / "tiny_qwen3.safetensors"), "--vae", str(a / "tiny_vae.safetensors"),
                  "--network_module", "networks.lora_anima", *COMMON, *sd, "--cache_dir", str(work / "anima_cache")],
    }  # fmt: skip


def run(checkout: Path, argv: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    start = time.time()
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, *argv, "--output_dir", str(out)], cwd=checkout, env=env,
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)

    def field(name: str) -> float:
        return float(re.search(rf"{re.escape(name)}: ([\d.]+)", p.stderr).group(1))

    cpu = field("User time (seconds)") + field("System time (seconds)")
    return {"rc": p.returncode, "peak_rss_mb": round(field("Maximum resident set size (kbytes)") / 1024),
            "cpu_s": round(cpu, 1), "wall_s": round(time.time() - start, 1)}  # fmt: skip


def same_lora(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(next(a.rglob("*lora.safetensors"))), load_file(next(b.rglob("*lora.safetensors")))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (measured first in each pair)")
    parser.add_argument("--cases", default="sd1,qwen_image,hunyuan_image,anima")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--assets", type=Path, default=Path.home() / "sdtrain-peer")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_startup_rss"))
    args = parser.parse_args()
    work, images = args.workdir, args.assets / "data" / "train"
    work.mkdir(parents=True, exist_ok=True)
    toml = work / "qwen.toml"
    toml.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 1\n'
                    f'enable_bucket = false\n\n[[datasets]]\nimage_directory = "{(images / "10_sks").as_posix()}"\n'
                    f'cache_directory = "{(work / "qwen_cache").as_posix()}"\nnum_repeats = 1\n')  # fmt: skip
    table = cases(args.assets / "models", images, work)
    names = args.cases.split(",")
    if "qwen_image" in names:  # musubi-tuner's workflow: the caching scripts first
        q = args.assets / "models" / "tiny-qwen_image"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        for script, flags in (("qwen_image_cache_latents.py", ["--vae", str(q / "tiny_vae.safetensors")]),
                              ("qwen_image_cache_text_encoder_outputs.py",
                               ["--text_encoder", str(q / "tiny_te.safetensors"), "--batch_size", "1"])):  # fmt: skip
            subprocess.run([sys.executable, script, "--dataset_config", str(toml), *flags], cwd=ROOT, env=env,
                           check=True, capture_output=True)  # fmt: skip
    for name in names:
        out = work / "out" / name
        print(json.dumps({"case": name, "side": "warm-up", **run(ROOT, table[name], out / "warm")}), flush=True)
        for i in range(args.pairs):
            for side, checkout in (("base", args.base), ("this", ROOT)):
                print(json.dumps({"case": name, "side": side, "pair": i, **run(checkout, table[name], out / f"{side}{i}")}),
                      flush=True)  # fmt: skip
            print(json.dumps({"case": name, "pair": i, "same_lora": same_lora(out / f"base{i}", out / f"this{i}")}))


if __name__ == "__main__":
    main()
