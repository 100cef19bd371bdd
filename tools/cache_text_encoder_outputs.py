"""Pre-compute a dataset's text-encoder output cache before training (sd-scripts' tools/cache_text_encoder_outputs.py).

    python tools/cache_text_encoder_outputs.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml [--cache_dir caches/] [--mixed_precision fp16] [--clip_skip 2]

Takes the training scripts' flags (a whole training command line or --config_file works; flags that only matter for
training are ignored), reads the datasets exactly as training does and encodes every caption a sample can take
(each line of a multi-line caption; "" when captions can be dropped) into the disk cache: --cache_dir when given,
else next to the images (as --cache_text_encoder_outputs_to_disk). A training run with the same model, text-encoder
precision, --clip_skip, --max_token_length, --weighted_captions and captions, and --cache_text_encoder_outputs_to_disk
(or the same --cache_dir) then finds every entry and runs no text encoder. Latents are not cached here (that is
tools/cache_latents.py). The family (SD1 / SD2 / SDXL) is read from the model (--sdxl is accepted); sd-scripts'
tool caches SDXL and FLUX only, here every family training can cache for works.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.parse import add_no_effect, add_unsupported, parse_args
from library.cli.problems import ConfigError
from library.families import family_group
from library.run import train_setup
from library.run.args import add_network_training_groups
from library.run.runtime import make_accelerator
from networks.config import add_network_args

# sd-scripts' FLUX flags (flux_train_utils.add_flux_train_arguments, and --t5xxl_dtype of the tool itself)
FLUX_FLAGS = ("--t5xxl_dtype", "--clip_l", "--t5xxl", "--ae", "--controlnet_model_name_or_path",
              "--t5xxl_max_token_length", "--guidance_scale", "--model_prediction_type", "--discrete_flow_shift",
              "--model_type")  # fmt: skip
# (--blocks_to_swap comes with the run group: refused there for SD models, read by the FLUX / SD3 scripts)
DIT_TRAINING_FLAGS = ("--weighting_scheme", "--mode_scale")


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's groups (a training command line works) with text-encoder caching on, on disk in
    --cache_dir or next to the images; --output_dir is not needed (caching writes nothing there) and the adapter is
    taken as UNet-only (cached outputs cannot train text-encoder adapters; nothing is trained here)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_training_groups(parser, add_network_args)
    parser.set_defaults(cache_text_encoder_outputs=True, cache_text_encoder_outputs_to_disk=True, output_dir=".",
                        network_train_unet_only=True)  # fmt: skip
    extra = parser.add_argument_group("cache_text_encoder_outputs")
    extra.add_argument("--sdxl", action="store_true", help="accepted: the family is read from the model")
    extra.add_argument("--skip_existing", action="store_true", help="accepted (sd-scripts: deprecated, no effect); "
                       "existing entries are always checked and kept")  # fmt: skip
    extra.add_argument("--text_encoder_batch_size", type=int, default=None,
                       help="captions per text-encoder call (default: the first dataset's batch size)")  # fmt: skip
    flux = "FLUX is not a model family of this toolkit yet"
    add_unsupported(extra, "--flux", flux, action="store_true")
    add_unsupported(extra, "--apply_t5_attn_mask", flux, action="store_true")
    for flag in FLUX_FLAGS:
        add_unsupported(extra, flag, flux, default=None)
    for flag in DIT_TRAINING_FLAGS:  # sd-scripts' tool takes them with the DiT training group; caching ignores them
        add_no_effect(extra, flag, "a FLUX / SD3 training option; caching text-encoder outputs does not use it",
                      default=None)  # fmt: skip
    return parser


def family_names(args: argparse.Namespace) -> tuple[str, ...]:
    return family_group(args.pretrained_model_name_or_path, sdxl=args.sdxl)


def run(argv: Sequence[str] | None = None) -> train_setup.Run | None:
    """Fill the text-encoder cache; returns the run (plan, ``text_cache``) for inspection."""
    args = parse_args(build_parser(), argv)
    if args is None:  # --output_config wrote the file
        return None
    if args.text_encoder_batch_size is not None and args.text_encoder_batch_size < 1:
        raise ConfigError([f"--text_encoder_batch_size {args.text_encoder_batch_size}: must be at least 1"])
    args.cache_text_encoder_outputs = args.cache_text_encoder_outputs_to_disk = True
    args.cache_latents = args.cache_latents_to_disk = False  # this tool caches text only (sd-scripts: the same)
    cfg = train_setup.read_config(args, family_names(args))  # every dataset / model problem at once
    train_setup.setup_logging(cfg)
    accelerator = make_accelerator(cfg.run)
    plan = train_setup.build_plan(cfg, accelerator)
    parts = train_setup.load_model(cfg, accelerator)
    run = train_setup.Run(cfg, accelerator, cfg.family, parts, plan, step_models=None)
    train_setup.fill_text_cache(run, batch_size=args.text_encoder_batch_size)
    accelerator.wait_for_everyone()
    where = cfg.data.cache_dir or "next to the images"
    images = sum(len(d.records) for d in plan.datasets)
    print(f"text-encoder cache: {len(run.text_cache.keys)} captions of {images} images in {where}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
