"""Pre-compute a dataset's latent cache before training (sd-scripts' tools/cache_latents.py).

    python tools/cache_latents.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml [--cache_dir caches/] [--vae_batch_size 4] [--mixed_precision fp16]

Takes the training scripts' flags (a whole training command line or --config_file works; flags that only matter
for training are ignored), reads the datasets exactly as training does (same buckets, flips, crops) and encodes
every latent a run can ask for into the disk cache: --cache_dir when given, else next to the images (as
--cache_latents_to_disk). A training run with the same model, VAE precision and dataset settings and
--cache_latents_to_disk (or the same --cache_dir) then finds every entry. With --cache_text_encoder_outputs_to_disk
the text-encoder outputs are cached too. The family (SD1 / SD2 / SDXL) is read from the model (--sdxl is accepted).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.families import family_flags, family_group, flagged_family
from library.run import train_setup
from library.run.args import add_network_training_groups
from library.run.runtime import make_accelerator
from networks.config import add_network_args


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's groups (a training command line works) with caching on: latents always, on disk in
    --cache_dir or next to the images; --output_dir is not needed (caching writes nothing there)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_training_groups(parser, add_network_args)
    parser.set_defaults(cache_latents=True, cache_latents_to_disk=True, output_dir=".")
    extra = parser.add_argument_group("cache_latents")
    for flag in tool_family_flags():  # sd-scripts' --sdxl
        extra.add_argument(f"--{flag}", action="store_true", help="accepted: the family is read from the model")
    extra.add_argument("--skip_existing", action="store_true", help="accepted (sd-scripts: deprecated, no effect)")
    return parser


@functools.cache
def tool_family_flags() -> tuple[str, ...]:
    """sd-scripts' family flags (the registry's ``family_flags``) that the training groups do not define (they define
    ``--v2``): this tool accepts them, and the one given picks the families when the model cannot be read."""
    training = argparse.ArgumentParser()
    add_network_training_groups(training, add_network_args)
    defined = {option for action in training._actions for option in action.option_strings}
    return tuple(flag for flag in family_flags() if f"--{flag}" not in defined)


def family_names(args: argparse.Namespace) -> tuple[str, ...]:
    flagged = flagged_family(args, tool_family_flags())
    return family_group(args.pretrained_model_name_or_path, flagged=flagged)


def run(argv: Sequence[str] | None = None) -> train_setup.Run | None:
    """Fill the caches; returns the run (plan, caches) for inspection."""
    args = parse_args(build_parser(), argv)
    if args is None:  # --output_config wrote the file
        return None
    cfg = train_setup.read_config(args, family_names(args))  # every dataset / model problem at once
    train_setup.setup_logging(cfg)
    accelerator = make_accelerator(cfg.run)
    plan = train_setup.build_plan(cfg, accelerator)
    parts = train_setup.load_model(cfg, accelerator)
    run = train_setup.Run(cfg, accelerator, cfg.family, parts, plan, step_models=None)
    train_setup.fill_caches(run)
    where = cfg.data.cache_dir or "next to the images"
    entries = len(set(run.latent_cache.keys.values()))
    print(f"latent cache: {entries} entries for {sum(len(d.records) for d in plan.datasets)} images in {where}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
