"""The flags every one of musubi-tuner's separate caching scripts shares (``cache_latents.setup_parser_common`` and
``cache_text_encoder_outputs.setup_parser_common``), each read or refused with a message, and their reader
:func:`read_common`. A family's caching flags (its model version, its encoder's precision) live in its folder and
are added beside these.

Read: ``--dataset_config``, ``--device`` (default cuda when there is one), ``--batch_size`` (images per VAE call,
default 1 as training's ``--vae_batch_size``; captions per text-encoder call, default the dataset's batch size),
``--disable_cudnn_backend`` (latents). Accepted with no effect, said in the log: ``--num_workers`` (images are read in
this process), ``--skip_existing`` (an entry is never encoded twice: its key is its content), ``--keep_cache``
(entries of images no longer in the dataset are never deleted here) and the debug console's settings. Refused:
``--debug_mode`` (musubi-tuner's dataset viewer).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from library.cli.parse import add_no_effect, add_unsupported


def common_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``cache_text_encoder_outputs.setup_parser_common``'s flags; returns their group for the family's."""
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
    return g


def latents_group(parser: argparse.ArgumentParser, vae_help: str) -> argparse._ArgumentGroup:
    """``cache_latents.setup_parser_common``'s flags but ``--vae_dtype`` (each family reads or refuses it)."""
    g = common_group(parser)
    g.add_argument("--vae", type=str, default=None, help=vae_help)
    add_unsupported(g, "--debug_mode", "musubi-tuner's dataset viewer is not done here", type=str, default=None)
    for flag, kind in (("--console_width", {"type": int, "default": 80}), ("--console_back", {"type": str}),
                       ("--console_num_images", {"type": int})):  # fmt: skip
        add_no_effect(g, flag, "a setting of --debug_mode", **({"default": None} | kind))
    g.add_argument("--disable_cudnn_backend", action="store_true", help="torch.backends.cudnn off while encoding")
    return g


@dataclass(frozen=True)
class CommonFlags:
    """What every caching script reads: the device and the batch size."""

    device: torch.device
    batch_size: int | None


def read_common(args: argparse.Namespace, model_flag: str, problems: list[str]) -> CommonFlags:
    """The common flags (module docstring); each problem, naming its flag, is appended to ``problems`` (the caller
    raises them with its own). ``model_flag``: the encoder's flag, which must be given."""
    if getattr(args, model_flag.lstrip("-")) is None:
        problems.append(f"{model_flag} is required: the file to encode with (musubi-tuner requires it too)")
    if args.batch_size is not None and args.batch_size < 1:
        problems.append(f"--batch_size {args.batch_size}: must be >= 1")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        problems.append(f"--device {args.device}: {e}")
        device = torch.device("cpu")
    if not problems and getattr(args, "disable_cudnn_backend", False):
        torch.backends.cudnn.enabled = False
    return CommonFlags(device, args.batch_size)


VAE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip


def vae_dtype(name: str | None, problems: list[str]) -> torch.dtype:
    """``--vae_dtype`` where a family reads it (the VAE's storage and compute dtype, as the training scripts' flag);
    default bfloat16, the VAE's dtype in a ``--mixed_precision bf16`` training run (the cache keys include it)."""
    if name is None:
        return torch.bfloat16
    if name not in VAE_DTYPES:
        problems.append(f"--vae_dtype {name}: one of float32, float16, bfloat16")
        return torch.bfloat16
    return VAE_DTYPES[name]
