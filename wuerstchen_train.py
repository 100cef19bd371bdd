"""Fine-tune the Würstchen 2 prior (sd-scripts' wuerstchen branch's ``wuerstchen/wuerstchen_train.py``, its flags):
fine_tune.py's recipe with the Würstchen family.

    accelerate launch wuerstchen_train.py --pretrained_prior_model_name_or_path wuerstchen-prior \
        --effnet_checkpoint_path effnet_encoder.safetensors --dataset_config dataset.toml --output_dir out \
        --output_name w2_ft --save_model_as diffusers_safetensors --learning_rate 1e-5 --mixed_precision bf16

The output is a diffusers ``WuerstchenPriorPipeline`` folder (``WuerstchenPrior.from_pretrained(out, subfolder=
"prior")`` reads it; the EfficientNet encoder is kept beside it in ``effnet/``); ``--train_text_encoder`` trains
CLIP-bigG too at ``--learning_rate_te1``. Single files are refused before training (the released prior is a folder).
Samples during training (``--sample_prompts``) need ``--decoder``, a diffusers ``WuerstchenDecoderPipeline`` folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.stable_cascade.wuerstchen import prior_flag

FAMILIES = ("wuerstchen",)
FORMATS = ("diffusers", "diffusers_safetensors")  # the prior pipeline's folder; no pickles, no single file
FLAG_SETS = ("train_text_encoder", "fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    return prior_flag(fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__))


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
