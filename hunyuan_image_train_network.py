"""Train a LoRA for HunyuanImage 2.1: train_network.py's recipe with the HunyuanImage family.

    accelerate launch hunyuan_image_train_network.py --pretrained_model_name_or_path hunyuanimage2.1.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --byt5 byt5_small_glyphxl_fp16.safetensors \
        --vae hunyuan_image_2.1_vae_fp16.safetensors --dataset_config dataset.toml --output_dir out \
        --network_module networks.lora_hunyuan_image --network_dim 16 --network_train_unet_only \
        --model_prediction_type raw --discrete_flow_shift 5.0 --cache_text_encoder_outputs --cache_latents

sd-scripts' hunyuan_image_train_network.py flags with the same meaning: train_network.py's, block swapping
(``--blocks_to_swap``, ``--cpu_offload_checkpointing``), the objective (``--timestep_sampling`` sigma | uniform |
sigmoid | shift | flux_shift, ``--sigmoid_scale --discrete_flow_shift --model_prediction_type --weighting_scheme
--logit_mean --logit_std --mode_scale``) and model flags (``--text_encoder --byt5 --vae_chunk_size --attn_mode
--split_attn --text_encoder_batch_size``): library/families/hunyuan_image/. ``--network_train_unet_only`` is
required; ``--fp8_base`` alone is refused (sd-scripts: use ``--fp8_scaled``); ``--fp8_scaled`` (the DiT in scaled
float8), ``--fp8_vl`` (Qwen2.5-VL in float8) and ``--text_encoder_cpu`` (the text encoders compute on the CPU) as
sd-scripts. Sample images use sd-scripts' sampler (CFG, then adaptive projected guidance).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("hunyuan_image",)


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags with block swapping read, plus the HunyuanImage family's own."""
    return train_network.build_parser(__doc__, block_swap=True, family_names=FAMILIES)


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
