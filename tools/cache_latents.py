"""Pre-compute a dataset's latent cache before training (sd-scripts' tools/cache_latents.py).

    python tools/cache_latents.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml [--cache_dir caches/] [--vae_batch_size 4] [--mixed_precision fp16]

Takes the training scripts' flags (a whole training command line or --config_file works; flags that only matter
for training are ignored), reads the datasets exactly as training does (same buckets, flips, crops) and encodes
every latent a run can ask for into the disk cache: --cache_dir when given, else next to the images (as
--cache_latents_to_disk). A training run with the same model, VAE precision and dataset settings and
--cache_latents_to_disk (or the same --cache_dir) then finds every entry. With --cache_text_encoder_outputs_to_disk
the text-encoder outputs are cached too. The family is read from the model (sd-scripts' --sdxl is accepted), and the
flags are those of its training script (library/families: ``family.options``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import add_no_effect, parse_args, peek
from library.families import FAMILIES, default_families, family_flags, family_group, flagged_family, get_family
from library.families.options import option_actions
from library.run import config as run_config
from library.run import setup as run_setup
from library.run.args import add_network_training_groups
from library.run.config import script_options
from networks.config import add_network_args


def add_caching_tool_groups(parser: argparse.ArgumentParser, family_names: Sequence[str],
                            add_network_args: Callable[[argparse.ArgumentParser], object],
                            add_tool_args: Callable[[argparse.ArgumentParser], object]) -> argparse.ArgumentParser:  # fmt: skip
    """tools/cache_latents.py and tools/cache_text_encoder_outputs.py: the flags of the adapter-training script of
    ``family_names`` (the model's family, default the first registered family's group; a whole training command
    line works), the tool's own (``add_tool_args``), then, accepted with no effect, sd-scripts' family flags of every
    registered family (``--sdxl`` ...: the family is read from the model) and the other families' training flags
    (caching does not read them). Returns the parser."""
    family_names = tuple(family_names or default_families())
    swaps = get_family(family_names[0]).spec.block_swap
    add_network_training_groups(parser, add_network_args, block_swap=swaps)
    own = script_options(family_names)
    own.add_args(parser, training=True)
    add_tool_args(parser)  # the tool's own flags (before the other families' flags take their names)
    g = parser.add_argument_group("caching", "flags a training command line may hold that caching does not read")
    for spec in (f.spec for f in FAMILIES.values()):
        for flag in (spec.flag, spec.tool_flag):
            if flag and f"--{flag}" not in parser._option_string_actions:
                add_no_effect(g, f"--{flag}", "the family is read from the model", action="store_true")
    others = {f.options for f in FAMILIES.values()} - {own}
    for options in others:
        for action in option_actions(options, training=True):
            flag = action.option_strings[0]
            if flag not in parser._option_string_actions:
                kind = {"action": "store_true"} if action.nargs == 0 else {"nargs": action.nargs, "default": None}
                add_no_effect(g, flag, "a training flag of other models; caching does not read it", **kind)
    return parser


def build_parser(family_names: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The training flags of ``family_names``' adapter script (a training command line works) with caching on:
    latents always, on disk in --cache_dir or next to the images; --output_dir is not needed (caching writes
    nothing there)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_caching_tool_groups(parser, family_names, add_network_args, add_tool_args)
    parser.set_defaults(cache_latents=True, cache_latents_to_disk=True, output_dir=".")
    return parser


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    extra = parser.add_argument_group("cache_latents")
    extra.add_argument("--skip_existing", action="store_true", help="accepted (sd-scripts: deprecated, no effect)")


@functools.cache
def _training_flags() -> frozenset[str]:
    """The flags of the training groups (``--v2`` is one: it says SD 2.x to the run, not which script trains)."""
    training = argparse.ArgumentParser()
    add_network_training_groups(training, add_network_args)
    return frozenset(option.lstrip("-") for action in training._actions for option in action.option_strings)


def family_names(argv: Sequence[str] | None) -> tuple[str, ...]:
    """The families trained together with the model the command line names (read from the file; an sd-scripts
    family flag such as ``--sdxl`` picks them when given)."""
    pre = argparse.ArgumentParser(add_help=False)
    for flag in family_flags():
        pre.add_argument(f"--{flag}", action="store_true")
    known, _ = pre.parse_known_args(list(argv) if argv is not None else None)
    flagged = flagged_family(known, [f for f in family_flags() if f not in _training_flags()])
    return family_group(peek(argv, "pretrained_model_name_or_path"), flagged=flagged)


def run(argv: Sequence[str] | None = None) -> run_setup.Run | None:
    """Fill the caches; returns the run (plan, caches) for inspection."""
    names = family_names(argv)
    args = parse_args(build_parser(names), argv)
    if args is None:  # --output_config wrote the file
        return None
    cfg = run_config.read_config(args, names)  # every dataset / model problem at once
    run = run_setup.prepare_caches(cfg)
    where = cfg.data.cache_dir or "next to the images"
    entries = len(set(run.latent_cache.keys.values()))
    print(f"latent cache: {entries} entries for {sum(len(d.records) for d in run.plan.datasets)} images in {where}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
