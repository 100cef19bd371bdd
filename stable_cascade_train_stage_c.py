"""Fine-tune a whole Stable Cascade stage C: fine_tune.py's recipe with the Stable Cascade family, under the name and
flags of sd-scripts' stable-cascade branch.

    accelerate launch stable_cascade_train_stage_c.py --stage_c_checkpoint_path stage_c_lite_bf16.safetensors \
        --text_model_checkpoint_path text_model.safetensors --effnet_checkpoint_path effnet_encoder.safetensors \
        --dataset_config dataset.toml --output_dir out --output_name tuned --learning_rate 1e-5 \
        --cache_latents --cache_text_encoder_outputs --save_model_as safetensors

fine_tune.py's flags, ``--train_text_encoder`` / ``--learning_rate_te1`` and the Stable Cascade flags
(library/families/stable_cascade/). With ``--save_model_as safetensors`` the output is the branch's: stage C under
Stability's names, and with ``--train_text_encoder`` the text model beside it as ``<name>_text_model.safetensors``;
``diffusers`` / ``diffusers_safetensors`` write a StableCascadePriorPipeline folder.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.stable_cascade.options import stage_c_flag

FAMILIES = ("stable_cascade",)
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # no pickles
FLAG_SETS = ("train_text_encoder", "fused_groups", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    return stage_c_flag(fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__))


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, formats=FORMATS)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
