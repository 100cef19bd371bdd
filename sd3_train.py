"""Fine-tune a whole SD3 medium / SD3.5 medium / large model: fine_tune.py's recipe with the SD3 families.

    accelerate launch --mixed_precision bf16 sd3_train.py --pretrained_model_name_or_path sd3_medium.safetensors \
        --dataset_config dataset.toml --output_dir output --output_name sd3_finetuned --train_text_encoder \
        --learning_rate 4e-6 --blocks_to_swap 10

sd-scripts' sd3_train.py flags with the same meaning: fine_tune.py's, SD3's flow-matching objective
(library/families/sd3/objective.py), the SD3 model flags (library/families/sd3/options.py), block
swapping (``--blocks_to_swap``: library/run/block_swap.py), the steps in backward (``--fused_backward_pass``: Adafactor,
one parameter at a time; ``--blockwise_fused_optimizers``: one step per joint block; ``--fused_optimizer_groups``:
library/optim/fused.py) and sd3_train.py's own (library/families/sd3/full_training.py): ``--train_text_encoder``
(CLIP-L and CLIP-G), ``--train_t5xxl``, ``--learning_rate_te1 / te2 / te3`` (0 = that encoder is not trained),
``--use_t5xxl_cache_only`` (the T5 outputs come from the cache while CLIP-L / CLIP-G train),
``--num_last_block_to_freeze`` (the last N ``x_block`` parameters, counted as sd-scripts counts them). The output is
what sd-scripts writes: an SAI single file with the transformer and the VAE, and each trained text encoder next to
it (``<name>_clip_l.safetensors`` ...); with ``--save_model_as diffusers`` a diffusers folder of everything.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.sd3.options import FAMILY_NAMES

FAMILIES = FAMILY_NAMES
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # sd-scripts' ckpt: refused (SD3 has no pickle)
FLAG_SETS = ("fused_groups", "blockwise")  # + SD3's own full fine-tuning group (library/families/sd3/full_training.py)


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups for sd3_train.py (block swapping read), plus the SD3 families' own flags (objective,
    model, full fine-tuning)."""
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
