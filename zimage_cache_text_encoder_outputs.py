"""musubi-tuner's zimage_cache_text_encoder_outputs.py: encode every caption of a dataset config with Qwen3-4B
before training, with musubi-tuner's command line.

    python zimage_cache_text_encoder_outputs.py --dataset_config dataset.toml \
        --text_encoder qwen_3_4b.safetensors --batch_size 16

Every caption a sample can take is encoded (Qwen3's chat template, hidden-states layer -2: the training scripts'
encoding) and written into the dataset config's ``cache_directory`` (else next to the images) under the content key
a training run computes, so zimage_train_network.py / zimage_train.py with the same dataset config (and
``--mixed_precision bf16``: Qwen3 runs in bfloat16 here; ``--fp8_llm`` on both or neither) find every entry and run no
text encoder. The entries are ours, not musubi-tuner's ``*_zi_te.safetensors`` files, which are neither written nor
read. The flags: library/families/zimage/cache_flags.py and library/run/cache_flags.py.
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
from library.families.base import Parts
from library.families.encoders import qwen3
from library.families.zimage import ZIMAGE, cache_flags
from library.families.zimage.loading import load_text_encoder
from library.families.zimage.options import ZImageOptions
from library.run import cache_flags as common_flags
from library.run import cache_steps


def build_parser():
    return cache_flags.text_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the text-encoder cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    problems: list[str] = []
    flags = common_flags.read_common(args, "--text_encoder", problems)
    if problems:
        raise ConfigError(problems)
    path = Path(args.text_encoder)
    if not path.exists():
        raise FileNotFoundError(f"--text_encoder {path}: no such file or folder (Qwen3-4B)")
    plan = cache_steps.dataset_plan(args.dataset_config, ZIMAGE,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config))  # fmt: skip
    encoder = load_text_encoder(path, torch.bfloat16, "cpu", args.fp8_llm)
    tokenizer = qwen3.load_tokenizer(path if path.is_dir() else None)
    options = ZImageOptions(text_encoder=str(path), fp8_llm=args.fp8_llm)
    parts = Parts(None, None, [encoder], [tokenizer], {}, ZIMAGE.name, options=options)
    cache = cache_steps.write_text(plan, ZIMAGE, parts, flags.device, flags.batch_size)
    print(f"text-encoder cache: {len(cache.keys)} captions in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
