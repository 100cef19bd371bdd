"""Train a ControlNet for SD 1.x / 2.x (sd-scripts' ``train_control_net.py``, same flags).

    accelerate launch train_control_net.py --pretrained_model_name_or_path v1-5-pruned.safetensors \
        --train_data_dir images --conditioning_data_dir conditioning --resolution 512 --output_dir out \
        --learning_rate 1e-5 --max_train_steps 10000 --mixed_precision bf16

A new ControlNet copies the UNet's encoder half (diffusers ``ControlNetModel.from_unet``), or continues from
``--controlnet_model_name_or_path`` (a file or a diffusers folder); the UNet and text encoder stay frozen, and the
loss is the model's (epsilon or v-prediction). Each training image needs a conditioning image of the same base name
(``conditioning_data_dir``). The file has the original ControlNet key names sd-scripts writes (``input_hint_block``,
``zero_convs``, ``middle_block_out`` ...): diffusers' ``ControlNetModel.from_single_file``, ComfyUI, A1111 and
``gen_img.py --control_net_models`` read it. The ControlNet sees its image in [0, 1] as every one of those readers
gives it (sd-scripts' SD trainer gives [-1, 1], which its own gen_img.py does not).
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
from networks.controlnet_config import ControlNetConfig, add_controlnet_args

FAMILIES = ("sd1", "sd2")


def build_parser(families: tuple[str, ...] = FAMILIES, zero_conv_lr: bool = False,
                 doc: str | None = __doc__) -> argparse.ArgumentParser:  # fmt: skip
    """sd-scripts' flags of the ControlNet scripts: the run groups (with ``--conditioning_data_dir``), optimizer,
    ControlNet, sampling, ``--config_file``, then the families' own flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg_groups.add_run_groups(parser, conditioning=True)
    add_optim_args(parser)
    add_controlnet_args(parser, zero_conv_lr)
    for add in (sampling.add_sample_args, add_config_args):
        add(parser)
    return run_config.script_options(families).add_args(parser, training=True)


def run(argv: Sequence[str] | None = None, families: tuple[str, ...] = FAMILIES, file_keys: str = "ldm",
        parser: argparse.ArgumentParser | None = None) -> Result | None:  # fmt: skip
    """Train a ControlNet on the conditioning images of the dataset; ``file_keys``: the saved names ("ldm":
    sd-scripts' SD trainer, "diffusers": its SDXL trainer)."""
    from networks.controlnet import ControlNet, controlnet_from_unet, load_controlnet

    args = parse_args(parser or build_parser(families), argv)
    if args is None:  # --output_config wrote the file
        return None
    cfg = run_config.read_config(args, families, ControlNetConfig.from_args)  # all errors at once
    if run_files.nothing_left(cfg.save, cfg.run):
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)
    unet, method = run.parts.denoiser, cfg.method
    if method.controlnet_model_name_or_path:
        model = load_controlnet(method.controlnet_model_name_or_path, unet)
    else:
        model = controlnet_from_unet(unet)
    if cfg.run.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    controlnet = ControlNet(unet, model.to(device=run.accelerator.device, dtype=cfg.run.train_dtype), file_keys)
    controlnet.controlnet.requires_grad_(True)
    return train(run, controlnet, controlnet.param_groups(cfg.optim.learning_rate, method.control_net_lr))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
