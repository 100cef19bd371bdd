"""The low-memory decode of sampling rounds (library/sampling/vae_tiling.py, ``--sample_vae_tiling``): the VAE decodes
tiles, the image equals the whole decode within the tolerance tiles allow, the VAE is left as it was, and the rule of
``auto`` follows the low-memory flags.

Oracle: the untiled decode of the same latents. The tiles are decoded separately (their group norms see the tile,
not the image), so the two differ near seams; on these tiny random-weight VAEs by 0.02-0.035 on the [-1, 1] scale
on average, a fifth to a tenth of what two different latents' images differ by (the bounds below).
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch

from library.families import get_family
from library.sampling import SampleConfig, sample_during_training
from library.sampling.config import tiled_vae
from library.sampling.vae_tiling import _spatial_factor, supports_tiling, tiled_decoding


def _decoder_inputs(vae) -> list[tuple[int, ...]]:
    shapes = []
    vae.decoder.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape[-2:])))
    return shapes


# (family, image px, tile px, tiles, bound on the mean error as a fraction of how much two latents' images differ)
CASES = [("sdxl", 512, 256, 9, 1 / 8), ("qwen_image", 160, 128, 4, 1 / 4), ("hunyuan_image", 256, 128, 9, None)]


@pytest.mark.parametrize(("name", "size", "tile", "tiles", "bound"), CASES)
def test_tiled_decode_equals_the_whole_decode_within_tolerance(name, size, tile, tiles, bound, tiny_parts):
    """HunyuanImage's tiny VAE (32x compression: 4-latent tiles here) is only checked for its tiles and its settings:
    with random weights its tiles differ from the whole decode by a quarter of the image's spread (a trained VAE's
    features are local; this one's receptive field spans the tile)."""
    family = get_family(name)
    parts = copy.copy(tiny_parts["sdxl"]) if name == "sdxl" else family.tiny.build()
    parts.vae = vae = copy.deepcopy(parts.vae)
    assert supports_tiling(vae)
    factor = _spatial_factor(vae)
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    g = torch.Generator().manual_seed(0)
    latents, other = torch.randn(2, 1, channels, size // factor, size // factor, generator=g)
    shapes = _decoder_inputs(vae)
    with torch.no_grad():
        whole, unrelated = family.decode_latents(parts, latents), family.decode_latents(parts, other)
        assert len(shapes) == 2 and shapes[0] == (size // factor,) * 2
        shapes.clear()
        with tiled_decoding(vae, tile) as on:
            tiled = family.decode_latents(parts, latents)
        assert on and len(shapes) == tiles and max(shapes) == (tile // factor,) * 2
        again = family.decode_latents(parts, latents)  # the VAE's own settings are back: whole again
    assert torch.equal(again, whole) and not vae.use_tiling
    assert tiled.shape == whole.shape == (1, 3, size, size)
    if bound is not None:
        error, spread = (tiled - whole).abs(), (unrelated - whole).abs().mean()
        assert error.mean() < 0.035 and error.mean() < spread * bound and error.max() < 0.75


def test_a_vae_without_tiles_decodes_whole():
    vae = torch.nn.Conv2d(4, 3, 1)
    with tiled_decoding(vae) as on:
        assert not on


def _args(**flags) -> argparse.Namespace:
    base = dict(sample_every_n_steps=1, sample_every_n_epochs=None, sample_at_first=False, sample_prompts=None,
                sample_sampler="ddim", sample_vae_tiling="auto")  # fmt: skip
    return argparse.Namespace(**{**base, **flags})


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, False),
    ({"gradient_checkpointing": True}, False),  # checkpointing alone: the VAE still encodes each step
    ({"gradient_checkpointing": True, "cache_latents": True}, True),
    ({"gradient_checkpointing": True, "cache_latents_to_disk": True}, True),
    ({"fp8_base": True}, True),
    ({"fp8_base_unet": True}, True),
    ({"blocks_to_swap": 4}, True),
    ({"blocks_to_swap": 0}, False),
    ({"cpu_offload_checkpointing": True}, True),
    ({"fp8_base": True, "sample_vae_tiling": "off"}, False),
    ({"sample_vae_tiling": "on"}, True),
])  # fmt: skip
def test_auto_rule_and_switch(flags, expected, tmp_path):
    assert tiled_vae(_args(**flags)) is expected
    prompts = tmp_path / "p.txt"
    prompts.write_text("x\n")
    assert SampleConfig.from_args(_args(sample_prompts=str(prompts), **flags)).tiled_vae is expected


def test_a_sampling_round_decodes_in_tiles_and_leaves_the_vae_as_it_was(tiny_parts, tmp_path):
    """544 px (latents 68 x 68) in the default 512 px tiles: 2 x 2 tiles of up to 64 latents."""
    from PIL import Image

    family, parts = get_family("sdxl"), copy.deepcopy(tiny_parts["sdxl"])
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat --w 544 --h 544 --s 1 --d 3\n")
    shapes = _decoder_inputs(parts.vae)
    images = {}
    for tiled in (False, True):
        cfg = SampleConfig(prompts, every_n_steps=1, tiled_vae=tiled)
        paths = sample_during_training(cfg, family, parts, output_dir=tmp_path / str(tiled), output_name=None, step=1)
        images[tiled] = np.asarray(Image.open(paths[0]), dtype=np.float32) / 127.5
    assert shapes == [(68, 68)] + [(64, 64), (64, 20), (20, 64), (20, 20)]
    assert not parts.vae.use_tiling and parts.vae.tile_sample_min_size == tiny_parts["sdxl"].vae.tile_sample_min_size
    error = np.abs(images[True] - images[False])
    assert error.mean() < 0.035 and error.max() < 0.75
