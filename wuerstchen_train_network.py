"""Train a LoRA-family adapter for the Würstchen 2 prior: train_network.py's recipe with the Würstchen family.

    accelerate launch wuerstchen_train_network.py --pretrained_prior_model_name_or_path wuerstchen-prior \
        --effnet_checkpoint_path effnet_encoder.safetensors --dataset_config dataset.toml --output_dir out \
        --output_name w2_lora --network_module networks.lora --network_dim 16 --network_train_unet_only \
        --cache_latents --cache_text_encoder_outputs --mixed_precision bf16

``--pretrained_prior_model_name_or_path`` (the name sd-scripts' wuerstchen branch gives it) is
``--pretrained_model_name_or_path``: a diffusers ``WuerstchenPriorPipeline`` folder. The EfficientNet encoder is
Würstchen 2's (``model_v2_stage_b.pt``'s ``effnet_state_dict``, affine mapper BatchNorm) or Stable Cascade's
``effnet_encoder.safetensors`` (what OneTrainer loads for both). Adapters: ``lora_unet_`` + the prior's diffusers
module path (every Linear and 1x1 convolution), ``lora_te_`` on CLIP-bigG unless ``--network_train_unet_only``.
Samples during training (``--sample_prompts``) need ``--decoder``, a diffusers ``WuerstchenDecoderPipeline`` folder
(warp-ai/wuerstchen; ``--decoder_steps`` / ``--decoder_guidance_scale``); images after training:
``stable_cascade_gen_img.py --decoder``.
See library/families/stable_cascade/wuerstchen.py and docs/stable_cascade.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import train_network
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.stable_cascade.wuerstchen import prior_flag

FAMILIES = ("wuerstchen",)


def build_parser() -> argparse.ArgumentParser:
    """train_network.py's flags plus the Würstchen / Stable Cascade folder's own."""
    return prior_flag(train_network.build_parser(__doc__, family_names=FAMILIES))


run = functools.partial(train_network.run, family_names=FAMILIES, parser=build_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
