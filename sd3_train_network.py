"""Train a LoRA-family adapter for SD3 medium or SD3.5 medium / large: train_network.py's recipe with the SD3
families.

    accelerate launch sd3_train_network.py --pretrained_model_name_or_path sd3.5_large.safetensors \
        --clip_l clip_l.safetensors --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors \
        --dataset_config dataset.toml --output_dir out --network_module networks.lora --network_dim 16 \
        --weighting_scheme uniform --blocks_to_swap 32 --cache_text_encoder_outputs_to_disk

sd-scripts' sd3_train_network.py flags with the same meaning: train_network.py's, SD3's flow-matching objective
(library/objectives/flow.py ``add_sd3_flow_args``: ``--weighting_scheme --logit_mean --logit_std --mode_scale
--training_shift`` with ``--min_timestep --max_timestep``), block swapping (``--blocks_to_swap``,
``--cpu_offload_checkpointing``: library/run/block_swap.py) and the SD3 model flags (``--clip_l --clip_g --t5xxl
--t5xxl_max_token_length --apply_lg_attn_mask --apply_t5_attn_mask --clip_l_dropout_rate --clip_g_dropout_rate
--t5_dropout_rate --pos_emb_random_crop_rate --enable_scaled_pos_embed --text_encoder_batch_size``:
library/families/sd3/options.py). The model is an SAI single file with or without its text encoders (then
``--clip_l --clip_g --t5xxl``), or a diffusers folder; SD3 medium, SD3.5 medium and SD3.5 large are read from the
weights. ``python sd3_train_network.py --demo`` trains a LoRA on a tiny SD3 medium model and example images (no
download).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.sd3.options import FAMILY_NAMES

FAMILIES = FAMILY_NAMES  # the first is what --demo builds


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus the SD3 families' own (objective and model)."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILIES)


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
