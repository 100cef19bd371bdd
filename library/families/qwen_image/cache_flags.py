"""The flags of musubi-tuner's two Qwen-Image caching scripts (``qwen_image_cache_latents.py``: ``cache_latents.
setup_parser_common`` + ``hv_setup_parser`` + the model version; ``qwen_image_cache_text_encoder_outputs.py``:
``cache_text_encoder_outputs.setup_parser_common`` + ``--text_encoder --fp8_vl`` + the model version), each read or
refused with a message, and their reader :func:`read_common`; the flags every caching script shares:
library/run/cache_flags.py.

Read: ``--dataset_config``, ``--vae`` / ``--text_encoder``, ``--device`` (default cuda when there is one),
``--batch_size`` (images per VAE call, default 1 as training's ``--vae_batch_size``; captions per Qwen2.5-VL call,
default the dataset's batch size), ``--disable_cudnn_backend``, ``--model_version`` / ``--edit`` / ``--edit_plus``
(``original``; the others are refused as by the training scripts). Accepted with no effect, said in the log:
``--num_workers`` (images are read in this process), ``--skip_existing`` (an entry is never encoded twice: its key is
its content), ``--keep_cache`` (entries of images no longer in the dataset are never deleted here), the debug
console's settings, and the VAE tiling flags (musubi-tuner's Qwen-Image script parses them and reads none).
``--fp8_vl``: Qwen2.5-VL in float8 (as training's ``--fp8_vl``; a training run without it computes other keys and
encodes again). Refused: ``--debug_mode`` and ``--vae_dtype`` (musubi-tuner refuses it for Qwen-Image too: the VAE runs in bfloat16).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from library.cli.parse import add_no_effect, add_unsupported
from library.cli.problems import ConfigError
from library.run import cache_flags

from .options import MODEL_VERSIONS, NOT_DONE_VERSIONS


def _versions(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--edit", action="store_true", help="musubi-tuner's --model_version edit")
    g.add_argument("--edit_plus", action="store_true", help="musubi-tuner's --model_version edit-2509")
    g.add_argument("--model_version", type=str, default=None, help="original (default)")


def latents_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.latents_group(parser, "the Qwen-Image VAE (diffusers or ComfyUI names)")
    _versions(g)
    add_unsupported(g, "--vae_dtype", "musubi-tuner refuses it for Qwen-Image too; the VAE runs in bfloat16",
                    type=str, default=None)  # fmt: skip
    for flag, kind in (("--vae_tiling", {"action": "store_true"}), ("--vae_chunk_size", {"type": int}),
                       ("--vae_spatial_tile_sample_min_size", {"type": int})):  # fmt: skip
        add_no_effect(g, flag, "musubi-tuner's Qwen-Image caching does not read it either", **kind)
    return parser


def text_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.common_group(parser)
    _versions(g)
    g.add_argument("--text_encoder", type=str, required=True, help="Qwen2.5-VL-7B (one file, split file or folder)")
    g.add_argument("--fp8_vl", action="store_true",
                   help="Qwen2.5-VL's Linear weights in float8, computed in bfloat16 (give it to training too: the "
                   "cache keys include the encoder's storage)")  # fmt: skip
    return parser


@dataclass(frozen=True)
class CacheFlags:
    """What both scripts read: the model version, the device and the batch size."""

    model_version: str
    device: torch.device
    batch_size: int | None


def read_common(args: argparse.Namespace, model_flag: str) -> CacheFlags:
    """The common flags (module docstring); ConfigError lists every problem, each naming its flag. ``model_flag``:
    the encoder's flag, which must be given."""
    problems: list[str] = []
    version = (args.model_version or ("edit-2509" if args.edit_plus else "edit" if args.edit else "original")).lower()
    if version not in MODEL_VERSIONS:
        problems.append(f"--model_version {version}: unknown; one of {', '.join(MODEL_VERSIONS)}")
    elif version in NOT_DONE_VERSIONS:
        problems.append(f"--model_version {version} is not supported yet ({NOT_DONE_VERSIONS[version]} are not done); "
                        "cache for the original Qwen-Image with --model_version original")  # fmt: skip
    common = cache_flags.read_common(args, model_flag, problems)
    if problems:
        raise ConfigError(problems)
    return CacheFlags(version, common.device, common.batch_size)
