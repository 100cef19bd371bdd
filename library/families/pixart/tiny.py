"""Tiny PixArt-α / PixArt-Σ models with the real module structure and random weights (tests, demo,
``tools/make_tiny_model.py --family pixart_sigma``).

A ``PixArtTransformer2DModel`` of width 24 (2 heads of 12; a multiple of 3: the micro-condition embedders take a third each), 2 blocks, 8 output channels (ε and the variance), caption
width 32 (the shared tiny T5's), with the micro-conditions for α; the shared tiny T5 (``encoders.t5.TINY_T5``, the
bundled T5 tokenizer); a 4-channel ``AutoencoderKL`` (8× down, the SD layout, the variant's scaling factor as its released config).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from library.families.protocol import ModelFamily

from ..base import Parts
from ..encoders import t5
from .model import ALPHA, SCHEDULER, TIED_T5, VAE_SCALE, transformer_factory

TRANSFORMER = dict(
    num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=8, num_layers=2, dropout=0.0,
    norm_num_groups=32, cross_attention_dim=24, attention_bias=True, sample_size=128, patch_size=2,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, upcast_attention=False, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, caption_channels=32,
    use_additional_conditions=False,
)  # fmt: skip
VAE = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 16, 16, 16], layers_per_block=1,
    latent_channels=4, norm_num_groups=8, sample_size=64,
)  # fmt: skip


def part_configs(variant: str) -> dict[str, Any]:
    return {"transformer": dict(TRANSFORMER, use_additional_conditions=variant == ALPHA), "vae": dict(VAE, scaling_factor=VAE_SCALE[variant]),
            "text_encoder": dict(t5.TINY_T5)}  # fmt: skip


def build_tiny_pixart(variant: str, seed: int = 0, layers: int | None = None) -> Parts:
    """A tiny ``variant`` model (fp32, CPU, eval, frozen) with deterministic weights; ``layers`` blocks instead of 2."""
    from diffusers import AutoencoderKL

    configs = part_configs(variant)
    torch.manual_seed(seed)
    denoiser = transformer_factory(dict(configs["transformer"], **({"num_layers": layers} if layers else {})))()
    for p in denoiser.parameters():  # zero-initialised weights random too, so the tests see every path
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.1)
    vae = AutoencoderKL(**configs["vae"])
    encoder = t5.factory(configs["text_encoder"])()
    for module in (denoiser, vae, encoder):
        module.eval().requires_grad_(False)
    return Parts(denoiser, vae, [encoder], [t5.load_t5_tokenizer()], dict(SCHEDULER), variant, f"tiny-{variant}")


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pixart_layers", type=int, default=2, metavar="N", help="PixArt transformer blocks (default 2)"
    )


class PixArtTiny:
    """The tiny model (``ModelFamily.tiny``; see ``protocol.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, layers: int | None = None) -> Parts:
        return build_tiny_pixart(self.family.name, seed, layers)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """``--t5xxl`` (transformers names) and ``--vae`` (diffusers names) beside the official transformer file."""
        from library.files.weights import save_state_dict

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        encoder = {k: v for k, v in parts.text_encoders[0].state_dict().items() if k != TIED_T5}
        files = {"t5xxl": encoder, "vae": parts.vae.state_dict()}
        return {part: save_state_dict(dict(state), out / f"{name}_{part}.safetensors", {}, None)
                for part, state in files.items()}  # fmt: skip

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"layers": args.pixart_layers}

    def part_configs(self) -> dict[str, Any]:
        return part_configs(self.family.name)
