"""Fine-tune a whole Lumina Image 2.0 transformer: fine_tune.py's recipe with the Lumina 2 family.

    accelerate launch lumina_train.py --pretrained_model_name_or_path lumina_2_model_bf16.safetensors \
        --gemma2 gemma_2_2b_fp16.safetensors --ae ae.safetensors --dataset_config dataset.toml --output_dir out \
        --output_name tuned --learning_rate 1e-5 --timestep_sampling nextdit_shift --save_model_as safetensors

sd-scripts' lumina_train.py flags with the same meaning: fine_tune.py's, block swapping, the Lumina 2 objective and
model flags (library/families/lumina/), ``--mem_eff_save``, ``--fused_optimizer_groups``,
``--blockwise_fused_optimizers``, ``--cpu_offload_checkpointing``. The output is what sd-scripts writes: the
transformer as an Alpha-VLLM single file (ComfyUI and diffusers' ``from_single_file`` read it), or with
``--save_model_as diffusers`` a diffusers Lumina2 folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("lumina2",)
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # no pickles
FLAG_SETS = ("fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__, block_swap=True)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
