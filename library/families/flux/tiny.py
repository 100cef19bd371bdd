"""Tiny FLUX.1 dev / schnell and Chroma models with the real module structure and random weights (tests, demo).

The configs are DIT_FAMILIES.md §4's: a ``FluxTransformer2DModel`` / ``ChromaTransformer2DModel`` of width 32 (2
heads of 16, rope axes 4+6+6), 2 double and 2 single blocks; the 16-channel ``AutoencoderKL`` without quant convs
(scale 0.3611, shift 0.1159, as the released AE); the project's tiny CLIP-L (hidden 32 = the transformer's pooled
width) and a 2-layer ``T5EncoderModel`` (d_model 32 = the transformer's context width) with T5's real vocabulary
size, so the shipped T5 tokenizer's ids fit. Building one takes well under a second.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..base import Parts
from ..tiny import _CLIP_COMMON, _VAE, TINY
from ..tokenizers import PAD_CLIP_L, load_clip_tokenizer
from .configs import scheduler_config
from .text import load_t5_tokenizer

VARIANTS = ("flux-dev", "flux-schnell", "chroma")

TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
CHROMA_EXTRA = dict(approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2)
# the SD tiny models' AE and CLIP-L (library/families/tiny.py), with FLUX's 16 latent channels, shift and one ResNet
# per level, and no quant convs
AE = dict(_VAE, layers_per_block=1, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
          use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
CLIP_L = dict(_CLIP_COMMON, pad_token_id=49407, **TINY["sd1"]["text_encoders"][0])
T5 = dict(
    vocab_size=32128,
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    pad_token_id=0,
    eos_token_id=1,
)


def tiny_transformer(variant: str = "flux-dev", blocks: tuple[int, int] | None = None) -> torch.nn.Module:
    """The tiny denoiser of ``variant`` ("flux-dev" | "flux-schnell" | "chroma"), random weights; ``blocks``:
    (double, single) block counts instead of the tests' 2 + 2 (sd-scripts' ``--blocks_to_swap N`` needs
    N // 2 + 2 double and 2 (N - N // 2) + 2 single blocks)."""
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    config = dict(TRANSFORMER)
    if blocks is not None:
        config.update(num_layers=blocks[0], num_single_layers=blocks[1])
    if variant == "chroma":
        return ChromaTransformer2DModel(**config, **CHROMA_EXTRA)  # (diffusers' warning: flux/__init__.py)
    if variant not in VARIANTS:
        raise ValueError(f"unknown FLUX variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    return FluxTransformer2DModel(**config, pooled_projection_dim=32, guidance_embeds=variant == "flux-dev")


def tiny_ae() -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(**AE)


def tiny_clip_l() -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**CLIP_L))


def tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**T5))


def build_tiny_flux(variant: str = "flux-dev", seed: int = 0, blocks: tuple[int, int] | None = None) -> Parts:
    """A tiny FLUX.1 dev / schnell or Chroma model (fp32, CPU, eval mode, frozen) with deterministic weights.
    ``text_encoders``: [CLIP-L, T5] (Chroma: [T5]), ``tokenizers`` likewise; ``blocks``: see :func:`tiny_transformer`."""
    torch.manual_seed(seed)
    denoiser = tiny_transformer(variant, blocks)
    vae = tiny_ae()
    encoders = ([] if variant == "chroma" else [tiny_clip_l()]) + [tiny_t5()]
    tokenizers = ([] if variant == "chroma" else [load_clip_tokenizer(PAD_CLIP_L)]) + [load_t5_tokenizer()]
    for module in (denoiser, vae, *encoders):
        module.eval().requires_grad_(False)
    return Parts(denoiser, vae, encoders, tokenizers, copy.deepcopy(scheduler_config(variant)), family=variant,
                 source=f"tiny-{variant}")  # fmt: skip


def write_tiny_files(
    parts: Parts,
    folder: str | Path,
    *,
    prefix: str = "",
    fp8: bool = False,
    clip_prefixed: bool = True,
    t5_encoder_only: bool = False,
    ae_ldm: bool = True,
) -> dict[str, Path]:
    """Write ``parts`` as the single files sd-scripts' FLUX scripts take, without any metadata: ``model`` (the BFL
    transformer, keys under ``prefix``, e.g. ``model.diffusion_model.``; ``fp8``: float8_e4m3fn tensors), ``clip_l``
    (transformers names, with ``text_model.`` unless ``clip_prefixed`` is False; not for Chroma), ``t5xxl``
    (``shared.weight`` + ``encoder.*``, or ``encoder.*`` only) and ``ae`` (BFL/LDM names, or diffusers names).
    Returns ``{"model" | "clip_l" | "t5xxl" | "ae": path}`` (the names of sd-scripts' flags)."""
    from safetensors.torch import save_file

    from ..convert import hf_state_dict, vae_to_ldm
    from .keys import diffusers_to_bfl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bfl = diffusers_to_bfl(parts.denoiser.state_dict(), prefix=prefix)
    if fp8:
        bfl = {k: v.to(torch.float8_e4m3fn) for k, v in bfl.items()}
    vae = parts.vae
    ae = vae_to_ldm(vae.state_dict(), vae.config) if ae_ldm else dict(vae.state_dict())
    t5 = {k: v.clone() for k, v in parts.text_encoders[-1].state_dict().items()}  # untie shared / embed_tokens
    if t5_encoder_only:
        del t5["shared.weight"]
    files = {"model": (folder / "model.safetensors", bfl), "t5xxl": (folder / "t5xxl.safetensors", t5),
             "ae": (folder / "ae.safetensors", ae)}  # fmt: skip
    if len(parts.text_encoders) == 2:
        clip = hf_state_dict(parts.text_encoders[0])
        if not clip_prefixed:
            clip = {k.removeprefix("text_model."): v for k, v in clip.items()}
        files["clip_l"] = (folder / "clip_l.safetensors", clip)
    for path, state in files.values():
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    return {name: path for name, (path, _) in files.items()}
