"""Helpers for the data-pipeline tests: tiny real PNGs on disk, parsed flags, folder fingerprints."""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
from PIL import Image

from library.data import DataArgs
from library.data.data_args import add_dataset_args


def make_png(path, width: int, height: int, seed: int = 0, alpha: bool = False) -> str:
    """Write a random RGB(A) PNG of ``width`` x ``height``; returns its path."""
    rng = np.random.default_rng(seed)
    channels = 4 if alpha else 3
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    Image.fromarray(arr, "RGBA" if alpha else "RGB").save(path)
    return str(path)


def parse(argv: list[str]) -> DataArgs:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    return DataArgs.from_args(parser.parse_args(argv))


def tree_digest(folder) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder`` (to prove nothing was modified or added)."""
    out = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def small_args(train_dir, *extra: str) -> list[str]:
    """Flags for tiny 64-px runs with buckets 32..128 step 32."""
    return [
        "--train_data_dir", str(train_dir), "--resolution", "64", "--enable_bucket", "--min_bucket_reso", "32",
        "--max_bucket_reso", "128", "--bucket_reso_steps", "32", "--caption_extension", ".txt", *extra,
    ]  # fmt: skip
