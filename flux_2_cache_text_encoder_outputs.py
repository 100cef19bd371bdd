"""musubi-tuner's flux_2_cache_text_encoder_outputs.py: encode every caption of a dataset config with FLUX.2's text
encoder (Mistral 3 for dev, Qwen3 for klein) before training, with musubi-tuner's command line.

    python flux_2_cache_text_encoder_outputs.py --dataset_config dataset.toml \
        --text_encoder qwen_3_4b.safetensors --batch_size 16 --model_version klein-4b

Every caption a sample can take is encoded (the model version's chat template and hidden-state layers: the training
script's encoding) and written into the dataset config's ``cache_directory`` (else next to the images) under the
content key a training run computes, so flux_2_train_network.py with the same dataset config (and
``--mixed_precision bf16``: the text encoder runs in bfloat16 here; ``--fp8_text_encoder`` here with ``--fp8_base
--fp8_text_encoder`` there) finds every entry and runs no text encoder. The entries are ours, not musubi-tuner's
``*_flux2_te.safetensors`` files, which are neither written nor read. The flags: library/families/flux2/cache_flags.py
and library/run/cache_flags.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.data import musubi_dataset
from library.device.fp8 import store_in_fp8
from library.families.base import Parts
from library.families.flux2 import FLUX2, cache_flags
from library.families.flux2.loading import load_text_encoder, load_tokenizer
from library.families.flux2.options import Flux2Options
from library.run import cache_flags as common_flags
from library.run import cache_steps


def build_parser():
    return cache_flags.text_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the text-encoder cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    problems: list[str] = []
    flags = common_flags.read_common(args, "--text_encoder", problems)
    version = cache_flags.read_version(args, problems)
    if problems:
        raise ConfigError(problems)
    path = Path(args.text_encoder)
    if not path.exists():
        raise FileNotFoundError(f"--text_encoder {path}: no such file or folder (Mistral 3 for dev, Qwen3 for klein)")
    plan = cache_steps.dataset_plan(args.dataset_config, FLUX2, control_images=True,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config))  # fmt: skip
    try:
        encoder = load_text_encoder(path, version, torch.bfloat16, "cpu")
        tokenizer = load_tokenizer(path, version)
    except ValueError as e:
        raise ValueError(f"{e} (--model_version {version}: give the version whose text encoder this is, e.g. "
                         "--model_version klein-4b for Qwen3-4B; musubi-tuner's default is dev)") from e  # fmt: skip
    if args.fp8_text_encoder:
        store_in_fp8(encoder, torch.bfloat16)  # as training's --fp8_base --fp8_text_encoder
    options = Flux2Options(text_encoder=str(path), model_version=version)
    parts = Parts(None, None, [encoder], [tokenizer], {"model_version": version}, FLUX2.name, options=options)
    cache = cache_steps.write_text(plan, FLUX2, parts, flags.device, flags.batch_size)
    print(f"text-encoder cache: {len(cache.keys)} captions in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
