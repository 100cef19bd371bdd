"""One SD3.5-medium LoRA training step at real size on the CPU, sdtrain's model beside sd-scripts' (run by hand).

    # sd-scripts' MMDiT + networks.lora_sd3 (its venv, cwd = the sd-scripts checkout); ~10 GB
    cd ~/sdtrain-peer/sd-scripts && OMP_NUM_THREADS=1 PYTHONPATH=<peer kit>/helpers/sds_shims ~/sdtrain-peer/sdsvenv/bin/python \\
        <this repo>/benchmarks/sd3_real_step.py sdscripts [--res 256] [--steps 2] [--profile FILE]
    # ours: diffusers' SD3Transformer2DModel as the SD3 family builds it + our LoRA (networks.lora_sd3); ~10 GB
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/sd3_real_step.py ours [...]
    # both, one after the other (never at once), and the ratio:
    python3 benchmarks/sd3_real_step.py both [--res 256] [--threads 1]

Each side builds the released SD3.5-medium transformer (24 joint blocks of width 1536, 24 heads, dual attention in
blocks 0..12, RMS q/k norm, pos_embed 384²) with random weights in float32, puts a LoRA of dim 4 / alpha 2 on its
default targets with its own network module (the trainers' ``--network_module networks.lora_sd3
--network_train_unet_only``), and runs what a training step runs on the denoiser: forward on noisy latents (batch 1,
``--res`` px), context (1, 333, 4096) and pooled (1, 2048), MSE against a target, backward, AdamW step, zero grad.
One step warms up, then ``--steps`` steps are timed (median printed); ``--profile FILE`` writes torch.profiler's
operator table of one more step. Text encoders, VAE, data loading and the trainers' loops are not in it (the tiny
paired runs of benchmarks/peer/bench_pair.py measure those); this is the model's own cost where it dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, POOLED, DEPTH = 333, 2048, 24


def sdscripts_model():
    import torch

    sys.path.insert(0, os.getcwd())
    from library import sd3_models
    from networks import lora_sd3

    params = sd3_models.SD3Params(patch_size=2, depth=DEPTH, num_patches=384 * 384, pos_embed_max_size=384,
                                  adm_in_channels=POOLED, qk_norm="rms", x_block_self_attn_layers=list(range(13)),
                                  context_embedder_in_features=4096, context_embedder_out_features=64 * DEPTH,
                                  model_type="sd3m")  # fmt: skip
    mmdit = sd3_models.create_sd3_mmdit(params, attn_mode="torch")
    mmdit.requires_grad_(False)
    encoders = [torch.nn.Module() for _ in range(3)]  # no text-encoder adapters (--network_train_unet_only)
    network = lora_sd3.create_network(1.0, 4, 2, None, encoders, mmdit)
    network.apply_to(encoders, mmdit, apply_text_encoder=False, apply_unet=True)
    mmdit.train()

    def forward(x, t, context, pooled):
        return mmdit(x, t, y=pooled, context=context)

    return forward, [p for p in network.parameters() if p.requires_grad]


def our_model():
    sys.path.insert(0, str(ROOT))
    import sd3_train_network
    from library.families import get_family
    from library.families.base import Cond
    from library.families.sd3 import pos_embed
    from library.families.sd3.configs import released, transformer_factory
    from networks import NetworkConfig, prepare_network

    family = get_family("sd3.5-medium")
    parts = family.reference_parts()  # the text encoders stay on the meta device (no adapters on them)
    parts.denoiser = transformer_factory(released("sd3.5-medium")["transformer"])()
    parts.denoiser.requires_grad_(False)
    pos_embed.install(parts.denoiser)
    args = sd3_train_network.build_parser().parse_args(
        ["--network_module", "networks.lora_sd3", "--network_dim", "4", "--network_alpha", "2",
         "--network_train_unet_only"])  # fmt: skip
    network = prepare_network(NetworkConfig.from_args(args), family.adapter_roots(parts), family.target_classes)
    parts.denoiser.train()

    def forward(x, t, context, pooled):
        return family.predict(parts.denoiser, x, t, Cond(context, pooled, None))

    return forward, [p for p in network.parameters() if p.requires_grad]


def timed_steps(step, steps: int, profile: str | None) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of ``steps + 1`` calls of ``step`` (the first is the warm-up); with ``profile``
    one more step under torch.profiler, its operator table written to that file and the same per input shape to
    FILE.shapes.txt (also used by real_step.py)."""
    times, cpu = [], []
    for _ in range(steps + 1):
        s, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - s)
        cpu.append(time.process_time() - c)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            step()
        Path(profile).write_text(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        by_shape = p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=60)
        Path(f"{profile}.shapes.txt").write_text(by_shape)  # the same operators per input shape
    return times, cpu


def run_side(side: str, res: int, steps: int, profile: str | None) -> dict:
    import torch

    t0 = time.perf_counter()
    forward, params = (sdscripts_model if side == "sdscripts" else our_model)()
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    lat = res // 8
    x = torch.randn(1, 16, lat, lat, generator=g)
    context, pooled = torch.randn(1, CONTEXT, 4096, generator=g), torch.randn(1, POOLED, generator=g)
    target, t = torch.randn(1, 16, lat, lat, generator=g), torch.tensor([500.0])
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step():
        out = forward(x, t, context, pooled)
        torch.nn.functional.mse_loss(out, target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, cpu = timed_steps(step, steps, profile)
    return {"side": side, "res": res, "threads": torch.get_num_threads(), "adapter_params": sum(p.numel() for p in params),
            "build_s": build_s, "first_step_s": times[0], "step_s": statistics.median(times[1:]), "steps_s": times[1:],
            "cpu_step_s": statistics.median(cpu[1:])}  # fmt: skip


def both(a: argparse.Namespace) -> None:
    """The two sides one after the other (sd-scripts first), each its own process; prints the ratio."""
    sds = Path(a.sdscripts).expanduser()
    venv = Path(a.sdsvenv).expanduser() / "bin" / "python"
    common = ["--res", str(a.res), "--steps", str(a.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    results = {}
    for side, python, cwd in (("sdscripts", str(venv), sds), ("ours", sys.executable, ROOT)):
        extra = {"PYTHONPATH": str(ROOT) if side == "ours" else str(Path(a.kit) / "sds_shims")}
        out = subprocess.run([python, __file__, side, *common, "--json"], cwd=cwd, env=dict(env, **extra),
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode:
            raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(results[side]), flush=True)
    wall, cpu = (results["ours"][k] / results["sdscripts"][k] for k in ("step_s", "cpu_step_s"))
    print(
        f"ours / sd-scripts: s/step {wall:.3f}, CPU s/step {cpu:.3f} ({a.res} px, {a.threads} thread(s), "
        f"load {os.getloadavg()[0]:.1f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=["sdscripts", "ours", "both"])
    ap.add_argument("--res", type=int, default=256, help="image side in pixels (latents res/8, patches res/16)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--profile", default=None, help="write torch.profiler's operator table of one more step here")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--threads", type=int, default=1, help="both: OMP_NUM_THREADS of each side")
    ap.add_argument("--sdscripts", default="~/sdtrain-peer/sd-scripts")
    ap.add_argument("--sdsvenv", default="~/sdtrain-peer/sdsvenv")
    ap.add_argument("--kit", default="/work/shared/peer/helpers", help="the peer kit's helpers (torchvision stand-in)")
    a = ap.parse_args()
    if a.side == "both":
        return both(a)
    r = run_side(a.side, a.res, a.steps, a.profile)
    print(json.dumps(r) if a.json else r)


if __name__ == "__main__":
    main()
