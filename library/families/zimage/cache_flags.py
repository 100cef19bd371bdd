"""The flags of musubi-tuner's two Z-Image caching scripts (``zimage_cache_latents.py``: ``cache_latents.
setup_parser_common``; ``zimage_cache_text_encoder_outputs.py``: ``cache_text_encoder_outputs.setup_parser_common`` +
``--text_encoder --fp8_llm``), each read or refused with a message; the shared ones: library/run/cache_flags.py.

Z-Image's own: ``--vae_dtype`` (the AE's dtype, as training's ``--vae_dtype``; default bfloat16, the AE's dtype in a
``--mixed_precision bf16`` run: musubi-tuner encodes in float32 whatever is given, here the flag is read so that a
training run with the same ``--vae_dtype`` finds every entry), ``--fp8_llm`` (Qwen3's Linear weights in float8,
computed in bfloat16, as training's ``--fp8_llm``: give it to both, the text cache keys include it).
"""

from __future__ import annotations

import argparse

from library.run import cache_flags


def latents_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.latents_group(parser, "the FLUX.1 AE Z-Image uses (BFL's ae.safetensors or diffusers names)")
    g.add_argument("--vae_dtype", type=str, default=None,
                   help="the AE's dtype (default bfloat16: a --mixed_precision bf16 training run's; give training "
                   "the same --vae_dtype)")  # fmt: skip
    return parser


def text_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = cache_flags.common_group(parser)
    g.add_argument("--text_encoder", type=str, required=True, help="Qwen3-4B (one file, split file or folder)")
    g.add_argument("--fp8_llm", action="store_true",
                   help="Qwen3's Linear weights in float8, computed in bfloat16 (give it to training too: the cache "
                   "keys include the encoder's storage)")  # fmt: skip
    return parser
