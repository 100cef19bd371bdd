"""Train a textual-inversion embedding (new token vectors) for SD 1.x / 2.x; SDXL: sdxl_train_textual_inversion.py.

    accelerate launch train_textual_inversion.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml --output_dir out --token_string sks_cat --init_word cat \
        --num_vectors_per_token 4 --learning_rate 5e-3 --max_train_steps 1000

Takes sd-scripts' flags with the same meaning (``--config_file`` TOML too). Only the new token's rows are trained
(every other weight stays bit-identical); the file is ``{"emb_params": ...}`` (SDXL ``{"clip_l", "clip_g"}``),
``.pt`` by default or ``.safetensors``, named after the token unless ``--output_name`` is given. Write the token in
captions (or use ``--use_object_template`` / ``--use_style_template``) and in sample prompts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.measure import plan as memory_plan  # noqa: F401 - registers the --plan_memory planner
from library.run import args as arg_groups
from library.run import config as run_config
from library.run import run_files
from library.run import setup as run_setup
from library.run.loop import train
from library.run.token_embeddings import TextualInversionConfig, TokenEmbeddings, caption_rewriter, init_vectors
from library.run.trainer import Result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg_groups.add_textual_inversion_groups(parser)
    return parser


def run(argv: Sequence[str] | None = None, family_names: Sequence[str] = ("sd1", "sd2")) -> Result | None:
    args = parse_args(build_parser(), argv)  # --config_file merged
    if args is None:  # --output_config wrote the file
        return None
    args.output_name = args.output_name or args.token_string  # sd-scripts: files are named after the token
    cfg = run_config.read_config(
        args, tuple(family_names), TextualInversionConfig.from_args, training="textual_inversion"
    )  # all errors at once
    if run_files.nothing_left(cfg.save, cfg.run):  # --resume of a finished run: say so, write nothing
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)  # the VAE when every latent is cached
    ti = cfg.method
    vectors = init_vectors(run.family, run.parts, ti.token_string, ti.num_vectors_per_token, ti.init_word, ti.weights)
    embedding = TokenEmbeddings(run.family, run.parts, ti.token_string, vectors, ti.init_word)  # tokens added
    embedding.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    embedding.caption_rewrite = caption_rewriter([embedding], ti.templates)  # templates, tok -> tok tok1 ..
    return train(run, embedding, embedding.param_groups(cfg.optim.learning_rate))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
