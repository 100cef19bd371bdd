"""Fine-tune a whole FLUX.1 dev / schnell or Chroma transformer: fine_tune.py's recipe with the FLUX families.

    accelerate launch --mixed_precision bf16 flux_train.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl.safetensors --ae ae.safetensors \
        --dataset_config dataset.toml --output_dir out --output_name flux1_finetuned --learning_rate 1e-5 \
        --optimizer_type adafactor --optimizer_args "relative_step=False" "scale_parameter=False" \
        "warmup_init=False" --fused_backward_pass --blocks_to_swap 18 --full_bf16

sd-scripts' flux_train.py flags with the same meaning: fine_tune.py's, the flow-matching objective
(library/objectives/flow.py), the FLUX model flags (library/families/flux/options.py), block swapping (``--blocks_to_swap``;
the deprecated ``--double_blocks_to_swap`` / ``--single_blocks_to_swap`` read as sd-scripts reads them,
``--cpu_offload_checkpointing``: library/run/block_swap.py) and the steps in backward (``--fused_backward_pass``: Adafactor,
one parameter at a time; ``--blockwise_fused_optimizers``: one step per transformer block; ``--fused_optimizer_groups``:
library/optim/fused.py). Only the transformer is trained (sd-scripts' script has no text-encoder training). The output
is what sd-scripts writes, the transformer as a BFL single file with the input's keys and shapes
(``--mem_eff_save``: written tensor by tensor), or with ``--save_model_as diffusers`` a diffusers folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("flux-dev", "flux-schnell", "chroma")
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # sd-scripts' ckpt: refused (FLUX has no pickle)


FLAG_SETS = ("fused_groups", "blockwise")  # + FLUX's own: --mem_eff_save, the deprecated block-swap flags


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups for flux_train.py (block swapping read), plus the FLUX families' own flags (objective,
    model, full fine-tuning)."""
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
