"""Pre-compute a dataset's text-encoder output cache before training (sd-scripts' tools/cache_text_encoder_outputs.py).

    python tools/cache_text_encoder_outputs.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml [--cache_dir caches/] [--mixed_precision fp16] [--clip_skip 2]

Takes the training scripts' flags (a whole training command line or --config_file works; flags that only matter for
training are ignored), reads the datasets exactly as training does and encodes every caption a sample can take
(each line of a multi-line caption; "" when captions can be dropped) into the disk cache: --cache_dir when given,
else next to the images (as --cache_text_encoder_outputs_to_disk). A training run with the same model, text-encoder
precision, --clip_skip, --max_token_length, --weighted_captions and captions, and --cache_text_encoder_outputs_to_disk
(or the same --cache_dir) then finds every entry and runs no text encoder. Latents are not cached here (that is
tools/cache_latents.py). The family is read from the model (sd-scripts' --sdxl / --flux are accepted), and the flags
are those of its training script (library/families: ``family.options``, e.g. a T5 length and mask); sd-scripts' tool
caches SDXL and FLUX only, here every family training can cache for works.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.families.options import add_once
from library.run import config as run_config
from library.run import setup as run_setup
from networks.config import add_network_args
from tools.cache_latents import add_caching_tool_groups, family_names


def build_parser(family_names: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The training flags of ``family_names``' adapter script (a training command line works) with text-encoder
    caching on, on disk in --cache_dir or next to the images; --output_dir is not needed (caching writes nothing
    there) and the adapter is taken as UNet-only (cached outputs cannot train text-encoder adapters; nothing is
    trained here)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_caching_tool_groups(parser, family_names, add_network_args, add_tool_args)
    parser.set_defaults(cache_text_encoder_outputs=True, cache_text_encoder_outputs_to_disk=True, output_dir=".",
                        network_train_unet_only=True)  # fmt: skip
    return parser


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    extra = parser.add_argument_group("cache_text_encoder_outputs")
    extra.add_argument("--skip_existing", action="store_true", help="accepted (sd-scripts: deprecated, no effect); "
                       "existing entries are always checked and kept")  # fmt: skip
    add_once(extra, parser, "--text_encoder_batch_size", type=int, default=None,
             help="captions per text-encoder call (default: the first dataset's batch size)")  # fmt: skip


def run(argv: Sequence[str] | None = None) -> run_setup.Run | None:
    """Fill the text-encoder cache; returns the run (plan, ``text_cache``) for inspection."""
    names = family_names(argv)
    args = parse_args(build_parser(names), argv)
    if args is None:  # --output_config wrote the file
        return None
    if args.text_encoder_batch_size is not None and args.text_encoder_batch_size < 1:
        raise ConfigError([f"--text_encoder_batch_size {args.text_encoder_batch_size}: must be at least 1"])
    args.cache_text_encoder_outputs = args.cache_text_encoder_outputs_to_disk = True
    args.cache_latents = args.cache_latents_to_disk = False  # this tool caches text only (sd-scripts: the same)
    cfg = run_config.read_config(args, names)  # every dataset / model problem at once
    if args.text_encoder_batch_size is not None:  # the tool's flag for every family (a training flag for some)
        cfg = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options,
                                                                   text_encoder_batch_size=args.text_encoder_batch_size))  # fmt: skip
    run = run_setup.prepare_caches(cfg)
    where = cfg.data.cache_dir or "next to the images"
    images = sum(len(d.records) for d in run.plan.datasets)
    print(f"text-encoder cache: {len(run.text_cache.keys)} captions of {images} images in {where}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
