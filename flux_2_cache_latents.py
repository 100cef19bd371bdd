"""musubi-tuner's flux_2_cache_latents.py: encode every image of a dataset config with FLUX.2's AE before training,
with musubi-tuner's command line.

    python flux_2_cache_latents.py --dataset_config dataset.toml --vae ae.safetensors --model_version klein-4b

The datasets are read as the training script reads them (same buckets and crops) and each latent is written into the
dataset config's ``cache_directory`` (musubi-tuner's key; else next to the images) under the content key a training
run computes, so flux_2_train_network.py with the same dataset config (and ``--mixed_precision bf16``: the AE runs in
bfloat16 here unless ``--vae_dtype`` says otherwise; give training the same ``--vae_dtype``) finds every latent and
runs no AE encode. The AE is the same for every model version. The entries are ours
(``<cache_directory>/<key[:2]>/<key>.safetensors``; never stale: a changed image, AE or bucket gives a new key), not
musubi-tuner's ``*_flux2*.safetensors`` files, which are neither written nor read. Reference images
(``control_directory``) are not cached here. The flags: library/families/flux2/cache_flags.py and
library/run/cache_flags.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.data import musubi_dataset
from library.families.autoencoders import flux2 as ae
from library.families.base import Parts
from library.families.flux2 import FLUX2, cache_flags
from library.run import cache_flags as common_flags
from library.run import cache_steps


def build_parser():
    return cache_flags.latents_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the latent cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    problems: list[str] = []
    flags = common_flags.read_common(args, "--vae", problems)
    cache_flags.read_version(args, problems)
    dtype = common_flags.vae_dtype(args.vae_dtype, problems)
    if problems:
        raise ConfigError(problems)
    if not Path(args.vae).exists():
        raise FileNotFoundError(f"--vae {args.vae}: no such file or folder (FLUX.2's AE, ae.safetensors)")
    plan = cache_steps.dataset_plan(args.dataset_config, FLUX2, control_images=True,
                                    vae_batch_size=flags.batch_size or 1,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config))  # fmt: skip
    parts = Parts(None, ae.load(Path(args.vae), dtype, "cpu"), [], [], {}, FLUX2.name)
    cache = cache_steps.write_latents(plan, FLUX2, parts, flags.device)
    print(f"latent cache: {len(set(cache.keys.values()))} entries in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
