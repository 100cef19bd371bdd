"""A caching step on its own, with one encoder loaded (kohya-ss/musubi-tuner's ``*_cache_latents.py`` /
``*_cache_text_encoder_outputs.py``, which take the VAE or the text encoder alone, not the whole model).

The datasets are read as training reads them (:func:`dataset_plan`: same records, buckets, captions) and every entry
is written under the key a training run computes (:func:`library.run.setup.latent_cache_id` /
:func:`~library.run.setup.text_cache_id`), in the same store (``cache_dir``, else next to the images), so a training
run with the same dataset config, encoder files and dtypes finds every entry and encodes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from library import data
from library.data.data_args import add_dataset_args
from library.device.placement import on_device, to_device
from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.run.config import with_native_resolution
from library.run.setup import latent_cache_id, text_cache_id
from library.run.train_step import encode_captions, text_cache_entry


def dataset_plan(dataset_config: str, family: ModelFamily, *, cache_dir: str | None, vae_batch_size: int = 1,
                 control_images: bool = False) -> data.Plan:  # fmt: skip
    """The datasets of ``dataset_config`` as a training run of ``family`` reads them, with both caches on disk
    (in ``cache_dir``, else next to the images), ``vae_batch_size`` images per VAE call; ``control_images``: the
    model takes the subsets' control images (library/data/control_images.py), whose latents are cached beside the
    images'. Raises ConfigError naming every problem of the file."""
    parser = argparse.ArgumentParser(add_help=False)
    add_dataset_args(parser)
    argv = [
        "--dataset_config",
        dataset_config,
        "--cache_latents_to_disk",
        "--cache_text_encoder_outputs_to_disk",
        "--vae_batch_size",
        str(vae_batch_size),
    ]
    args = parser.parse_args(argv + (["--cache_dir", cache_dir] if cache_dir else []))
    data_args = with_native_resolution(data.DataArgs.from_args(args), family, False)
    data_args = dataclasses.replace(data_args, control_images=control_images)
    data.load_dataset_configs(data_args, size_multiple=family.size_multiple)  # every problem of the file at once
    return data.build_datasets(data_args, size_multiple=family.size_multiple)


def write_latents(plan: data.Plan, family: ModelFamily, parts: Parts, device: Any) -> data.LatentCache:
    """Every latent of ``plan`` not cached yet, encoded by ``parts.vae`` on ``device`` (training's encoding)."""
    vae_dtype = next(parts.vae.parameters()).dtype
    gen = torch.Generator().manual_seed(0)

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return family.encode_latents(parts, to_device(pixels, device, vae_dtype), gen).float().cpu()

    downscale = getattr(family, "latent_downscale", 8)
    with on_device([parts.vae], device):
        return data.cache_latents(plan, encode, latent_cache_id(family, parts.vae), downscale=downscale)


def write_text(plan: data.Plan, family: ModelFamily, parts: Parts, device: Any,
               batch_size: int | None = None) -> data.TextCache:  # fmt: skip
    """Every caption of ``plan`` not cached yet, encoded by ``parts.text_encoders`` on ``device``, ``batch_size``
    captions per call (default: the first dataset's batch size), as training encodes them with no --clip_skip,
    --max_token_length or --weighted_captions."""

    def encode_text(captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            cond = encode_captions(family, parts, captions, None, None, False, controls=controls)
        return {k: v.float().cpu() for k, v in text_cache_entry(cond).items()}

    seen = getattr(parts.options, "prompt_control_images", False)  # the edit models' prompts see the controls
    with on_device(parts.text_encoders, device):
        return data.cache_text_encoder_outputs(plan, encode_text, text_cache_id(parts, None, None, False),
                                               batch_size=batch_size, with_controls=seen)  # fmt: skip


def where(plan: data.Plan) -> str:
    """Where the plan's caches are, for the log."""
    return plan.args.cache_dir or "next to the images"
