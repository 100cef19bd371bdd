"""Resize of a full-size SDXL rank-128 LoRA (random, built on the fly): sdtrain's resize_lora.py against the
straightforward per-module SVD of the (out, in) matrix ΔW = up @ down (what sd-scripts' resize_lora.py does with
--svd_lowrank_niter 0), on the same machine (run by hand; numbers go into the docs).

    python benchmarks/bench_tools.py [--rank 128] [--new_rank 32] [--threads N] [--full_baseline]

The LoRA has every module sd-scripts' networks.lora trains on SDXL base 1.0 (722 UNet + 264 text-encoder modules,
module shapes from the released architecture on the meta device), random factors, alpha = rank / 2, saved as fp16.
Timed: (1) ``resize_lora.run`` end to end (read, SVDs, write) and its SVD stage alone; (2) the baseline's SVDs:
``torch.linalg.svd(up @ down)`` per module. By default the baseline runs one module of each distinct shape and
multiplies by the number of modules of that shape (its time depends only on the shape); --full_baseline runs them
all. Both results are checked to have the same singular values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_lora(rank: int, path: Path) -> dict[str, tuple[int, int]]:
    """Write a random SDXL LoRA of ``rank`` to ``path``; returns {module: (out, in)}."""
    from safetensors.torch import save_file

    from library.families.sd import SDXL
    from networks.targets import builtin_preset, find_targets

    roots = SDXL.adapter_roots(SDXL.reference_parts())
    targets = find_targets(roots, builtin_preset("kohya", SDXL.target_classes), conv=False, train_norm=False)
    g = torch.Generator().manual_seed(0)
    state, shapes = {}, {}
    for t in targets:
        out_dim, in_dim = t.module.weight.shape[0], t.module.weight[0].numel()
        state[f"{t.name}.lora_down.weight"] = (torch.randn(rank, in_dim, generator=g) / in_dim**0.5).half()
        state[f"{t.name}.lora_up.weight"] = (torch.randn(out_dim, rank, generator=g) / rank**0.5).half()
        state[f"{t.name}.alpha"] = torch.tensor(rank / 2).half()
        shapes[t.name] = (out_dim, in_dim)
    save_file(state, str(path), metadata={"ss_network_dim": str(rank), "ss_network_alpha": str(rank / 2)})
    return shapes


def time_ours(path: Path, out: Path, new_rank: int) -> dict:
    from networks import deltas, lowrank, resize_lora

    start = time.perf_counter()
    resize_lora.run(["--model", str(path), "--save_to", str(out), "--new_rank", str(new_rank),
                      "--save_precision", "fp16"])  # fmt: skip
    total = time.perf_counter() - start
    file = deltas.load_adapter(path)
    ds, _ = deltas.file_deltas(file, None)
    start = time.perf_counter()
    svds = lowrank.svd_all(list(ds.values()))
    svd_time = time.perf_counter() - start
    return {"end_to_end_s": total, "svd_s": svd_time, "svds": dict(zip(ds, svds)), "deltas": ds}


def time_baseline(deltas: dict, full: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Seconds for ``torch.linalg.svd(up @ down)`` over all modules (measured per shape unless ``full``)."""
    by_shape = Counter((d.rows, d.cols) for d in deltas.values())
    measured: dict[tuple[int, int], float] = {}
    singular = {}
    total = 0.0
    for name, d in deltas.items():
        key = (d.rows, d.cols)
        if not full and key in measured:
            continue
        start = time.perf_counter()
        _, s, _ = torch.linalg.svd(d.up.float() @ d.down.float(), full_matrices=False)
        elapsed = time.perf_counter() - start
        measured[key] = elapsed
        singular[name] = s
        total += elapsed
    if not full:
        total = sum(measured[k] * n for k, n in by_shape.items())
    return total, singular


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--new_rank", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--full_baseline", action="store_true", help="run the baseline SVD on every module")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sdxl_r128.safetensors"
        start = time.perf_counter()
        shapes = build_lora(args.rank, path)
        built = time.perf_counter() - start
        ours = time_ours(path, Path(tmp) / "resized.safetensors", args.new_rank)
        base_time, singular = time_baseline(ours["deltas"], args.full_baseline)
        worst = max(float((ours["svds"][n].S[: args.rank] - s[: args.rank]).abs().max() / s[0])
                    for n, s in singular.items())  # fmt: skip
        size_mb = path.stat().st_size / 2**20
    result = {
        "modules": len(shapes),
        "distinct_shapes": len(set(shapes.values())),
        "lora_file_MiB": round(size_mb, 1),
        "torch_threads": torch.get_num_threads(),
        "build_s": round(built, 2),
        "sdtrain_resize_end_to_end_s": round(ours["end_to_end_s"], 2),
        "sdtrain_svd_s": round(ours["svd_s"], 2),
        "baseline_svd_s": round(base_time, 1),
        "baseline": "every module" if args.full_baseline else "one module per shape x count",
        "speedup_svd": round(base_time / ours["svd_s"], 1),
        "max_relative_singular_value_difference": worst,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
