"""Fine-tune a whole SD 1.x / 2.x model (UNet, and the text encoder with --train_text_encoder); SDXL: sdxl_train.py,
DreamBooth with class images: train_db.py.

    accelerate launch fine_tune.py --pretrained_model_name_or_path model.safetensors \
        --in_json meta_lat.json --train_data_dir images --output_dir out --save_model_as safetensors \
        --optimizer_type adafactor --learning_rate 1e-6 --max_train_steps 10000

Takes sd-scripts' flags with the same meaning (``--config_file`` TOML too) and its datasets: ``--in_json`` metadata
(made with finetune/merge_captions_to_metadata.py ...), ``--dataset_config`` TOML, or ``<repeats>_<tokens>`` folders.
The output is the whole model: a single file (``--save_model_as safetensors`` / ``ckpt``) that A1111, ComfyUI and
diffusers' ``from_single_file`` read, or a diffusers folder (``diffusers``: .bin weights / ``diffusers_safetensors``);
without ``--save_model_as`` the format of the input model (``--use_safetensors``: in safetensors). ``accelerate launch`` with an accelerate config gives DDP,
FSDP or DeepSpeed (docs/training.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.families import get_family
from library.measure import plan as memory_plan  # noqa: F401 - registers the --plan_memory planner
from library.run import args as arg_groups
from library.run import config as run_config
from library.run import setup as run_setup
from library.run.loop import train
from library.run.model_trainable import ModelTrainable, ModelTrainingConfig
from library.run.trainer import Result

MODEL_FORMATS = ("safetensors", "ckpt", "diffusers", "diffusers_safetensors")
FAMILIES = ("sd1", "sd2")
FLAG_SETS = ("train_text_encoder",)  # sd-scripts' fine_tune.py: --train_text_encoder, --diffusers_xformers


def build_parser(
    family_names: Sequence[str] = FAMILIES,
    flag_sets: Sequence[str] = FLAG_SETS,
    description: str | None = __doc__,
    block_swap: bool = False,
) -> argparse.ArgumentParser:
    """The flags of a full-model recipe for ``family_names``: the run groups, the full-training ``flag_sets``
    (library/run/model_trainable.py ``FLAG_SETS``) and the families' own flags; ``block_swap``: the block-swap flags
    are read (transformer scripts), not refused."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg_groups.add_model_training_groups(parser, flag_sets, family_names, block_swap=block_swap)
    return parser


def output_format(args: argparse.Namespace) -> str | None:
    """sd-scripts' rule: ``ckpt`` / ``safetensors`` write one file, ``diffusers`` / ``diffusers_safetensors`` a
    folder (without --save_model_as: the input's kind), in safetensors when --use_safetensors is given or the
    format's name says so (``--save_model_as ckpt --use_safetensors`` writes a .safetensors file; ``diffusers``
    alone writes .bin weights). One difference: a .safetensors input without either flag gives a .safetensors file
    (sd-scripts writes a .ckpt pickle there)."""
    fmt = args.save_model_as
    if not fmt and args.pretrained_model_name_or_path:
        source = Path(args.pretrained_model_name_or_path)
        fmt = "diffusers" if source.is_dir() else "safetensors" if source.suffix.lower() == ".safetensors" else "ckpt"
    if fmt and args.use_safetensors:
        fmt = {"ckpt": "safetensors", "diffusers": "diffusers_safetensors"}.get(fmt, fmt)
    return fmt


def read_config(
    argv: Sequence[str] | None,
    family_names: Sequence[str] = FAMILIES,
    parser: Callable[[], argparse.ArgumentParser] | None = None,
    formats: Sequence[str] = MODEL_FORMATS,
    training: str = "fine_tune",
) -> run_config.TrainConfig | None:
    """The typed configuration the run uses, every problem reported at once; None after --output_config.
    ``parser``: builds the script's parser (default :func:`build_parser`); ``formats``: the --save_model_as values
    the family writes; ``training``: "fine_tune" or "dreambooth" (the text encoders train by default, and a model
    of another family names that family's DreamBooth script)."""
    args = parse_args(parser() if parser is not None else build_parser(family_names), argv)  # --config_file merged
    if args is None:  # --output_config wrote the file
        return None
    family = get_family(family_names[0])
    family.full_training.prepare_args(args)  # deprecated / implied flags, before the groups are read
    args.save_model_as = output_format(args)
    args.xformers = args.xformers or getattr(args, "diffusers_xformers", False)
    method = ModelTrainingConfig.reader(family, training)
    return run_config.read_config(args, tuple(family_names), method, tuple(formats), training=training)


def run(
    argv: Sequence[str] | None = None,
    family_names: Sequence[str] = FAMILIES,
    parser: Callable[[], argparse.ArgumentParser] | None = None,
    formats: Sequence[str] = MODEL_FORMATS,
    training: str = "fine_tune",
) -> Result | None:
    """Train the whole model. ``family_names``: the families the script takes; ``parser`` / ``formats`` /
    ``training``: see :func:`read_config`."""
    cfg = read_config(argv, family_names, parser, formats, training)
    if cfg is None:
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    if cfg.noise.zero_terminal_snr:  # the trained model's files and samples carry its schedule (the ztsnr marker)
        run.parts.scheduler_config = {**run.parts.scheduler_config, "rescale_betas_zero_snr": True}
    model = ModelTrainable(run.family, run.parts, cfg.method, cfg.save.save_model_as)
    if run.block_swap is None:  # (--blocks_to_swap: place_for_training put each weight where it lives)
        model.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    groups = model.param_groups(cfg.optim.learning_rate)
    return train(run, model, groups)  # accelerate prepares model + optimizer: DDP / FSDP / DeepSpeed wrap the UNet


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
