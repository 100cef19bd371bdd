"""Bucket a metadata JSON's images and cache their latents (sd-scripts' finetune/prepare_buckets_latents.py).

    python finetune/prepare_buckets_latents.py train_data_dir meta_clean.json meta_lat.json model.safetensors \
        [--max_resolution 512,512] [--min_bucket_reso 256] [--max_bucket_reso 1024] [--batch_size 4] \
        [--mixed_precision bf16] [--flip_aug] [--bucket_no_upscale]

Reads the dataset exactly as ``fine_tune.py --in_json meta_clean.json --train_data_dir train_data_dir`` does with
the same bucket flags, writes every latent into the disk cache next to the images (tools/cache_latents.py: a run
with ``--cache_latents_to_disk`` and the same settings finds them), and writes out_json = in_json plus each image's
bucket as ``train_resolution`` [width, height] (informational: training buckets the images itself, as sd-scripts'
training does too nowadays).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.data.metadata_json import read_metadata_json, write_metadata_json
from tools import cache_latents


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("in_json", type=str, help="metadata file to read")
    parser.add_argument("out_json", type=str, help="metadata file to write (with train_resolution)")
    parser.add_argument("model_name_or_path", type=str, help="model whose VAE encodes the latents (local)")
    parser.add_argument("--v2", action="store_true", help="accepted (the family is read from the model)")
    parser.add_argument("--batch_size", type=int, default=1, help="VAE batch size")
    parser.add_argument("--max_data_loader_n_workers", type=int, default=None, help="image-reading workers")
    parser.add_argument("--max_resolution", type=str, default="512,512", help="training resolution: 'W,H'")
    parser.add_argument("--min_bucket_reso", type=int, default=256)
    parser.add_argument("--max_bucket_reso", type=int, default=1024)
    parser.add_argument("--bucket_reso_steps", type=int, default=64)
    parser.add_argument("--bucket_no_upscale", action="store_true")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--full_path", action="store_true", help="the metadata keys are full image paths")
    parser.add_argument("--flip_aug", action="store_true", help="also cache the flipped images' latents")
    parser.add_argument("--alpha_mask", type=str, default="", help="(any non-empty value) use alpha channels as masks")
    parser.add_argument("--skip_existing", action="store_true", help="accepted: valid cache entries are always kept")
    parser.add_argument("--recursive", action="store_true", help="with --full_path: images in sub-folders")
    return parser


def cache_argv(args: argparse.Namespace) -> list[str]:
    """The equivalent tools/cache_latents.py command line."""
    argv = ["--pretrained_model_name_or_path", args.model_name_or_path, "--in_json", args.in_json,
            "--train_data_dir", args.train_data_dir, "--resolution", args.max_resolution, "--enable_bucket",
            "--min_bucket_reso", str(args.min_bucket_reso), "--max_bucket_reso", str(args.max_bucket_reso),
            "--bucket_reso_steps", str(args.bucket_reso_steps), "--vae_batch_size", str(args.batch_size),
            "--mixed_precision", args.mixed_precision, "--cache_latents_to_disk"]  # fmt: skip
    if args.max_data_loader_n_workers is not None:
        argv += ["--max_data_loader_n_workers", str(args.max_data_loader_n_workers)]
    for flag in ("bucket_no_upscale", "flip_aug"):
        argv += [f"--{flag}"] if getattr(args, flag) else []
    return argv + (["--alpha_mask"] if args.alpha_mask else [])


def run(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.recursive and not args.full_path:
        raise ValueError("--recursive without --full_path is not supported yet: key the images by full path "
                         "(merge_captions_to_metadata.py --full_path --recursive)")  # fmt: skip
    metadata = read_metadata_json(args.in_json)
    cached = cache_latents.run(cache_argv(args))
    plan = cached.plan.datasets[0]
    buckets = {}
    for record, assignment in zip(plan.records, plan.assignments[0]):
        path = Path(record.path)
        for key in (str(path), str(path.with_suffix("")), path.stem, path.name):
            buckets[key] = [int(v) for v in assignment.bucket]
    for key, entry in metadata.items():
        if key in buckets:
            entry["train_resolution"] = buckets[key]
    write_metadata_json(metadata, args.out_json)
    print(f"{len(metadata)} entries with train_resolution written to {args.out_json}")
    return metadata


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
