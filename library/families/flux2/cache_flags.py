"""The flags of musubi-tuner's two FLUX.2 caching scripts (``flux_2_cache_latents.py``: ``cache_latents.
setup_parser_common`` + ``--model_version``; ``flux_2_cache_text_encoder_outputs.py``: ``cache_text_encoder_outputs.
setup_parser_common`` + ``--text_encoder --fp8_text_encoder --model_version``), each read or refused with a message,
and their reader :func:`read_version`; the shared ones: library/run/cache_flags.py.

FLUX.2's own: ``--model_version`` (dev, klein-4b, klein-base-4b, klein-9b, klein-base-9b; musubi-tuner's default dev):
the text encoder it names (Mistral 3 for dev, Qwen3-4B / -8B for klein) and its template; the AE is the same for all.
``--vae_dtype`` (the AE's dtype, as training's ``--vae_dtype``; default bfloat16, the AE's dtype in a
``--mixed_precision bf16`` run, where musubi-tuner's default is float32: give training the same ``--vae_dtype``).
``--fp8_text_encoder``: the text encoder's Linear weights in float8, computed in bfloat16 (training's ``--fp8_base
--fp8_text_encoder`` stores it alike; with ``--fp8_scaled`` too it is stored scaled, other keys, so that run encodes
again).
"""

from __future__ import annotations

import argparse

from library.run import cache_flags

from .options import MODEL_VERSIONS


def _version(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model_version", type=str, default="dev",
                   help=f"one of {', '.join(MODEL_VERSIONS)} (musubi-tuner's default: dev)")  # fmt: skip


def latents_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.latents_group(parser, "FLUX.2's AE (BFL's ae.safetensors or diffusers names)")
    _version(g)
    g.add_argument("--vae_dtype", type=str, default=None,
                   help="the AE's dtype (default bfloat16: a --mixed_precision bf16 training run's; give training "
                   "the same --vae_dtype)")  # fmt: skip
    return parser


def text_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.common_group(parser)
    _version(g)
    g.add_argument("--text_encoder", type=str, required=True,
                   help="Mistral 3 (dev) or Qwen3-4B / -8B (klein): one file, the first of a split set, or a folder")  # fmt: skip
    g.add_argument("--fp8_text_encoder", action="store_true",
                   help="the text encoder's Linear weights in float8, computed in bfloat16 (training: --fp8_base "
                   "--fp8_text_encoder)")  # fmt: skip
    return parser


def read_version(args: argparse.Namespace, problems: list[str]) -> str:
    """``--model_version`` lower-cased; an unknown one is appended to ``problems``."""
    version = (args.model_version or "dev").lower()
    if version not in MODEL_VERSIONS:
        problems.append(f"--model_version {version}: unknown; one of {', '.join(MODEL_VERSIONS)}")
    return version
