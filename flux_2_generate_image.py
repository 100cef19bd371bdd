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
``--device``, ``--attn_mode torch|sdpa``, ``--blocks_to_swap`` (read as ``--offload``), ``--control_image_path`` (reference
images, the edit mode: each resized as musubi-tuner's ``preprocess_control_image``, to the bucket of its own area, or
cut to 2024 x 2024 (one image) / 1024 x 1024 (several) when larger, unless ``--no_resize_control``; their latents
given to every DiT call as references). The schedule is FLUX.1's resolution-dependent shift, not musubi-tuner's empirical μ
(``compute_empirical_mu``): images differ at the same seed. Refused with the reason:
``--fp8 --fp8_scaled --fp8_text_encoder``, ``--include_patterns
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


def extra_args(g: Any) -> None:
    g.add_argument("--embedded_cfg_scale", type=float, default=4.0, help="dev's embedded guidance (default 4.0)")
    g.add_argument("--control_image_path", type=str, nargs="*", default=None,
                   help="reference image(s): FLUX.2's edit mode")  # fmt: skip
    g.add_argument("--no_resize_control", action="store_true",
                   help="reference images at the bucket of their own area (step 16), however large")  # fmt: skip


def control_size(size: tuple[int, int], count: int, no_resize: bool) -> tuple[int, int]:
    """musubi-tuner's preprocess_control_image size: the bucket of the image's own area (step 16), or the limit
    itself (2024 x 2024 for one image, 1024 x 1024 for several) when the image is larger."""
    from library.data.control_images import bucket_for_area

    limit = None if no_resize else ((1024, 1024) if count > 1 else (2024, 2024))
    if limit is None or limit[0] * limit[1] >= size[0] * size[1]:
        return bucket_for_area(size, size, 16)
    return limit


class WithReferences:
    """The family with every DiT call given the reference latents (1, C, h, w) repeated over the batch."""

    def __init__(self, family: Any, latents: list[Any]) -> None:
        self.family, self.latents = family, latents

    def __getattr__(self, name: str) -> Any:
        return getattr(self.family, name)

    def predict(self, denoiser: Any, noisy: Any, t: Any, cond: Any, **options: Any) -> Any:
        refs = [r.to(noisy.device, noisy.dtype).expand(noisy.shape[0], -1, -1, -1) for r in self.latents]
        return self.family.predict(denoiser, noisy, t, cond, references=refs, **options)


def with_references(args: argparse.Namespace, family: Any, parts: Any) -> Any:
    """The family sampling with ``--control_image_path``'s latents as references (itself without)."""
    import numpy as np
    import torch

    from library.data import control_images as CI

    paths = args.control_image_path or []
    if not paths:
        return family
    device, dtype = next(parts.vae.parameters()).device, next(parts.vae.parameters()).dtype
    latents = []
    for path in paths:
        img = CI.open_control(path).convert("RGB")  # musubi-tuner: RGB before resizing (handle_alpha False)
        arr = np.ascontiguousarray(CI.resize_to(img, control_size(img.size, len(paths), args.no_resize_control)))
        pixels = torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 127.5 - 1.0
        with torch.no_grad():
            latents.append(family.encode_latents(parts, pixels.to(device, dtype)).cpu())
    return WithReferences(family, latents)


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
        "video_path": "not read here",
        "image_path": "not read here",
    },
    guidance_scale=Flag(4.0, "true CFG scale of the base models (default 4.0)"),
    image_size=Flag([1024, 1024]),
    infer_steps=Flag(None, "default: klein 4, base 50 (musubi-tuner)"),
    extra_args=extra_args,
    extra_problems=lambda args, options: [
        f"--control_image_path {p}: no such file" for p in args.control_image_path or () if not Path(p).is_file()
    ],
    sampling=lambda args, family, parts: with_references(args, family, parts),
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
