"""Train a FLUX.1 ControlNet (XLabs-style, sd-scripts' ``flux_train_control_net.py``, same flags).

    accelerate launch --mixed_precision bf16 flux_train_control_net.py \
        --pretrained_model_name_or_path flux1-dev.safetensors --clip_l clip_l.safetensors \
        --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --dataset_config dataset.toml \
        --output_dir out --output_name flux_cn --learning_rate 2e-5 --optimizer_type adamw8bit \
        --gradient_checkpointing --blocks_to_swap 10 --cache_latents --cache_text_encoder_outputs

Each subset of the dataset names its ``conditioning_data_dir`` (one image per training image, same base name; or
``--train_data_dir`` with ``--conditioning_data_dir``); the conditioning image goes through the same resize / crop /
flip as its target and reaches the ControlNet as pixels in [-1, 1], as sd-scripts gives it. The FLUX transformer is
frozen; the ControlNet (2 double blocks, the pixel hint block, zero-initialised outputs: library/families/flux/
controlnet.py) adds its residuals to the transformer's double blocks, and the loss is the FLUX flow objective
(``--timestep_sampling --model_prediction_type --guidance_scale`` ... as flux_train.py). The output file has
sd-scripts' ControlNetFlux keys; ``flux_minimal_inference.py --control_net_models <file> --guide_image_path <img>``
generates with it, and sample prompts use it with ``--cn <image>``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from library import sampling
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import add_config_args, parse_args
from library.families.flux.controlnet_config import ControlNetConfig, add_controlnet_args, prepare_args
from library.families.flux.controlnet_trainable import FluxControlNet
from library.files.weights import streamed_saves
from library.measure import plan as memory_plan  # noqa: F401 - registers the --plan_memory planner
from library.optim import add_optim_args
from library.run import args as arg_groups
from library.run import config as run_config
from library.run import run_files
from library.run import setup as run_setup
from library.run.loop import train
from library.run.trainer import Result

FAMILIES = ("flux-dev", "flux-schnell")  # ControlNetFlux reads CLIP-L's pooled vector: not Chroma


def build_parser() -> argparse.ArgumentParser:
    """sd-scripts' flags of this script: the run groups (with ``--conditioning_data_dir``, block swapping),
    optimizer, the ControlNet's own, sampling, ``--config_file``, then the FLUX family's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg_groups.add_run_groups(parser, default_format=None, block_swap=True, conditioning=True)
    for add in (add_optim_args, add_controlnet_args, sampling.add_sample_args, add_config_args):
        add(parser)
    return run_config.script_options(FAMILIES).add_args(parser, training=True)


def read_config(args: argparse.Namespace) -> run_config.TrainConfig:
    """The typed configuration of the run, every problem at once (the deprecated block-swap flags read first)."""
    prepare_args(args)
    return run_config.read_config(args, FAMILIES, ControlNetConfig.from_args, ("safetensors",))


def run(argv: Sequence[str] | None = None) -> Result | None:
    """Train a FLUX.1 ControlNet on the conditioning images of the dataset."""
    args = parse_args(build_parser(), argv)
    if args is None:  # --output_config wrote the file
        return None
    cfg = read_config(args)
    if run_files.nothing_left(cfg.save, cfg.run):
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)
    method, transformer = cfg.method, run.parts.denoiser
    checkpointing = cfg.run.gradient_checkpointing
    if method.controlnet_model_name_or_path:
        net = FluxControlNet.from_file(transformer, method.controlnet_model_name_or_path, checkpointing=checkpointing)
    else:
        net = FluxControlNet.create(transformer, method.depth, checkpointing=checkpointing)
    net.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    net.set_training(True)
    with streamed_saves(method.mem_eff_save):  # --mem_eff_save: the file written tensor by tensor
        return train(run, net, net.param_groups(cfg.optim.learning_rate))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
