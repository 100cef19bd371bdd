"""A tiny Stable Cascade stage C with the real module structure and random weights (tests, demo,
``tools/make_tiny_model.py --family stable_cascade``): a ``StableCascadeUNet`` prior of width 32 (2 levels of one
res / timestep / attention block each, 2 heads, the released conditioning layout: 16 latent channels, text width 48,
the 768-wide image embedding, 4 pooled tokens, ``sca`` / ``crp`` timestep conditions, dropout 0.1), the shared tiny
CLIP-G with projection, and an EfficientNet encoder with the V2-S stage kinds at tiny widths (``effnet.tiny_stages``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from library.families.protocol import ModelFamily

from ..base import Parts
from ..encoders import clip
from ..tokenizers import PAD_OPEN_CLIP, load_clip_tokenizer
from .effnet import EfficientNetEncoder, tiny_stages
from .model import BLOCKS, PRIOR_COMMON, SCHEDULER, prior_factory

TINY_HEAD = 32


def part_configs(levels: int = 2) -> dict[str, Any]:
    prior = dict(PRIOR_COMMON, conditioning_dim=32, block_out_channels=[32] * levels, num_attention_heads=[2] * levels,
                 down_num_layers_per_block=[1] * levels, up_num_layers_per_block=[1] * levels,
                 down_blocks_repeat_mappers=[1] * levels, up_blocks_repeat_mappers=[1] * levels,
                 block_types_per_layer=[BLOCKS] * levels, dropout=[0.1] * levels, switch_level=[False] * (levels - 1),
                 clip_text_in_channels=48, clip_text_pooled_in_channels=48)  # fmt: skip
    return {"prior": prior, "text_encoder": dict(clip.TINY_COMMON, **clip.TINY_CLIP_G)}


def build_tiny_cascade(seed: int = 0, levels: int = 2) -> Parts:
    """A tiny stage C model (fp32, CPU, eval, frozen) with deterministic weights."""
    configs = part_configs(levels)
    torch.manual_seed(seed)
    prior = prior_factory(configs["prior"])()
    for p in prior.parameters():  # zero-initialised weights (the output conv) random too, so tests see every path
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.1)
    encoder = clip.factory(configs["text_encoder"], with_projection=True)()
    effnet = EfficientNetEncoder(16, tiny_stages(), TINY_HEAD)
    with torch.no_grad():  # running statistics that are not the identity, as a trained encoder's
        for m in effnet.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    for module in (prior, effnet, encoder):
        module.eval().requires_grad_(False)
    tokenizer = load_clip_tokenizer(PAD_OPEN_CLIP)
    return Parts(prior, effnet, [encoder], [tokenizer], dict(SCHEDULER), "stable_cascade", "tiny-stable_cascade",
                 text_encoder_extras=[{}])  # fmt: skip


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cascade_levels", type=int, default=2, metavar="N", help="stage C levels (default 2)")


class CascadeTiny:
    """The tiny model (``ModelFamily.tiny``; see ``protocol.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, levels: int = 2) -> Parts:
        return build_tiny_cascade(seed, levels)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """``--text_model_checkpoint_path`` (transformers names), ``--effnet_checkpoint_path`` and
        ``--previewer_checkpoint_path`` (:func:`tiny_previewer_state`) beside stage C."""
        from library.files.weights import save_state_dict

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        files = {"text_model": parts.text_encoders[0].state_dict(), "effnet": parts.vae.state_dict(),
                 "previewer": tiny_previewer_state()}  # fmt: skip
        return {part: save_state_dict(dict(state), out / f"{name}_{part}.safetensors", {}, None)
                for part, state in files.items()}  # fmt: skip

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"levels": args.cascade_levels}

    def part_configs(self) -> dict[str, Any]:
        return part_configs()


def tiny_previewer_state(seed: int = 3) -> dict[str, Any]:
    """A width-8 Previewer (``previewer.py``) whose image follows its input: convolutions scaled up (the default init
    shrinks the signal to nothing over its 8 layers), hidden biases zero, the output around 0.5, BatchNorm statistics
    drawn."""
    from .previewer import Previewer

    torch.manual_seed(seed)
    state = Previewer(c_hidden=8).state_dict()
    for k, v in state.items():
        if k.endswith("running_var"):
            state[k] = torch.rand_like(v) * 0.2 + 0.9
        elif k.endswith("running_mean"):
            state[k] = torch.randn_like(v) * 0.05
        elif v.dim() == 4:
            state[k] = v * (0.3 if k == "blocks.24.weight" else 3.0)
        elif k.endswith("bias") and v.dim() == 1 and not k.startswith("blocks.24"):
            state[k] = torch.zeros_like(v)
    state["blocks.24.bias"] = torch.full_like(state["blocks.24.bias"], 0.5)
    return state
