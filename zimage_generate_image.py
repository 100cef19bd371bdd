"""Z-Image text-to-image with LoRA: musubi-tuner's zimage_generate_image.py command line over
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python zimage_generate_image.py --dit z_image_turbo_bf16.safetensors --vae ae.safetensors \
        --text_encoder qwen_3_4b.safetensors --prompt "a cat" --image_size 1024 1024 --infer_steps 8 \
        --guidance_scale 0.0 --seed 1 --save_path out --lora_weight my-lora.safetensors --lora_multiplier 1.0

Read with musubi-tuner's meanings: ``--dit --vae --text_encoder``, ``--lora_weight`` / ``--lora_multiplier`` (kohya
files of networks.lora_zimage, LyCORIS files too: ``--lycoris`` accepted), ``--prompt --negative_prompt --image_size
H W --infer_steps`` (default 25) ``--guidance_scale`` (CFG as musubi-tuner: cond + g (cond − uncond) when g > 1; default 0.0: none, as Turbo
needs)
``--flow_shift`` (the static shift, default 3.0) ``--seed --save_path`` (a folder), ``--from_file``,
``--interactive``, ``--device``, ``--attn_mode torch|sdpa``, ``--fp8_llm`` (Qwen3 in float8), ``--blocks_to_swap``
(read as ``--offload``: each part on the device only while it runs). Refused with the reason: ``--fp8 --fp8_scaled``,
``--text_encoder_cpu``, ``--include_patterns --exclude_patterns``, ``--output_type`` other than images,
``--latent_path``, ``--save_merged_model``, ``--no_metadata``, ``--sample_solver`` other than euler.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.zimage import ZIMAGE
from library.sampling.musubi_generate import Flag, MusubiGenerateScript


def cfg_scale(guidance: float) -> float:
    """musubi-tuner's (and diffusers' ZImagePipeline's) CFG ``cond + g (cond − uncond)``, on only for g > 1, as the
    sampler's ``uncond + s (cond − uncond)``: s = g + 1, else 1 (no CFG)."""
    return guidance + 1.0 if guidance > 1.0 else 1.0


SCRIPT = MusubiGenerateScript(
    ZIMAGE,
    __doc__,
    logging.getLogger("zimage_generate_image"),
    dit_help="Z-Image DiT .safetensors (or a diffusers folder)",
    vae_help="the FLUX.1 AE .safetensors (ae.safetensors)",
    spec_fields=lambda args, parts: {
        "negative_prompt": args.negative_prompt or "",
        "steps": args.infer_steps,
        "scale": cfg_scale(args.guidance_scale),
    },  # fmt: skip
    refused_switches={
        "text_encoder_cpu": "use --offload (each part on the device only while it runs)",
        "cfg_normalize": "CFG renormalisation is not done here",
        "bell": "not done here",
    },
    refused_values={
        "embedded_cfg_scale": "Z-Image has no embedded guidance",
        **dict.fromkeys(
            ("rcm_threshold", "rcm_relative_threshold", "rcm_kernel_size", "rcm_dilate_size", "rcm_debug_save"),
            "not done here",
        ),  # fmt: skip
    },
    guidance_scale=Flag(0.0, "true CFG scale (default 0.0: none)"),
    flow_shift=Flag(3.0, "the static shift (default 3.0)"),
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
