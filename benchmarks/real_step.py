"""One LoRA training step per family at real width on the CPU, sdtrain's model beside its reference's (run by hand).

    # both sides, one after the other (never at once), and the ratio; --pairs 2: reference, ours, ours, reference
    python3 benchmarks/real_step.py both --family qwen_image [--python .venv/bin/python] [--res 256] [--steps 2] \\
        [--pairs 1] [--threads 1] [--blocks 1,2]
    # one side (the reference in its venv: sd-scripts with cwd = its checkout, musubi-tuner with its src on
    # PYTHONPATH; see :data:`REFERENCES`), one JSON line:
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/real_step.py ours --family zimage

The families with a reference trainer that sd3_real_step.py does not cover: Anima, Lumina 2, HunyuanImage 2.1,
FLUX.1-dev, Chroma, SD1.5, SD2, SDXL (sd-scripts), Qwen-Image, Qwen-Image Edit, Z-Image, FLUX.2 klein 4B and dev
(musubi-tuner), PixArt-α and Σ (OneTrainer: its checkout ``--onetrainer`` and venv ``--otvenv``), Stable Cascade stage C (sd-scripts' ``stable-cascade`` branch: its tree at
``~/sdtrain-peer/sd-scripts-sc`` unless ``--sdscripts`` names another) and Würstchen 2's prior (the ``wuerstchen``
branch, ``~/sdtrain-peer/sd-scripts-w2``; a full fine-tune: the branch has no network trainer, so every prior
parameter is trained on both sides and ``names`` are its parameters). Each side builds the released denoiser's width,
head count, MLP ratio and text width with fewer blocks (SD1.5, SD2, SDXL: the whole UNet;
``real_step_sides.DEPTHS``: the same on both sides; ``--blocks`` changes them), random float32 weights, a LoRA of
dim 4 / alpha 2 on its default targets with its own network module (the trainers' ``--network_module
networks.lora_<family> --network_train_unet_only``; real_step_references.py and real_step_ours.py), and runs what a
training step runs on the denoiser: the trainer's call on noisy latents (batch 1, ``--res`` px) and the
cached text (``real_step_sides.TEXT`` tokens), MSE against a target, backward, AdamW step, zero grad. One step
warms up, then ``--steps`` steps are timed (median CPU seconds, i.e. process time, and wall seconds printed);
``--profile FILE`` writes torch.profiler's operator table of one more step. Text encoders, VAE, data loading and
the trainers' loops are not in it (the tiny paired runs of bench_vs_sdscripts.py measure those).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# family -> (reference, its trainer)
REFERENCES = {"anima": ("sd-scripts", "anima_train_network.py"), "lumina": ("sd-scripts", "lumina_train_network.py"),
              "hunyuan_image": ("sd-scripts", "hunyuan_image_train_network.py"),
              "flux": ("sd-scripts", "flux_train_network.py"),
              "qwen_image": ("musubi-tuner", "qwen_image_train_network.py"),
              "zimage": ("musubi-tuner", "zimage_train_network.py"),
              "flux2": ("musubi-tuner", "flux_2_train_network.py --model_version klein-base-4b"),
              "stable_cascade": ("sd-scripts", "stable_cascade_train_c_network.py"),
              "wuerstchen": ("sd-scripts", "wuerstchen/wuerstchen_train.py"),
              "chroma": ("sd-scripts", "flux_train_network.py --model_type chroma"),
              "sdxl": ("sd-scripts", "sdxl_train_network.py"),
              "sd1": ("sd-scripts", "train_network.py"), "sd2": ("sd-scripts", "train_network.py --v2"),
              "flux2_dev": ("musubi-tuner", "flux_2_train_network.py --model_version dev"),
              "qwen_image_edit": ("musubi-tuner", "qwen_image_train_network.py --edit"),
              "pixart_sigma": ("OneTrainer", "scripts/train.py, model_type PIXART_SIGMA, LORA"),
              "pixart_alpha": ("OneTrainer", "scripts/train.py, model_type PIXART_ALPHA, LORA")}  # fmt: skip
# the sd-scripts tree of a family whose trainer lives on a branch of its own (default of --sdscripts)
BRANCH_TREES = {"stable_cascade": "~/sdtrain-peer/sd-scripts-sc", "wuerstchen": "~/sdtrain-peer/sd-scripts-w2"}


def run_side(side: str, family: str, blocks: tuple[int, ...], res: int, steps: int, profile: str | None) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    import real_step_sides
    from sd3_real_step import timed_steps

    t0 = time.perf_counter()
    forward, params, names = real_step_sides.build(family, side, blocks, res)
    build_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    target = None

    def step():
        nonlocal target
        out = forward()
        if target is None:
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        torch.nn.functional.mse_loss(out.float(), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, cpu = timed_steps(step, steps, profile)
    denoiser_params = sum(p.numel() for p in real_step_sides.last_model_params())
    return {"side": side, "family": family, "blocks": list(blocks), "res": res, "threads": torch.get_num_threads(),
            "adapted_modules": len(names),
            "names_sha1": hashlib.sha1("\n".join(sorted(names)).encode()).hexdigest()[:12], "adapter_params": sum(p.numel() for p in params),
            "denoiser_params": denoiser_params, "build_s": round(build_s, 2), "first_step_s": round(times[0], 2),
            "step_s": statistics.median(times[1:]), "cpu_step_s": statistics.median(cpu[1:]),
            "cpu_steps_s": [round(c, 3) for c in cpu[1:]],
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}  # fmt: skip


def side_command(a: argparse.Namespace, side: str, pair: int) -> tuple[list[str], Path, dict]:
    """``(argv, cwd, env)`` of one side's process."""
    common = [__file__, side, "--family", a.family, "--res", str(a.res), "--steps", str(a.steps), "--json"]
    if a.blocks:
        common += ["--blocks", a.blocks]
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        common += ["--profile", str(Path(a.profile).resolve() / f"{a.family}_{side}_{pair}.txt")]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    if side == "ours":
        return [a.python, *common], ROOT, dict(env, PYTHONPATH=str(ROOT))
    if REFERENCES[a.family][0] == "OneTrainer":  # its own venv (torchvision; benchmarks/README.md)
        python = str(Path(a.otvenv).expanduser() / "bin" / "python")
        return [python, *common], Path(a.onetrainer).expanduser(), env
    python = str(Path(a.refvenv).expanduser() / "bin" / "python")
    if REFERENCES[a.family][0] == "sd-scripts":
        tree = a.sdscripts or BRANCH_TREES.get(a.family, "~/sdtrain-peer/sd-scripts")
        return [python, *common], Path(tree).expanduser(), dict(env, PYTHONPATH=str(Path(a.kit) / "sds_shims"))
    musubi = Path(a.musubi).expanduser() / "src"
    return [python, *common], musubi, dict(env, PYTHONPATH=f"{musubi}:{Path(a.kit) / 'sds_shims'}")


def both(a: argparse.Namespace) -> None:
    """The two sides one after the other, each its own process, ``--pairs`` times (the reference first in odd pairs,
    ours first in even ones: a side's place in the pair does not favour it); prints each run's JSON line and the
    ratios of CPU seconds per step."""
    ratios = []
    for pair in range(a.pairs):
        results = {}
        for side in ("reference", "ours") if pair % 2 == 0 else ("ours", "reference"):
            argv, cwd, env = side_command(a, side, pair + 1)
            out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            results[side] = json.loads(out.stdout.strip().splitlines()[-1])
            results[side]["load"] = round(os.getloadavg()[0], 1)
            print(json.dumps(results[side]), flush=True)
        ref, ours = results["reference"], results["ours"]
        if (ours["names_sha1"], ours["adapter_params"]) != (ref["names_sha1"], ref["adapter_params"]):
            print("WARNING: the two sides adapt different module sets (names_sha1 / adapter_params differ)")
        ratios.append(ours["cpu_step_s"] / ref["cpu_step_s"])
        print(f"pair {pair + 1} ({'reference' if pair % 2 == 0 else 'ours'} first): ours / {REFERENCES[a.family][0]} CPU s/step {ratios[-1]:.3f}, wall s/step "
              f"{ours['step_s'] / ref['step_s']:.3f}; {ours['adapted_modules']} / "
              f"{ref['adapted_modules']} modules, {ours['adapter_params']:,} / {ref['adapter_params']:,} adapter parameters; peak RSS {ours['peak_rss_gb']} / {ref['peak_rss_gb']} GB", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=["reference", "ours", "both"])
    ap.add_argument("--family", required=True, choices=sorted(REFERENCES))
    ap.add_argument("--blocks", default=None, help="blocks kept, comma-separated as DEPTHS lists them (double,single)")
    ap.add_argument("--res", type=int, default=256, help="image side in pixels")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument(
        "--profile",
        default=None,
        help="write torch.profiler's operator table of one more step here (both: a folder, one table per run)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--pairs", type=int, default=1, help="both: reference / ours pairs, one process at a time")
    ap.add_argument("--threads", type=int, default=1, help="both: OMP_NUM_THREADS of each side")
    venv = ROOT / ".venv" / "bin" / "python"
    ap.add_argument("--python", default=str(venv) if venv.exists() else sys.executable, help="both: our side's python")
    ap.add_argument(
        "--sdscripts",
        default=None,
        help="default ~/sdtrain-peer/sd-scripts (Stable Cascade / Würstchen 2: their branches' trees, "
        "~/sdtrain-peer/sd-scripts-sc / sd-scripts-w2)",
    )
    ap.add_argument("--musubi", default="~/musubi")
    ap.add_argument("--refvenv", default="~/sdtrain-peer/sdsvenv", help="sd-scripts' and musubi-tuner's venv")
    ap.add_argument("--onetrainer", default="~/sdtrain-peer/onetrainer", help="OneTrainer's checkout (PixArt)")
    ap.add_argument("--otvenv", default="~/sdtrain-peer/otvenv", help="OneTrainer's venv")
    ap.add_argument("--kit", default="/work/shared/peer/helpers", help="the peer kit's helpers (torchvision stand-in)")
    a = ap.parse_args()
    if a.side == "both":
        return both(a)
    sys.path.insert(0, str(HERE))
    import real_step_sides

    blocks = tuple(int(b) for b in a.blocks.split(",")) if a.blocks else real_step_sides.DEFAULT_BLOCKS[a.family]
    r = run_side(a.side, a.family, blocks, a.res, a.steps, a.profile)
    print(json.dumps(r) if a.json else r)


if __name__ == "__main__":
    main()
