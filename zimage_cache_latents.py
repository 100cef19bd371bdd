"""musubi-tuner's zimage_cache_latents.py: encode every image of a dataset config with the FLUX.1 AE Z-Image uses,
before training, with musubi-tuner's command line.

    python zimage_cache_latents.py --dataset_config dataset.toml --vae ae.safetensors

The datasets are read as the training scripts read them (same buckets and crops) and each latent is written into
the dataset config's ``cache_directory`` (musubi-tuner's key; else next to the images) under the content key a
training run computes, so zimage_train_network.py / zimage_train.py with the same dataset config (and
``--mixed_precision bf16``: the AE runs in bfloat16 here unless ``--vae_dtype`` says otherwise; give training the same
``--vae_dtype``) find every latent and run no AE encode. The entries are ours
(``<cache_directory>/<key[:2]>/<key>.safetensors``; never stale: a changed image, AE or bucket gives a new key), not
musubi-tuner's ``*_zi.safetensors`` files, which are neither written nor read. The flags:
library/families/zimage/cache_flags.py and library/run/cache_flags.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.data import musubi_dataset
from library.families.base import Parts
from library.families.zimage import ZIMAGE, cache_flags
from library.families.zimage.loading import load_vae
from library.run import cache_flags as common_flags
from library.run import cache_steps


def build_parser():
    return cache_flags.latents_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the latent cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    problems: list[str] = []
    flags = common_flags.read_common(args, "--vae", problems)
    dtype = common_flags.vae_dtype(args.vae_dtype, problems)
    if problems:
        raise ConfigError(problems)
    if not Path(args.vae).exists():
        raise FileNotFoundError(f"--vae {args.vae}: no such file or folder (the FLUX.1 AE, ae.safetensors)")
    plan = cache_steps.dataset_plan(args.dataset_config, ZIMAGE, vae_batch_size=flags.batch_size or 1,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config))  # fmt: skip
    vae = load_vae(Path(args.vae), dtype, "cpu")
    parts = Parts(None, vae, [], [], {}, ZIMAGE.name)
    cache = cache_steps.write_latents(plan, ZIMAGE, parts, flags.device)
    print(f"latent cache: {len(set(cache.keys.values()))} entries in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
