"""Train a LoRA-family adapter for Lumina Image 2.0: train_network.py's recipe with the Lumina 2 family.

    accelerate launch lumina_train_network.py --pretrained_model_name_or_path lumina_2_model_bf16.safetensors \
        --gemma2 gemma_2_2b_fp16.safetensors --ae ae.safetensors --dataset_config dataset.toml --output_dir out \
        --network_module networks.lora_lumina --network_dim 8 --timestep_sampling nextdit_shift \
        --discrete_flow_shift 6.0 --model_prediction_type raw --system_prompt "You are an assistant ..."

sd-scripts' lumina_train_network.py flags with the same meaning: train_network.py's, block swapping
(``--blocks_to_swap``, ``--cpu_offload_checkpointing``), the Lumina 2 objective (``--timestep_sampling`` shift |
nextdit_shift | flux_shift | uniform | sigmoid | sigma, ``--sigmoid_scale --discrete_flow_shift
--model_prediction_type --weighting_scheme --logit_mean --logit_std --mode_scale``) and model flags (``--gemma2 --ae
--gemma2_max_token_length --system_prompt --use_flash_attn --use_sage_attn --sample_batch_size
--text_encoder_batch_size``): library/families/lumina/. Gemma's tokenizer (gated on the hub) is read from the
folder of the ``--gemma2`` file, the diffusers folder's ``tokenizer/`` or ``--tokenizer_cache_dir``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("lumina2",)


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus the Lumina 2 family's own (objective and model)."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILIES)


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
