"""Train a ControlNet-LLLite for SDXL (sd-scripts' ``sdxl_train_control_net_lllite.py``, same flags).

    accelerate launch sdxl_train_control_net_lllite.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --dataset_config dataset.toml --output_dir out --cond_emb_dim 32 --network_dim 64 --learning_rate 2e-4

Each subset of the dataset names its ``conditioning_data_dir`` (one image per training image, same base name and
size; or ``--train_data_dir`` with ``--conditioning_data_dir``). The output file has sd-scripts' LLLite keys and
loads in sd-scripts' gen_img.py, ComfyUI's LLLite node and ``gen_img.py --control_net_lllite_models``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from library import sampling
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import add_config_args, parse_args
from library.measure import plan as memory_plan  # noqa: F401 - registers the --plan_memory planner
from library.optim import add_optim_args
from library.run import args as arg_groups
from library.run import config as run_config
from library.run import run_files
from library.run import setup as run_setup
from library.run.loop import train
from library.run.trainer import Result
from networks.lllite import LLLiteNetwork, unet_root
from networks.lllite_config import LLLiteConfig, add_lllite_args

FAMILIES = ("sdxl",)


def build_parser() -> argparse.ArgumentParser:
    """sd-scripts' flags of this script: the run groups (with ``--conditioning_data_dir``), optimizer, LLLite,
    sampling, ``--config_file``, then the family's own flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg_groups.add_run_groups(parser, conditioning=True)
    for add in (add_optim_args, add_lllite_args, sampling.add_sample_args, add_config_args):
        add(parser)
    return run_config.script_options(FAMILIES).add_args(parser, training=True)


def run(argv: Sequence[str] | None = None) -> Result | None:
    """Train a ControlNet-LLLite on the conditioning images of the dataset."""
    args = parse_args(build_parser(), argv)
    if args is None:  # --output_config wrote the file
        return None
    cfg = run_config.read_config(args, FAMILIES, LLLiteConfig.from_args)  # all errors at once
    if run_files.nothing_left(cfg.save, cfg.run):
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)
    method = cfg.method
    network = LLLiteNetwork(unet_root(run.family.adapter_roots(run.parts)), method.cond_emb_dim,
                            method.network_dim, method.network_dropout)  # fmt: skip
    if method.network_weights:
        network.load_file(method.network_weights)
    network.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    return train(run, network, network.param_groups(cfg.optim.unet_lr or cfg.optim.learning_rate))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
