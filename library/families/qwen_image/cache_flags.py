"""The flags of musubi-tuner's two Qwen-Image caching scripts (``qwen_image_cache_latents.py``: ``cache_latents.
setup_parser_common`` + ``hv_setup_parser`` + the model version; ``qwen_image_cache_text_encoder_outputs.py``:
``cache_text_encoder_outputs.setup_parser_common`` + ``--text_encoder --fp8_vl`` + the model version), each read or
refused with a message, and their reader :func:`read_common`.

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

from .options import MODEL_VERSIONS, NOT_DONE_VERSIONS


def _common(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("musubi-tuner's caching flags")
    g.add_argument("--dataset_config", type=str, required=True,
                   help="musubi-tuner's (or sd-scripts') dataset TOML; the caches go to its cache_directory, else "
                   "next to the images")  # fmt: skip
    g.add_argument("--device", type=str, default=None, help="the device to encode on (default cuda if available)")
    g.add_argument("--batch_size", type=int, default=None, help="items per encoder call")
    add_no_effect(g, "--num_workers", "images are read in this process", type=int, default=None)
    add_no_effect(g, "--skip_existing", "an entry is never encoded twice here (its key is its content)",
                  action="store_true")  # fmt: skip
    add_no_effect(g, "--keep_cache", "entries of images no longer in the dataset are never deleted here",
                  action="store_true")  # fmt: skip
    g.add_argument("--edit", action="store_true", help="musubi-tuner's --model_version edit")
    g.add_argument("--edit_plus", action="store_true", help="musubi-tuner's --model_version edit-2509")
    g.add_argument("--model_version", type=str, default=None, help="original (default)")
    return g


def latents_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = _common(parser)
    g.add_argument("--vae", type=str, default=None, help="the Qwen-Image VAE (diffusers or ComfyUI names)")
    add_unsupported(g, "--vae_dtype", "musubi-tuner refuses it for Qwen-Image too; the VAE runs in bfloat16",
                    type=str, default=None)  # fmt: skip
    add_unsupported(g, "--debug_mode", "musubi-tuner's dataset viewer is not done here", type=str, default=None)
    for flag, kind in (("--console_width", {"type": int, "default": 80}), ("--console_back", {"type": str}),
                       ("--console_num_images", {"type": int})):  # fmt: skip
        add_no_effect(g, flag, "a setting of --debug_mode", **({"default": None} | kind))
    g.add_argument("--disable_cudnn_backend", action="store_true", help="torch.backends.cudnn off while encoding")
    for flag, kind in (("--vae_tiling", {"action": "store_true"}), ("--vae_chunk_size", {"type": int}),
                       ("--vae_spatial_tile_sample_min_size", {"type": int})):  # fmt: skip
        add_no_effect(g, flag, "musubi-tuner's Qwen-Image caching does not read it either", **kind)
    return parser


def text_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = _common(parser)
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
    problems = []
    if getattr(args, model_flag.lstrip("-")) is None:
        problems.append(f"{model_flag} is required: the file to encode with (musubi-tuner requires it too)")
    version = (args.model_version or ("edit-2509" if args.edit_plus else "edit" if args.edit else "original")).lower()
    if version not in MODEL_VERSIONS:
        problems.append(f"--model_version {version}: unknown; one of {', '.join(MODEL_VERSIONS)}")
    elif version in NOT_DONE_VERSIONS:
        problems.append(f"--model_version {version} is not supported yet ({NOT_DONE_VERSIONS[version]} are not done); "
                        "cache for the original Qwen-Image with --model_version original")  # fmt: skip
    if args.batch_size is not None and args.batch_size < 1:
        problems.append(f"--batch_size {args.batch_size}: must be >= 1")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        problems.append(f"--device {args.device}: {e}")
        device = torch.device("cpu")
    if problems:
        raise ConfigError(problems)
    if getattr(args, "disable_cudnn_backend", False):
        torch.backends.cudnn.enabled = False
    return CacheFlags(version, device, args.batch_size)
