"""Tiny SD3-medium / SD3.5-medium / SD3.5-large models with the real module structure and random weights (tests,
the demo, ``tools/make_tiny_model.py``).

The transformer is an ``SD3Transformer2DModel`` of width 32 (4 heads of 8), patch 2, 16 latent channels, context
width 80 and pooled width 80; the variants differ as the releases do: SD3 has no q/k norm, SD3.5-medium has RMS q/k
norms and a second attention in block 0 (``dual_attention_layers``) and a larger ``pos_embed`` (as 384 vs 192),
SD3.5-large has q/k norms only and 34 blocks by default (sd-scripts' docs line ``--blocks_to_swap=32`` keeps 2 blocks
on the device). The text encoders are the SD tiny CLIP-L (hidden 32) and the SDXL tiny CLIP-G (hidden 48), both
``CLIPTextModelWithProjection``, and FLUX's tiny T5 widened to 80 = 32 + 48 (SD3 pads CLIP-L ‖ CLIP-G to T5's
width, 768 + 1280 ≤ 4096 in the real model); the VAE is FLUX's tiny 16-channel AE with SD3's scale and shift.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch

from library.families.protocol import ModelFamily

from ..autoencoders import flux_ae
from ..base import Parts
from ..encoders import clip, t5
from ..encoders.t5 import load_t5_tokenizer
from ..tokenizers import PAD_CLIP_L, PAD_OPEN_CLIP, load_clip_tokenizer
from .configs import SCALE, SHIFT, VARIANTS, scheduler_config
from .keys import SD3, SD35_LARGE, SD35_MEDIUM

CONTEXT = 80  # CLIP-L 32 + CLIP-G 48 (padded to T5's width) = the T5 width
TRANSFORMER = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=8,
                   num_attention_heads=4, joint_attention_dim=CONTEXT, caption_projection_dim=32,
                   pooled_projection_dim=80, pos_embed_max_size=32)  # fmt: skip
VARIANT_CONFIG = {
    SD3: dict(num_layers=2, dual_attention_layers=(), qk_norm=None),
    SD35_MEDIUM: dict(num_layers=2, dual_attention_layers=(0,), qk_norm="rms_norm", pos_embed_max_size=64),
    SD35_LARGE: dict(num_layers=34, dual_attention_layers=(), qk_norm="rms_norm"),
}
# the shared tiny AE (with SD3's scale and shift), CLIP-L, CLIP-G and T5 (as wide as CLIP-L ‖ CLIP-G)
AE = dict(flux_ae.TINY_AE, scaling_factor=SCALE, shift_factor=SHIFT)
CLIP_L = dict(clip.TINY_COMMON, pad_token_id=clip.PAD_ID_CLIP_L, **clip.TINY_CLIP_L)
CLIP_G = dict(clip.TINY_COMMON, pad_token_id=clip.PAD_ID_OPEN_CLIP, **clip.TINY_CLIP_G)
T5 = dict(t5.TINY_T5, d_model=CONTEXT)


def transformer_config(variant: str = SD3, blocks: int | None = None) -> dict:
    """The tiny transformer config of ``variant``; ``blocks``: the number of joint blocks instead of the default."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown SD3 variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    config = dict(TRANSFORMER, **VARIANT_CONFIG[variant])
    if blocks is not None:
        if blocks < 1:
            raise ValueError(f"blocks={blocks}: an SD3 transformer needs at least one block")
        config["num_layers"] = blocks
    return config


def tiny_transformer(variant: str = SD3, blocks: int | None = None) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**transformer_config(variant, blocks))


def tiny_text_encoders() -> list[torch.nn.Module]:
    """[CLIP-L, CLIP-G (both with projection), T5]."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clips = [CLIPTextModelWithProjection(CLIPTextConfig(**config)) for config in (CLIP_L, CLIP_G)]
    return [*clips, T5EncoderModel(T5Config(**T5))]


def build_tiny_sd3(variant: str = SD3, seed: int = 0, blocks: int | None = None) -> Parts:
    """A tiny SD3 / SD3.5 model (fp32, CPU, eval mode, frozen) with deterministic weights; ``text_encoders``:
    [CLIP-L, CLIP-G, T5], ``tokenizers`` likewise; ``blocks``: joint blocks instead of the variant's default."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    denoiser = tiny_transformer(variant, blocks)
    vae = AutoencoderKL(**AE)
    encoders = tiny_text_encoders()
    tokenizers = [load_clip_tokenizer(PAD_CLIP_L), load_clip_tokenizer(PAD_OPEN_CLIP), load_t5_tokenizer()]
    for module in (denoiser, vae, *encoders):
        module.eval().requires_grad_(False)
    return Parts(denoiser, vae, encoders, tokenizers, copy.deepcopy(scheduler_config(variant)), family=variant,
                 source=f"tiny-{variant}")  # fmt: skip


def write_tiny_files(
    parts: Parts,
    folder: str | Path,
    *,
    prefix: str = "model.diffusion_model.",
    text_encoders: bool = True,
    fp8: bool = False,
    diffusers: bool = True,
) -> dict[str, Path]:
    """Write ``parts`` as the files SD3 users have, without any metadata: ``model`` (the SAI single file: the
    transformer under ``prefix``, the VAE under ``first_stage_model.`` (LDM names) and, with ``text_encoders``, the
    encoders under ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``; ``fp8``: the transformer in
    float8_e4m3fn), the separate ``clip_l`` / ``clip_g`` / ``t5xxl`` files (transformers names, as ComfyUI and
    sd-scripts take them) and ``vae`` (LDM names), plus, with ``diffusers``, ``diffusers`` (a
    ``StableDiffusion3Pipeline`` folder written by diffusers itself). Returns ``{"model" | "clip_l" | "clip_g" | "t5xxl" | "vae" | "diffusers": path}``."""
    from safetensors.torch import save_file

    from ..convert import vae_to_ldm
    from .keys import diffusers_to_sai
    from .saving import pipeline_of, text_encoder_state

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sai = diffusers_to_sai(parts.denoiser.state_dict(), prefix=prefix)
    if fp8:
        sai = {k: v.to(torch.float8_e4m3fn) for k, v in sai.items()}
    vae = vae_to_ldm(parts.vae.state_dict(), parts.vae.config)
    tes = [text_encoder_state(te) for te in parts.text_encoders]
    model = dict(sai, **{f"first_stage_model.{k}": v for k, v in vae.items()})
    if text_encoders:
        for name, state in zip(("clip_l", "clip_g", "t5xxl"), tes):
            model.update({f"text_encoders.{name}.transformer.{k}": v for k, v in state.items()})
    files = {"model": (folder / "model.safetensors", model), "vae": (folder / "vae.safetensors", vae)}
    for name, state in zip(("clip_l", "clip_g", "t5xxl"), tes):
        files[name] = (folder / f"{name}.safetensors", state)
    for path, state in files.values():
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    out = {name: path for name, (path, _) in files.items()}
    if diffusers:
        pipeline_of(parts).save_pretrained(folder / "diffusers")
        out["diffusers"] = folder / "diffusers"
    return out


# joint blocks of the tiny SD3 models tools/make_tiny_model.py writes (None: the variant's tiny default, 34 for
# sd3.5-large): the fewest that sd-scripts' documented command lines accept (docs/fine_tune.md's sd3_train.py
# --blocks_to_swap 10)
CLI_BLOCKS = {SD3: 12, SD35_MEDIUM: 12}


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """``tools/make_tiny_model.py``'s ``--sd3_blocks N`` (shared by the three variants)."""
    parser.add_argument(
        "--sd3_blocks",
        type=int,
        default=None,
        metavar="N",
        help="SD3 / SD3.5 joint blocks (default: 12, enough for sd-scripts' documented sd3_train.py "
        "--blocks_to_swap 10; 34 for sd3.5-large, enough for its sd3_train_network.py --blocks_to_swap 32; swapping "
        "keeps 2 blocks on the device)",
    )


class SD3Tiny:
    """The tiny model of one variant (``ModelFamily.tiny``; see ``base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Parts:
        """:func:`build_tiny_sd3` of the family's variant."""
        return build_tiny_sd3(self.family.name, seed, blocks)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """The SAI file without encoders (``<name>_dit``: transformer and VAE, as ``sd3.5_large.safetensors``) and
        sd-scripts' ``--clip_l --clip_g --t5xxl --vae`` files."""
        out = Path(out)
        written = {"dit": Path(self.family.save(parts, out / f"{name}_dit.safetensors", text_encoders=False))}
        tmp = out / f".{name}_parts"
        for part, path in write_tiny_files(parts, tmp, diffusers=False).items():
            if part in ("clip_l", "clip_g", "t5xxl", "vae"):
                written[part] = path.replace(out / f"{name}_{part}.safetensors")
        (tmp / "model.safetensors").unlink()
        tmp.rmdir()
        return written

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"blocks": args.sd3_blocks or CLI_BLOCKS.get(self.family.name)}

    def part_configs(self) -> dict[str, Any]:
        """The tiny parts' configs (``{"transformer", "vae", "text_encoders"}``), which the loader falls back on for
        files written without configs (:func:`write_tiny_files`)."""
        return {"transformer": dict(TRANSFORMER), "vae": dict(AE),
                "text_encoders": [dict(CLIP_L), dict(CLIP_G), dict(T5)]}  # fmt: skip
