"""Train an extended textual-inversion (XTI) embedding for SD 1.x / 2.x: one embedding per cross-attention layer.

    accelerate launch train_textual_inversion_XTI.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml --output_dir out --token_string sks_cat --init_word cat \
        --num_vectors_per_token 1 --learning_rate 5e-3 --max_train_steps 1000 --save_model_as safetensors

Takes sd-scripts' flags with the same meaning (``--config_file`` TOML too). The token ``tok`` gets one set of
vectors for each of the UNet's 16 cross-attention layers (``tok_IN01`` ... ``tok_OUT11``, sd-scripts' names); each
layer attends to the prompt encoded with its own vectors (``library/run/xti.py``: an attention processor per layer,
no patched forward). The file is sd-scripts' ``{"IN01": (n, dim), ..., "OUT11": (n, dim)}``, ``.pt`` by default;
``gen_img_diffusers.py --XTI_embeddings FILE`` (or ``gen_img.py``) reads it, the token being the file name.
``--weights`` continues from an XTI file. Samples during training are refused (sd-scripts ignores them).

Differences on purpose: with ``--num_vectors_per_token`` > 1 and several init-word tokens, vector j of every layer
starts from init token j (cycled), where sd-scripts' index mixes layer and vector; only the layer rows are
optimised (sd-scripts restores the other rows after each step), see train_textual_inversion.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.run import config as run_config
from library.run import run_files
from library.run import setup as run_setup
from library.run.loop import train
from library.run.token_embeddings import caption_rewriter, init_vectors
from library.run.trainer import Result
from library.run.xti import XTIConfig, XTIEmbeddings, cross_attention_layers, install_processors, read_xti
from train_textual_inversion import build_parser as ti_parser


def build_parser() -> argparse.ArgumentParser:
    parser = ti_parser()
    parser.description = __doc__
    return parser


def run(argv: Sequence[str] | None = None, family_names: Sequence[str] = ("sd1", "sd2")) -> Result | None:
    args = parse_args(build_parser(), argv)  # --config_file merged
    if args is None:  # --output_config wrote the file
        return None
    args.output_name = args.output_name or args.token_string  # sd-scripts: files are named after the token
    cfg = run_config.read_config(args, tuple(family_names), XTIConfig.from_args, training="textual_inversion")
    if run_files.nothing_left(cfg.save, cfg.run):  # --resume of a finished run: say so, write nothing
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)
    ti, layers = cfg.method, cross_attention_layers(run.parts.denoiser)
    if ti.weights:
        vectors = read_xti(ti.weights, list(layers))
        if vectors.shape[1] != ti.num_vectors_per_token:
            raise ValueError(f"--weights {ti.weights}: holds {vectors.shape[1]} vector(s) per layer, but "
                             f"--num_vectors_per_token is {ti.num_vectors_per_token}")  # fmt: skip
    else:
        rows = init_vectors(run.family, run.parts, ti.token_string, ti.num_vectors_per_token, ti.init_word, None)[0]
        vectors = rows.unsqueeze(0).repeat(len(layers), 1, 1)  # every layer starts from the init word
    embedding = XTIEmbeddings(run.family, run.parts, ti.token_string, vectors, list(layers), ti.init_word)
    install_processors(layers)  # each cross-attention layer attends to its own encoding
    embedding.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    embedding.caption_rewrite = caption_rewriter([embedding], ti.templates)  # templates, tok -> tok tok1 ..
    return train(run, embedding, embedding.param_groups(cfg.optim.learning_rate))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
