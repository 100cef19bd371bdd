"""Tiny SD1 / SD2 (v-prediction) / SDXL models with the real module structure and random weights.

Same block layout, module names and component classes as the released models (4-level SD UNet with 3 cross-attention
levels, SD2's linear projections, SDXL's 3-level UNet with text_time embeddings and two text encoders); only widths
are tiny and transformer depth is reduced where the real model repeats the same block. The tokenizers are the real
CLIP tokenizers (see tokenizers.py), so prompts tokenize exactly as with the released models.

Used by the tests, the demo and ``tools/make_tiny_model.py``. Building a model takes well under a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..base import Parts
from ..encoders import clip
from ..tokenizers import PAD_CLIP_L, PAD_OPEN_CLIP, load_clip_tokenizer, write_clip_tokenizer

NAMES = ("sd1", "sd2", "sdxl")

# The noise schedule of every released SD model (scaled_linear betas, 1000 steps).
SCHEDULE = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    timestep_spacing="leading",
)

_CLIP_COMMON = clip.TINY_COMMON  # the shared tiny CLIP (encoders/clip.py)

_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 16, 16, 16],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=64,
)

TINY = {
    "sd1": dict(
        unet=dict(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
            block_out_channels=[16, 16, 32, 32],
            layers_per_block=2,
            attention_head_dim=2,
            cross_attention_dim=32,
            norm_num_groups=8,
        ),
        text_encoders=[dict(clip.TINY_CLIP_L)],
        pads=[PAD_CLIP_L],
        vae=dict(_VAE, scaling_factor=0.18215),
        prediction_type="epsilon",
    ),
    "sd2": dict(
        unet=dict(
            sample_size=12,
            in_channels=4,
            out_channels=4,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
            block_out_channels=[16, 16, 32, 32],
            layers_per_block=2,
            attention_head_dim=[2, 4, 4, 4],
            cross_attention_dim=32,
            use_linear_projection=True,
            norm_num_groups=8,
        ),
        text_encoders=[dict(hidden_size=32, intermediate_size=64, projection_dim=32, hidden_act="gelu")],
        pads=[PAD_OPEN_CLIP],
        vae=dict(_VAE, scaling_factor=0.18215),
        prediction_type="v_prediction",
    ),
    "sdxl": dict(
        unet=dict(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            block_out_channels=[16, 32, 32],
            layers_per_block=2,
            transformer_layers_per_block=[1, 2, 2],
            attention_head_dim=[2, 4, 4],
            cross_attention_dim=80,  # TE1 hidden + TE2 hidden, as 768 + 1280 = 2048 in the real model
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 48,  # 6 size/crop ids * time dim + pooled TE2 width
            norm_num_groups=8,
        ),
        # TE2 is wider than TE1, as bigG (1280) is wider than CLIP-L (768): diffusers' single-file loader tells the two
        # encoders apart by width
        text_encoders=[dict(clip.TINY_CLIP_L), dict(clip.TINY_CLIP_G)],
        pads=[PAD_CLIP_L, PAD_OPEN_CLIP],
        vae=dict(_VAE, scaling_factor=0.13025, force_upcast=True),
        prediction_type="epsilon",
    ),
}


def build_tiny(family: str, seed: int = 0) -> Parts:
    """Build a tiny model of ``family`` ("sd1", "sd2" or "sdxl") with deterministic random weights (fp32, CPU)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if family not in TINY:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(NAMES)}")
    spec = TINY[family]
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**spec["unet"])
    vae = AutoencoderKL(**spec["vae"])
    text_encoders = []
    for i, te in enumerate(spec["text_encoders"]):
        config = CLIPTextConfig(**_CLIP_COMMON, **te)
        # SDXL's second encoder carries the text projection used for the pooled output.
        cls = CLIPTextModelWithProjection if (family == "sdxl" and i == 1) else CLIPTextModel
        text_encoders.append(cls(config))
    # SD2's (OpenCLIP) and SDXL TE2's pad token is "!"; the vocabulary is CLIP's in all cases.
    for te, pad in zip(text_encoders, spec["pads"]):
        te.config.pad_token_id = 0 if pad == PAD_OPEN_CLIP else 49407
    tokenizers = [load_clip_tokenizer(pad) for pad in spec["pads"]]
    for module in (unet, vae, *text_encoders):
        module.eval().requires_grad_(False)
    scheduler_config = dict(SCHEDULE, prediction_type=spec["prediction_type"])
    return Parts(unet, vae, text_encoders, tokenizers, scheduler_config, family=family, source=f"tiny-{family}")


def save_diffusers(parts: Parts, folder: str | Path) -> Path:
    """Write ``parts`` as a diffusers pipeline folder (model_index.json + component folders)."""
    from diffusers import (
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )

    folder = Path(folder)
    if len(parts.text_encoders) == 2:
        pipe = StableDiffusionXLPipeline(
            vae=parts.vae,
            text_encoder=parts.text_encoders[0],
            text_encoder_2=parts.text_encoders[1],
            tokenizer=parts.tokenizers[0],
            tokenizer_2=parts.tokenizers[1],
            unet=parts.denoiser,
            scheduler=EulerDiscreteScheduler.from_config(_scheduler_kwargs(parts.scheduler_config)),
        )
    else:
        pipe = StableDiffusionPipeline(
            vae=parts.vae,
            text_encoder=parts.text_encoders[0],
            tokenizer=parts.tokenizers[0],
            unet=parts.denoiser,
            scheduler=DDIMScheduler.from_config(_scheduler_kwargs(parts.scheduler_config)),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(folder, safe_serialization=True)
    # the tokenizers in the layout of the released SD folders (vocab.json, merges.txt, configs) instead of
    # transformers 5's tokenizer.json: the same CLIP vocabulary, read in 0.06 s instead of 0.3 s by every run
    for i, tokenizer in enumerate(parts.tokenizers):
        sub = folder / ("tokenizer" if i == 0 else f"tokenizer_{i + 1}")
        (sub / "tokenizer.json").unlink()
        write_clip_tokenizer(sub, tokenizer.pad_token)
    return folder


def _scheduler_kwargs(config: dict) -> dict:
    keys = (
        "num_train_timesteps",
        "beta_start",
        "beta_end",
        "beta_schedule",
        "prediction_type",
        "clip_sample",
        "set_alpha_to_one",
        "steps_offset",
        "timestep_spacing",
    )
    return {k: config[k] for k in keys if k in config}


class SDTiny:
    """The tiny model of one SD family (``ModelFamily.tiny``; see ``base.TinyModel``)."""

    by_default = True  # tools/make_tiny_model.py writes the SD families when --family is not given

    def __init__(self, name: str) -> None:
        self.name = name

    def build(self, seed: int = 0) -> Parts:
        """:func:`build_tiny` of the family."""
        return build_tiny(self.name, seed)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        """A diffusers folder written by diffusers' own pipeline (:func:`save_diffusers`)."""
        return save_diffusers(parts, folder)

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """Nothing: the single file holds the whole model."""
        return {}

    def add_tool_args(self, parser: argparse.ArgumentParser) -> None:
        """No flags of its own."""

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}
