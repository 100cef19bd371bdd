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
slightly at the same seed. The edit models (``--model_version edit / edit-2509 / edit-2511``) take
``--control_image_path`` (one or more images; required for them, as musubi-tuner), ``--resize_control_to_image_size``,
``--resize_control_to_official_size`` with musubi-tuner's sizes: the prompt and the negative prompt are encoded with
the control images, whose latents every DiT call gets as references (library/families/qwen_image/edit.py). Refused
with the reason: ``--mask_path``, ``--append_original_name``, the layered options,
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
from library.families.qwen_image.options import EDIT_VERSIONS
from library.sampling.musubi_generate import MusubiGenerateScript

EDIT = "not done for the edit models here"
LAYERED = "the layered model is not supported yet"


def edit_args(group) -> None:
    group.add_argument("--control_image_path", type=str, nargs="*", default=None,
                       help="the edit models' control (reference) image(s); resized to the bucket of their own area "
                       "unless one of the next two flags is given")  # fmt: skip
    group.add_argument("--resize_control_to_image_size", action="store_true",
                       help="control images resized to --image_size")  # fmt: skip
    group.add_argument("--resize_control_to_official_size", action="store_true",
                       help="control images resized to a 1024 x 1024 area (384 x 384 for Qwen2.5-VL)")  # fmt: skip


def edit_problems(args, options) -> list[str]:
    """musubi-tuner's rule: an edit model needs --control_image_path; the original takes none."""
    edit = options.model_version in EDIT_VERSIONS
    if edit and not args.control_image_path:
        return [f"--model_version {options.model_version}: give the control image(s) with --control_image_path "
                "(musubi-tuner requires them for the edit models)"]  # fmt: skip
    given = [f for f in ("control_image_path", "resize_control_to_image_size", "resize_control_to_official_size")
             if getattr(args, f)]  # fmt: skip
    if not edit and given:
        return [f"--{given[0]}: for the edit models; add --model_version edit, edit-2509 or edit-2511"]
    missing = [p for p in args.control_image_path or () if not Path(p).is_file()]
    return [f"--control_image_path {p}: no such file" for p in missing]


def edit_sampling(args, family, parts):
    """The family with the control images (library/families/qwen_image/edit.py), or itself for the original."""
    import torch

    from library.families.qwen_image import edit

    version = parts.options.model_version
    if version not in EDIT_VERSIONS:
        return family
    height, width = args.image_size
    pixels, shown = edit.generation_controls(args.control_image_path, args.resize_control_to_official_size,
                                             (width, height) if args.resize_control_to_image_size else None)  # fmt: skip
    vae = parts.vae
    device, dtype = next(vae.parameters()).device, next(vae.parameters()).dtype
    with torch.no_grad():
        latents = [family.encode_latents(parts, p.to(device, dtype)).cpu() for p in pixels]
    return edit.EditSampling(family, version, shown, latents)


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
        "append_original_name": EDIT,
        "automatic_prompt_lang_for_layered": LAYERED,
        "cfg_normalize": "CFG renormalisation is not done here",
        "bell": "not done here",
    },
    refused_values={
        "mask_path": "inpainting masks are not done here",
        "output_layers": LAYERED,
        "embedded_cfg_scale": "Qwen-Image has no embedded guidance",
        **dict.fromkeys(
            ("rcm_threshold", "rcm_relative_threshold", "rcm_kernel_size", "rcm_dilate_size", "rcm_debug_save"),
            "not done here",
        ),  # fmt: skip
    },
    extra_args=edit_args,
    extra_problems=edit_problems,
    sampling=edit_sampling,
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
