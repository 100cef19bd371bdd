"""FLUX.2 (dev, klein) text-to-image with LoRA: musubi-tuner's flux_2_generate_image.py command line over
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python flux_2_generate_image.py --model_version klein-base-4b --dit flux2-klein-base-4b.safetensors \
        --vae ae.safetensors --text_encoder model-00001-of-00002.safetensors --prompt "a cat" \
        --image_size 1024 1024 --seed 1 --save_path out --lora_weight my-lora.safetensors --lora_multiplier 1.0

Read with musubi-tuner's meanings: ``--dit --vae --text_encoder --model_version`` (default: read from the weights),
``--lora_weight`` / ``--lora_multiplier`` (kohya files of networks.lora_flux_2, LyCORIS files too: ``--lycoris``
accepted), ``--prompt --negative_prompt --image_size H W``, ``--infer_steps`` (default: musubi-tuner's per model, klein
4, base 50), ``--guidance_scale`` (true CFG of the base models, default 4.0; the distilled klein models run without
CFG, as musubi-tuner's ``denoise``), ``--embedded_cfg_scale`` (dev's embedded guidance, default 4.0),
``--flow_shift`` (a static shift), ``--seed --save_path`` (a folder), ``--from_file``, ``--interactive``,
``--device``, ``--attn_mode torch|sdpa``, ``--blocks_to_swap`` (read as ``--offload``). The schedule is FLUX.1's resolution-dependent shift, not musubi-tuner's empirical μ
(``compute_empirical_mu``): images differ at the same seed. Refused with the reason:
``--control_image_path`` (reference images), ``--fp8 --fp8_scaled --fp8_text_encoder``, ``--include_patterns
--exclude_patterns``, ``--output_type`` other than images, ``--latent_path``, ``--save_merged_model``,
``--no_metadata``, ``--sample_solver`` other than euler.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.flux2 import FLUX2
from library.sampling.musubi_generate import Flag, MusubiGenerateScript


def spec_fields(args: argparse.Namespace, parts: Any) -> dict[str, Any]:
    """Base models: true CFG with the negative prompt (musubi-tuner's default " "); the distilled klein models run
    without CFG, dev with its embedded guidance; steps by default musubi-tuner's per model."""
    distilled = bool(parts.scheduler_config.get("guidance_distilled"))
    return {
        "negative_prompt": " " if args.negative_prompt is None else args.negative_prompt,
        "steps": args.infer_steps or int(parts.scheduler_config["default_steps"]),
        "scale": 1.0 if distilled else args.guidance_scale,
        "guidance": args.embedded_cfg_scale if parts.denoiser.config.guidance_embeds else None,  # dev
    }


SCRIPT = MusubiGenerateScript(
    FLUX2,
    __doc__,
    logging.getLogger("flux_2_generate_image"),
    dit_help="FLUX.2 DiT .safetensors (or a diffusers folder)",
    vae_help="FLUX.2 AE (ae.safetensors)",
    spec_fields=spec_fields,
    refused_switches={
        "fp8_text_encoder": "float8 text encoders are not supported yet",
        "cpu_noise": "the noise is drawn on the CPU with the seed already",
    },
    refused_values={
        "control_image_path": "reference images (FLUX.2's edit mode) are not supported yet",
        "video_path": "not read here",
        "image_path": "not read here",
    },
    guidance_scale=Flag(4.0, "true CFG scale of the base models (default 4.0)"),
    image_size=Flag([1024, 1024]),
    infer_steps=Flag(None, "default: klein 4, base 50 (musubi-tuner)"),
    extra_args=lambda g: g.add_argument(
        "--embedded_cfg_scale", type=float, default=4.0, help="dev's embedded guidance (default 4.0)"
    ),
)
build_parser = SCRIPT.build_parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image paths."""
    from networks.apply import apply_adapter_files

    return SCRIPT.run(argv, apply_adapter_files)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
