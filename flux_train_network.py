"""Train a LoRA-family adapter for FLUX.1 dev / schnell or Chroma: train_network.py's recipe with the FLUX families.

    accelerate launch flux_train_network.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl.safetensors --ae ae.safetensors \
        --dataset_config dataset.toml --output_dir out --network_module networks.lora --network_dim 16 \
        --guidance_scale 1.0 --timestep_sampling flux_shift --model_prediction_type raw

sd-scripts' flux_train_network.py flags with the same meaning: train_network.py's, the flow-matching objective
(library/objectives/flow.py: ``--timestep_sampling --sigmoid_scale --discrete_flow_shift --model_prediction_type
--weighting_scheme --logit_mean --logit_std --mode_scale``), block swapping (``--blocks_to_swap``,
``--cpu_offload_checkpointing``: library/run/block_swap.py) and the FLUX model flags (``--clip_l --t5xxl --ae
--model_type --t5xxl_max_token_length --apply_t5_attn_mask --guidance_scale --text_encoder_batch_size``:
library/families/flux/options.py). The model is a BFL single file with ``--clip_l --t5xxl --ae``, or a diffusers
folder; dev / schnell / Chroma are read from the weights (``--model_type`` must agree). ``python
flux_train_network.py --demo`` trains a LoRA on a tiny FLUX.1-dev model and example images (no download).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("flux-dev", "flux-schnell", "chroma")  # the first is what --demo builds


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus the FLUX families' own (objective and model)."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILIES)


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
