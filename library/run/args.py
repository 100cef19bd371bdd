"""Which flag groups each script takes. This module assembles groups; it defines no flag.

The rule (docs/configuration.md): a flag lives next to what reads it. Each domain module defines its argparse
group, ``add_<group>_args(parser)``, beside the frozen dataclass whose ``from_args(args)`` is the only reader of
those flags (sd-scripts' names, types and defaults), e.g. ``library.objectives.noising.add_noise_args`` + ``NoiseConfig``,
``networks.config.add_network_args`` + ``NetworkConfig``. Library functions take the dataclasses, never an
``argparse.Namespace``. The readers report through ``library.cli.problems`` (``ConfigError``), and
``library.run.config.read_config`` runs them all so a run lists every problem at once. Flags sd-scripts has but we do
not support yet are added with :func:`library.cli.parse.add_unsupported`: using one is an error, never a no-op.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from library import sampling
from library.cli.console import add_logging_args
from library.cli.parse import add_config_args
from library.cli.plan_flags import add_plan_args
from library.data.data_args import add_dataset_args
from library.objectives.losses import add_loss_args
from library.objectives.noising import add_noise_args
from library.optim import add_optim_args, add_part_lr_args
from library.run.config import add_model_args, add_validation_args
from library.run.ema import add_ema_args
from library.run.memory_watch import add_memory_watch_args
from library.run.model_trainable import add_model_training_args
from library.run.run_files import add_save_args, add_state_args
from library.run.runtime import add_run_args
from library.run.token_embeddings import add_embedding_args, add_textual_inversion_args
from library.run.trackers import add_tracker_args


def add_run_groups(
    parser: argparse.ArgumentParser,
    default_format: str | None = "safetensors",
    deepspeed: bool = False,
    block_swap: bool = False,
    conditioning: bool = False,
) -> None:
    """The groups every training recipe takes, in order: logging, model, dataset, run, memory watch, save
    (``default_format``: ``--save_model_as``'s default), state, trackers, validation, EMA, noise, loss; and
    ``--plan_memory`` (library/cli/plan_flags.py). ``deepspeed``: the DeepSpeed
    flags are read (full-model recipes) instead of refused. ``block_swap``: ``--blocks_to_swap`` and
    ``--cpu_offload_checkpointing`` are read (FLUX / SD3 scripts, library/run/block_swap.py) instead of refused."""
    add_logging_args(parser)
    add_plan_args(parser)
    add_model_args(parser)
    add_dataset_args(parser, conditioning=conditioning)  # conditioning images: ControlNet trainers
    add_run_args(parser, deepspeed, block_swap)
    add_memory_watch_args(parser)
    add_save_args(parser, default_format)
    for add in (add_state_args, add_tracker_args, add_validation_args, add_ema_args, add_noise_args, add_loss_args):
        add(parser)


def add_network_training_groups(
    parser: argparse.ArgumentParser,
    add_network_args: Callable[[argparse.ArgumentParser], object],
    block_swap: bool = False,
) -> None:
    """train_network.py / sdxl_train_network.py (and tools/cache_latents.py, which takes their command lines):
    the run groups, optimizer, per-part learning rates, network (``add_network_args``: the adapter flags, which
    ``networks.config`` defines; library/ does not import networks/), new token embeddings, sampling, --config_file.
    ``block_swap``: the block-swap flags are read (flux_train_network.py), not refused."""
    add_run_groups(parser, block_swap=block_swap)
    for add in (add_optim_args, add_part_lr_args, add_network_args, add_embedding_args, sampling.add_sample_args):
        add(parser)
    add_config_args(parser)


def add_textual_inversion_groups(parser: argparse.ArgumentParser) -> None:
    """train_textual_inversion.py / sdxl_train_textual_inversion.py (sd-scripts' TI saves .pt unless told)."""
    add_run_groups(parser, default_format="pt")
    for add in (add_optim_args, add_textual_inversion_args, sampling.add_sample_args, add_config_args):
        add(parser)


def add_model_training_groups(
    parser: argparse.ArgumentParser, flag_sets: Sequence[str], family_names: Sequence[str], block_swap: bool = False
) -> None:
    """fine_tune.py, sdxl_train.py, train_db.py and the transformer families' full fine-tunes: the run groups
    (--save_model_as defaults to the input's format), the optimizer, the full-training flags of the script's
    ``flag_sets`` (``library.run.model_trainable.add_model_training_args``), sampling, --config_file, then the
    families' own flags (``family.options``) and full-training flags (``family.full_training``). ``block_swap``: the
    block-swap flags are read (transformer scripts), not refused."""
    from library.families import get_family
    from library.run.config import script_options

    add_run_groups(parser, default_format=None, deepspeed=True, block_swap=block_swap)
    add_optim_args(parser)
    add_model_training_args(parser, flag_sets)
    sampling.add_sample_args(parser)
    add_config_args(parser)
    script_options(tuple(family_names)).add_args(parser, training=True)
    get_family(family_names[0]).full_training.add_args(parser)
