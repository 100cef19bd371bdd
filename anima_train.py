"""Fine-tune a whole Anima DiT (with its LLM adapter): fine_tune.py's recipe with the Anima family.

    accelerate launch --mixed_precision bf16 anima_train.py --pretrained_model_name_or_path anima.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --dataset_config dataset.toml \
        --output_dir out --output_name anima_finetuned --learning_rate 1e-5 --llm_adapter_lr 0 \
        --gradient_checkpointing --cache_latents --cache_text_encoder_outputs --blocks_to_swap 8

sd-scripts' anima_train.py flags with the same meaning: fine_tune.py's, the objective and model flags
(library/families/anima/objective.py, options.py), block swapping (``--blocks_to_swap``, up to blocks - 2;
``--cpu_offload_checkpointing``), the steps in backward (``--fused_backward_pass``, ``--blockwise_fused_optimizers``,
``--fused_optimizer_groups``) and the per-group learning rates ``--self_attn_lr --cross_attn_lr --mlp_lr --mod_lr
--llm_adapter_lr`` (library/families/anima/full_training.py). Qwen3 is not trained (sd-scripts' neither). The output is
what sd-scripts writes: the DiT alone as one .safetensors, every key under ``net.`` (ComfyUI's layout).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.anima.options import FAMILY_NAMES

FORMATS = ("safetensors",)  # sd-scripts writes the DiT as one .safetensors
FLAG_SETS = ("fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups for anima_train.py (block swapping read), plus Anima's own flags."""
    return fine_tune.build_parser(FAMILY_NAMES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILY_NAMES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
