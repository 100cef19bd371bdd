"""Qwen-Image text-to-image with LoRA: musubi-tuner's qwen_image_generate_image.py command line over
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python qwen_image_generate_image.py --dit qwen_image_bf16.safetensors --vae qwen_image_vae.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --prompt "a cat" --image_size 1024 1024 --infer_steps 25 \
        --guidance_scale 4.0 --seed 1 --save_path out --lora_weight my-lora.safetensors --lora_multiplier 1.0

Read with musubi-tuner's meanings: ``--dit --vae --text_encoder``, ``--model_version original``, ``--lora_weight`` /
``--lora_multiplier`` (kohya files of networks.lora_qwen_image, LyCORIS files too: ``--lycoris`` accepted),
``--prompt --negative_prompt --image_size H W --infer_steps`` (default 25) ``--guidance_scale`` (true CFG, default 4.0)
``--flow_shift`` (a static shift; default: Qwen-Image's dynamic shift, μ from (256, 0.5) to (8192, 0.9)) ``--seed
--save_path`` (a folder), ``--from_file``, ``--interactive``, ``--device``, ``--attn_mode torch|sdpa``,
``--blocks_to_swap`` (read as ``--offload``: each part on the device only while it runs), ``--fp8_vl`` (Qwen2.5-VL in float8). The Euler sampler does not
stretch the schedule to the scheduler's ``shift_terminal`` 0.02 (diffusers / musubi-tuner do): images differ
slightly at the same seed. Refused with the reason: the edit / layered options (``--control_image_path`` ...),
``--fp8 --fp8_scaled --fp8_fast``, ``--text_encoder_cpu``, ``--include_patterns --exclude_patterns``,
``--output_type`` other than images, ``--latent_path``, ``--save_merged_model``, ``--no_metadata``,
``--sample_solver`` other than euler, ``--num_layers``, ``--vae_enable_tiling``, the RCM / mask options.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.families.qwen_image import QWEN_IMAGE
from library.sampling.musubi_generate import MusubiGenerateScript

EDIT = "the edit models are not supported yet"
LAYERED = "the layered model is not supported yet"
SCRIPT = MusubiGenerateScript(
    QWEN_IMAGE,
    __doc__,
    logging.getLogger("qwen_image_generate_image"),
    dit_help="Qwen-Image DiT .safetensors (or a diffusers folder)",
    vae_help="Qwen-Image VAE .safetensors",
    spec_fields=lambda args, parts: {
        "negative_prompt": args.negative_prompt or "",
        "steps": args.infer_steps,
        "scale": args.guidance_scale,
    },  # fmt: skip
    refused_switches={
        "text_encoder_cpu": "use --offload (each part on the device only while it runs)",
        "resize_control_to_image_size": EDIT,
        "resize_control_to_official_size": EDIT,
        "append_original_name": EDIT,
        "automatic_prompt_lang_for_layered": LAYERED,
        "cfg_normalize": "CFG renormalisation is not done here",
        "bell": "not done here",
    },
    refused_values={
        "control_image_path": EDIT,
        "mask_path": EDIT,
        "output_layers": LAYERED,
        "embedded_cfg_scale": "Qwen-Image has no embedded guidance",
        **dict.fromkeys(
            ("rcm_threshold", "rcm_relative_threshold", "rcm_kernel_size", "rcm_dilate_size", "rcm_debug_save"),
            "not done here",
        ),  # fmt: skip
    },
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
