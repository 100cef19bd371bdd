"""Decoding in tiles: the low-memory VAE decode of a sampling round.

At full size a VAE's decoder holds its widest activations at the image's resolution (SDXL at 1024 px: 128-512
channels x 1024² in float32) and attends over every latent position at once; on a real card the SDXL round peaked at
7.5 GB, 2.0 GB more than the tensors the step needs, because of that decode. Decoding tiles of ``tile`` pixels
(blended over a quarter of a tile where they overlap) bounds both by the tile's size instead of the image's.

Every family's VAE is a diffusers autoencoder with ``use_tiling`` (``AutoencoderKL``: SD, SDXL, FLUX.1, SD3, Lumina;
``AutoencoderKLQwenImage``: Qwen-Image, Anima; ``AutoencoderKLHunyuanImage``), so :func:`tiled_decoding` is
family-neutral: it switches the VAE's own tiled path on for the length of a decode and sets its tile size, then puts
the VAE back as it was. A VAE without a tiled path decodes whole (said once). The tiles are decoded separately, so
the decoder's group norms see a tile's statistics rather than the image's: the image differs from the untiled decode
by a blend-smoothed amount (tests/test_vae_tiling.py bounds it), as every tiled decoder's does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_TILE = 512  # pixels: SDXL's 1024 px image in 3 x 3 overlapping tiles
_SETTINGS = ("use_tiling", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor",
             "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
             "tile_sample_stride_width")  # fmt: skip
_said: set[str] = set()


def supports_tiling(vae: Any) -> bool:
    """Whether ``vae`` has a tiled decode (diffusers' ``use_tiling`` switch with a tile size it reads)."""
    return hasattr(vae, "use_tiling") and (
        hasattr(vae, "tile_sample_min_size") or hasattr(vae, "tile_sample_min_height")
    )


@contextlib.contextmanager
def tiled_decoding(vae: Any, tile: int = DEFAULT_TILE) -> Iterator[bool]:
    """Inside: ``vae.decode`` decodes tiles of ``tile`` pixels (overlap: a quarter tile) when the image is larger
    than one tile; after: the VAE's own settings again. Yields whether tiling is on (False for a VAE without it)."""
    if not supports_tiling(vae):
        name = type(vae).__name__
        if name not in _said:
            _said.add(name)
            log.info("%s has no tiled decode: the sample decodes whole", name)
        yield False
        return
    saved = {name: getattr(vae, name) for name in _SETTINGS if hasattr(vae, name)}
    try:
        _set_tiles(vae, tile)
        yield True
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)


def _set_tiles(vae: Any, tile: int) -> None:
    vae.use_tiling = True
    if hasattr(vae, "tile_sample_min_height"):  # Qwen-Image's layout: height / width and strides in pixels
        stride = tile * 3 // 4
        vae.tile_sample_min_height = vae.tile_sample_min_width = tile
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = stride
        return
    # AutoencoderKL's / HunyuanImage's layout: square tiles in pixels and in latents (pixels / the VAE's factor)
    factor = _spatial_factor(vae)
    vae.tile_sample_min_size = tile
    vae.tile_latent_min_size = tile // factor
    vae.tile_overlap_factor = 0.25


def _spatial_factor(vae: Any) -> int:
    """Pixels per latent position: the VAE's ``spatial_compression_ratio``, else 2^(levels - 1) (AutoencoderKL)."""
    config = getattr(vae, "config", None)
    ratio = getattr(config, "spatial_compression_ratio", None) or getattr(vae, "spatial_compression_ratio", None)
    if ratio:
        return int(ratio)
    return 2 ** (len(config.block_out_channels) - 1)
