"""Train a LoRA-family adapter for Anima: train_network.py's recipe with the Anima family.

    accelerate launch anima_train_network.py --pretrained_model_name_or_path anima-base-v1.0.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --dataset_config dataset.toml \
        --output_dir out --network_module networks.lora_anima --network_dim 8 --timestep_sampling sigmoid \
        --discrete_flow_shift 1.0 --cache_latents --cache_text_encoder_outputs

sd-scripts' anima_train_network.py flags with the same meaning: train_network.py's, block swapping
(``--blocks_to_swap``, up to blocks - 2; ``--cpu_offload_checkpointing``), the objective (``--timestep_sampling``
default sigmoid, ``--sigmoid_scale --discrete_flow_shift --weighting_scheme --logit_mean --logit_std --mode_scale``:
library/families/anima/objective.py) and the model flags (``--qwen3 --vae --llm_adapter_path --t5_tokenizer_path
--qwen3_max_token_length --t5_max_token_length --vae_chunk_size --vae_disable_cache --attn_mode --split_attn
--text_encoder_batch_size``: library/families/anima/options.py). The full fine-tune's learning-rate flags are
accepted with no effect, as in sd-scripts. ``--network_module networks.lora_anima`` is sd-scripts' Anima LoRA
(library/families/anima/lora.py); ``lycoris.kohya`` (LoHa, LoKr ...) works on Anima too.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.anima.options import FAMILY_NAMES, add_lora_script_args


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus Anima's own (objective and model)."""
    return add_lora_script_args(train_network.build_parser(__doc__, block_swap=True, family_names=FAMILY_NAMES))


run = functools.partial(train_network.run, family_names=FAMILY_NAMES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
