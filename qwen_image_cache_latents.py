"""musubi-tuner's qwen_image_cache_latents.py: encode every image of a dataset config with the Qwen-Image VAE
before training, with musubi-tuner's command line.

    python qwen_image_cache_latents.py --dataset_config dataset.toml --vae qwen_image_vae.safetensors

The datasets are read as the training scripts read them (same buckets and crops) and each latent is written into
the dataset config's ``cache_directory`` (musubi-tuner's key; else next to the images) under the content key a
training run computes, so qwen_image_train_network.py / qwen_image_train.py with the same dataset config (and
``--mixed_precision bf16``: the VAE runs in bfloat16 here) find every latent and run no VAE encode. The entries are
ours (``<cache_directory>/<key[:2]>/<key>.safetensors``; never stale: a changed image, VAE or bucket gives a new key),
not musubi-tuner's ``*_qi.safetensors`` files, which are neither written nor read. The flags:
library/families/qwen_image/cache_flags.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.data import musubi_dataset
from library.families.base import Parts
from library.families.qwen_image import QWEN_IMAGE, cache_flags
from library.families.qwen_image.loading import load_vae
from library.families.qwen_image.options import EDIT_VERSIONS
from library.run import cache_steps


def build_parser():
    return cache_flags.latents_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the latent cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    flags = cache_flags.read_common(args, "--vae")
    if not Path(args.vae).exists():
        raise FileNotFoundError(f"--vae {args.vae}: no such file or folder (the Qwen-Image VAE)")
    edit = flags.model_version in EDIT_VERSIONS  # the control images' latents too
    plan = cache_steps.dataset_plan(args.dataset_config, QWEN_IMAGE, vae_batch_size=flags.batch_size or 1,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config),
                                    control_images=edit)  # fmt: skip
    vae = load_vae(Path(args.vae), torch.bfloat16, "cpu")
    parts = Parts(None, vae, [], [], {}, QWEN_IMAGE.name)
    cache = cache_steps.write_latents(plan, QWEN_IMAGE, parts, flags.device)
    print(f"latent cache: {len(set(cache.keys.values()))} entries in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
