"""Pre-compute the latent cache of a dataset (sd-scripts' tools/cache_latents.py), so training starts without
encoding images.

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
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library import train_setup
from library.config import parse_args
from library.families import detect_family
from library.runtime import make_accelerator
from networks.tool_common import main_guard


def build_parser() -> argparse.ArgumentParser:
    import train_network

    parser = train_network.build_parser()
    parser.description = __doc__
    extra = parser.add_argument_group("cache_latents")
    extra.add_argument("--sdxl", action="store_true", help="accepted: the family is read from the model")
    extra.add_argument("--skip_existing", action="store_true", help="accepted (sd-scripts: deprecated, no effect)")
    return parser


def family_names(args: argparse.Namespace) -> tuple[str, ...]:
    path = args.pretrained_model_name_or_path
    detected = detect_family(path).name if path and Path(path).exists() else None
    return ("sdxl",) if args.sdxl or detected == "sdxl" else ("sd1", "sd2")


def main(argv: Sequence[str] | None = None) -> train_setup.Run | None:
    """Fill the caches; returns the run (plan, caches) for inspection."""
    args = parse_args(build_parser(), argv)
    if args is None:  # --output_config wrote the file
        return None
    args.cache_latents = True
    args.cache_latents_to_disk = args.cache_latents_to_disk or not args.cache_dir
    args.output_dir = args.output_dir or "."  # read_config requires it; caching writes nothing there
    cfg = train_setup.read_config(args, family_names(args))  # every dataset / model problem at once
    train_setup.setup_logging(cfg)
    accelerator = make_accelerator(cfg.run)
    plan = train_setup.build_plan(cfg, accelerator)
    parts = train_setup.load_model(cfg, accelerator)
    run = train_setup.Run(cfg, accelerator, cfg.family, parts, plan, schedule=None, step_models=None)
    train_setup.fill_caches(run)
    where = cfg.data.cache_dir or "next to the images"
    entries = len(set(run.latent_cache.keys.values()))
    print(f"latent cache: {entries} entries for {sum(len(d.records) for d in plan.datasets)} images in {where}")
    return run


if __name__ == "__main__":
    sys.exit(main_guard(main))
