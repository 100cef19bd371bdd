"""Tiny FLUX.1 dev / schnell and Chroma models with the real module structure and random weights (tests, demo).

The configs are DIT_FAMILIES.md §4's: a ``FluxTransformer2DModel`` / ``ChromaTransformer2DModel`` of width 32 (2
heads of 16, rope axes 4+6+6), 2 double and 2 single blocks; the 16-channel ``AutoencoderKL`` without quant convs
(scale 0.3611, shift 0.1159, as the released AE); the project's tiny CLIP-L (hidden 32 = the transformer's pooled
width) and a 2-layer ``T5EncoderModel`` (d_model 32 = the transformer's context width) with T5's real vocabulary
size, so the shipped T5 tokenizer's ids fit. Building one takes well under a second.
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
from ..tokenizers import PAD_CLIP_L, load_clip_tokenizer
from .configs import scheduler_config

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
# the shared tiny AE (16 latent channels, FLUX.1's scale and shift, no quant convs), CLIP-L and T5
AE = dict(flux_ae.TINY_AE)
CLIP_L = dict(clip.TINY_COMMON, pad_token_id=clip.PAD_ID_CLIP_L, **clip.TINY_CLIP_L)
T5 = dict(t5.TINY_T5)


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
    t5_state = {k: v.clone() for k, v in parts.text_encoders[-1].state_dict().items()}  # untie shared / embed_tokens
    if t5_encoder_only:
        del t5_state["shared.weight"]
    files = {"model": (folder / "model.safetensors", bfl), "t5xxl": (folder / "t5xxl.safetensors", t5_state),
             "ae": (folder / "ae.safetensors", ae)}  # fmt: skip
    if len(parts.text_encoders) == 2:
        clip_state = hf_state_dict(parts.text_encoders[0])
        if not clip_prefixed:
            clip_state = {k.removeprefix("text_model."): v for k, v in clip_state.items()}
        files["clip_l"] = (folder / "clip_l.safetensors", clip_state)
    for path, state in files.values():
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    return {name: path for name, (path, _) in files.items()}


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """``tools/make_tiny_model.py``'s ``--flux_blocks DOUBLE SINGLE`` (shared by the three variants)."""
    parser.add_argument(
        "--flux_blocks",
        type=int,
        nargs=2,
        default=[11, 20],
        metavar=("DOUBLE", "SINGLE"),
        help="FLUX / Chroma double and single blocks (default 11 20: enough for sd-scripts' "
        "documented --blocks_to_swap 18, which keeps 2 blocks of each kind on the device)",
    )


class FluxTiny:
    """The tiny model of one variant (``ModelFamily.tiny``; see ``base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: tuple[int, int] | None = None) -> Parts:
        """:func:`build_tiny_flux` of the family's variant."""
        return build_tiny_flux(self.family.name, seed, blocks)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """sd-scripts' ``--clip_l`` (not Chroma), ``--t5xxl`` and ``--ae`` files beside the BFL transformer."""
        out = Path(out)
        tmp = out / f".{name}_parts"
        written = {part: path.replace(out / f"{name}_{part}.safetensors")
                   for part, path in write_tiny_files(parts, tmp).items() if part != "model"}  # fmt: skip
        (tmp / "model.safetensors").unlink()
        tmp.rmdir()
        return written

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"blocks": tuple(args.flux_blocks)}

    def part_configs(self) -> dict[str, Any]:
        """The tiny parts' configs (``{"transformer", "vae", "text_encoders"}``, as the released configs are laid
        out), which the loader tries for files written without configs (:func:`write_tiny_files`)."""
        chroma = self.family.name == "chroma"
        transformer = dict(TRANSFORMER, **(CHROMA_EXTRA if chroma else {"pooled_projection_dim": 32}))
        encoders = ([] if chroma else [dict(CLIP_L)]) + [dict(T5)]
        return {"transformer": transformer, "vae": dict(AE), "text_encoders": encoders}
