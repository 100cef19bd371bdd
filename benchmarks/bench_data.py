"""Images per second through the data loader, with and without cached latents (tiny VAE), on CPU.

Run by hand from the repository root:  python benchmarks/bench_data.py [--images 64] [--size 256] [--workers 0]
It writes random PNGs to a temporary folder, builds the plan (64-px-step buckets at --resolution), and times
two epochs of the loader (1) decoding + resizing pixels, (2) reading cached latents, plus the caching step itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.data import DataArgs, build_datasets, cache_latents, make_loader  # noqa: E402
from library.data.data_args import add_dataset_args  # noqa: E402
from library.families.sd.tiny import build_tiny  # noqa: E402


def _make_images(folder: str, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    shapes = [(size, size), (size * 3 // 2, size), (size, size * 3 // 2)]
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i:04d}.png"))
        with open(os.path.join(folder, f"{i:04d}.txt"), "w") as f:
            f.write(f"tag{i}, a, b, c")


def _throughput(loader, epochs: int) -> float:
    start, n = time.perf_counter(), 0
    for e in range(epochs):
        for batch in loader.epoch(e):
            n += len(batch)
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--size", type=int, default=256, help="short side of the generated images")
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    opts = p.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    root = tempfile.mkdtemp(prefix="bench_data_")
    folder = os.path.join(root, "train", "1_bench")
    os.makedirs(folder)
    _make_images(folder, opts.images, opts.size)
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    argv = ["--train_data_dir", os.path.join(root, "train"), "--resolution", str(opts.resolution), "--enable_bucket",
            "--min_bucket_reso", "64", "--max_bucket_reso", str(opts.resolution * 2), "--caption_extension", ".txt",
            "--train_batch_size", str(opts.batch), "--shuffle_caption", "--flip_aug"]  # fmt: skip
    plan = build_datasets(DataArgs.from_args(parser.parse_args(argv)), seed=0)
    pixels = _throughput(make_loader(plan, num_workers=opts.workers), 2)

    vae = build_tiny("sd1").vae.eval()

    def encode(x: torch.Tensor) -> torch.Tensor:
        return vae.encode(x).latent_dist.sample() * vae.config.scaling_factor

    cached_args = parser.parse_args([*argv, "--cache_latents", "--vae_batch_size", "8"])
    cached_plan = build_datasets(DataArgs.from_args(cached_args), seed=0)
    start = time.perf_counter()
    cache = cache_latents(cached_plan, encode, "tiny-vae", show_progress=False)
    caching = opts.images * 2 / (time.perf_counter() - start)  # x2: flipped copies
    latents = _throughput(make_loader(cached_plan, num_workers=opts.workers, latent_cache=cache), 2)
    print(
        f"{opts.images} images {opts.size}px -> {opts.resolution}px buckets, batch {opts.batch}, workers {opts.workers}"
    )
    print(f"loader, decoding pixels : {pixels:8.1f} images/s")
    print(f"latent caching (tiny VAE): {caching:8.1f} images/s")
    print(f"loader, cached latents  : {latents:8.1f} images/s")


if __name__ == "__main__":
    main()
