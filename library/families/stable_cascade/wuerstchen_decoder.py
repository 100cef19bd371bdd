"""Würstchen 2's images: the prior's latents (``sampling.sample_stage_c`` with the Würstchen family) through the
user's decoder, a diffusers ``WuerstchenDecoderPipeline`` folder (warp-ai/wuerstchen: ``decoder/``
``WuerstchenDiffNeXt``, ``vqgan/`` ``PaellaVQModel``, ``text_encoder/`` + ``tokenizer/`` CLIP-H, ``scheduler/``
``DDPMWuerstchenScheduler``), as diffusers' ``WuerstchenCombinedPipeline`` does: the prior's ``x · 42 − 1`` are the
decoder's ``image_embeddings``, the prompt goes to the decoder as text (its own CLIP-H), and the generator that drew
the prior's noise draws the decoder's next (so a seed gives the combined pipeline's image).

During training (``--decoder``): the shared DDPM sampling path (``library/sampling/generate.py``) asks the family for
a pipeline; :class:`WuerstchenPipeline` is that pipeline (this sampler on the prompts the shared path encoded, the
prompt texts for the decoder) and returns the images. The prompt line's ``--s`` / ``--l`` / ``--n`` are the prior's
steps, guidance and negative prompt (the negative reaches the decoder too, read only when its guidance is above 1);
the decoder's steps and guidance are ``--decoder_steps`` (12) and ``--decoder_guidance_scale`` (0), the combined
pipeline's defaults.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base import Cond
from ..loading import _tf_dtype
from .sampling import latent_shape, sample_stage_c

PIPELINE = "WuerstchenDecoderPipeline"
DECODER_STEPS, DECODER_GUIDANCE = 12, 0.0  # WuerstchenCombinedPipeline's defaults
LATENT_MEAN, LATENT_STD = 42.0, 1.0  # the prior pipeline's image embeddings: latents * 42 - 1
# each part of the folder: its config file, and the weight files of which one must be there
PARTS = {
    "decoder": ("config.json", ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                                "diffusion_pytorch_model.safetensors.index.json")),
    "vqgan": ("config.json", ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")),
    "text_encoder": ("config.json", ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")),
    "tokenizer": ("tokenizer_config.json", ()),
    "scheduler": ("scheduler_config.json", ()),
}  # fmt: skip


def decoder_problems(folder: str | Path) -> list[str]:
    """What ``--decoder`` lacks to be read (empty: it loads): the model index naming ``WuerstchenDecoderPipeline``
    and each part's config and weights."""
    folder = Path(folder)
    layout = "decoder/, vqgan/, text_encoder/, tokenizer/, scheduler/ and model_index.json, as warp-ai/wuerstchen"
    if not folder.is_dir():
        return [f"--decoder {folder}: no such folder (give a diffusers WuerstchenDecoderPipeline folder: {layout})"]
    index = folder / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    if name != PIPELINE:
        what = f"its model_index.json names {name}" if index.is_file() else "it has no model_index.json"
        return [f"--decoder {folder}: not a diffusers {PIPELINE} folder ({what}; give one with {layout})"]
    missing = []
    for part, (config, weights) in PARTS.items():
        if not (folder / part / config).is_file():
            missing.append(f"{part}/{config}")
        if weights and not any((folder / part / w).is_file() for w in weights):
            missing.append(f"{part}/{weights[0]}")
    if missing:
        return [f"--decoder {folder}: the {PIPELINE} folder lacks {', '.join(missing)} (its layout: {layout})"]
    return []


def size_problems(folder: str | Path, sizes: Sequence[tuple[str, int]]) -> list[str]:
    """The image sides (``(where, pixels)``) the folder's decoder cannot make: the prior's latents
    (``ceil(side / 42.67)``) times ``latent_dim_scale``, truncated, must halve at each decoder level after its
    patching (16 for the released decoder: 1024 px -> 24 -> 256); each problem names the nearest sides that work."""
    root = Path(folder)
    config = json.loads((root / "decoder" / "config.json").read_text())
    scale = float(json.loads((root / "model_index.json").read_text()).get("latent_dim_scale", 10.67))
    multiple = int(config.get("patch_size", 2)) * 2 ** (len(config.get("c_hidden", [0] * 4)) - 1)

    def fits(side: int) -> bool:
        return int(latent_shape(1, side, side)[2] * scale) % multiple == 0

    problems = []
    for where, side in sizes:
        if not fits(side):
            near = [s for s in (*range(side - 8, 63, -8), *range(side + 8, 4 * side, 8)) if fits(s)]
            fix = f"; try {min(near, key=lambda s: (abs(s - side), s))}" if near else ""
            problems.append(f"{where} {side}: --decoder {folder} cannot decode that size (its latents, "
                            f"int({latent_shape(1, side, side)[2]} x {scale}), must be a multiple of {multiple}){fix}")  # fmt: skip
    return problems


@functools.lru_cache(maxsize=1)
def load_decoder(folder: str, dtype: torch.dtype = torch.float32) -> Any:
    """The folder's ``WuerstchenDecoderPipeline`` on the CPU (one kept: training samples with it every round), built
    from its parts: diffusers 0.42 keeps ``WuerstchenDiffNeXt`` and ``PaellaVQModel`` among its deprecated
    pipelines, not at the top level its ``model_index.json`` names, so ``from_pretrained`` on the folder fails."""
    from diffusers import DDPMWuerstchenScheduler, WuerstchenDecoderPipeline
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt
    from transformers import CLIPTextModel, CLIPTokenizer

    problems = decoder_problems(folder)
    if problems:
        raise ValueError(problems[0])
    root = Path(folder)
    index = json.loads((root / "model_index.json").read_text())
    pipe = WuerstchenDecoderPipeline(
        tokenizer=CLIPTokenizer.from_pretrained(str(root / "tokenizer")),
        text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder", **_tf_dtype(dtype)),
        decoder=WuerstchenDiffNeXt.from_pretrained(root / "decoder", torch_dtype=dtype),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(root / "scheduler"),
        vqgan=PaellaVQModel.from_pretrained(root / "vqgan", torch_dtype=dtype),
        latent_dim_scale=float(index.get("latent_dim_scale", 10.67)),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def decode(decoder: Any, latents: torch.Tensor, prompt: str, negative: str, *, steps: int = DECODER_STEPS,
           guidance: float = DECODER_GUIDANCE, generator: torch.Generator | None = None,
           device: Any = "cpu") -> list[Any]:  # fmt: skip
    """PIL images of the prior's latents (B, 16, h, w) through the decoder pipeline (moved to ``device`` for the
    call and back to the CPU after), the prompt and negative prompt given as text."""
    n = latents.shape[0]
    decoder.to(device)
    try:
        embeddings = latents.to(device, decoder.decoder.dtype) * LATENT_MEAN - LATENT_STD
        return decoder(image_embeddings=embeddings, prompt=[prompt] * n, negative_prompt=[negative] * n,
                       num_inference_steps=steps, guidance_scale=guidance, generator=generator,
                       output_type="pil").images  # fmt: skip
    finally:
        decoder.to("cpu")


class WuerstchenPipeline:
    """The pipeline the shared DDPM sampler calls with ``--decoder``: the prior sampled on the encoded prompts
    (``sample_stage_c``), then each image decoded with the prompt texts (``prompt_texts``: the prompts, then the
    negatives), each image from its own generator (batch 1, as the samples and gen_img draw one seed per image)."""

    def __init__(self, family: Any, prior: nn.Module, decoder: str, steps: int, guidance: float) -> None:
        self.family, self.prior = family, prior
        self.decoder, self.steps, self.guidance = decoder, steps, guidance

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        pass

    def __call__(self, *, height: int, width: int, num_inference_steps: int, guidance_scale: float,
                 generator: list[torch.Generator], prompt_embeds: torch.Tensor,
                 negative_prompt_embeds: torch.Tensor, prompt_texts: Sequence[str], output_type: str = "pil",
                 **unused: Any) -> Any:  # fmt: skip
        from types import SimpleNamespace

        if output_type != "pil":
            raise ValueError("Würstchen 2 samples are decoded to images by its decoder (output_type 'pil')")
        problems = size_problems(self.decoder, [("--w", width), ("--h", height)])
        if problems:
            raise ValueError("; ".join(problems))
        n = len(generator)
        device = next(self.prior.parameters()).device
        dtype = next(self.prior.parameters()).dtype  # the prior's (fp32 under fp8 base weights)
        pipe = load_decoder(str(self.decoder), dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
        images = []
        for i, gen in enumerate(generator):
            cond, uncond = Cond(prompt_embeds[i : i + 1]), Cond(negative_prompt_embeds[i : i + 1])
            latents = sample_stage_c(self.family, self.prior, cond, uncond, latent_shape(1, height, width),
                                     steps=num_inference_steps, guidance=guidance_scale, generator=gen)  # fmt: skip
            images += decode(pipe, latents, prompt_texts[i], prompt_texts[n + i], steps=self.steps,
                             guidance=self.guidance, generator=gen, device=device)  # fmt: skip
        return SimpleNamespace(images=images)


def write_tiny_decoder(folder: str | Path, seed: int = 0) -> Path:
    """A tiny ``WuerstchenDecoderPipeline`` folder (tests, trying the samples offline): a two-level
    ``WuerstchenDiffNeXt`` reading the 16-channel prior latents and the shared tiny CLIP-L as its text model, a
    two-level ``PaellaVQModel``, the released ``latent_dim_scale`` 10.67 (so the prior's latents need an even
    ``int(10.67 · side)``: 3 or 6, images of 128 or 256 px; 2 gives 21, which the two levels cannot halve). The
    weights diffusers initialises to zero (the output head, the VQGAN's block gains) are drawn too, so the image
    follows its inputs."""
    from diffusers import DDPMWuerstchenScheduler, WuerstchenDecoderPipeline
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt

    from ..encoders import clip
    from ..tokenizers import PAD_OPEN_CLIP, load_clip_tokenizer

    torch.manual_seed(seed)
    decoder = WuerstchenDiffNeXt(c_in=4, c_out=4, c_r=8, patch_size=1, c_cond=32, c_hidden=[16, 32], nhead=[-1, 2],
                                 blocks=[1, 1], level_config=["CT", "CTA"], inject_effnet=[False, True],
                                 effnet_embd=16, clip_embd=clip.TINY_CLIP_L["hidden_size"], dropout=0.0)  # fmt: skip
    vqgan = PaellaVQModel(levels=2, bottleneck_blocks=1, embed_dim=16, latent_channels=4, num_vq_embeddings=8)
    with torch.no_grad():
        for p in (*decoder.parameters(), *vqgan.parameters()):
            if p.abs().sum() == 0:
                p.normal_(0, 0.1)
    encoder = clip.factory(dict(clip.TINY_COMMON, **clip.TINY_CLIP_L))()
    pipe = WuerstchenDecoderPipeline(tokenizer=load_clip_tokenizer(PAD_OPEN_CLIP), text_encoder=encoder,
                                     decoder=decoder, scheduler=DDPMWuerstchenScheduler(), vqgan=vqgan)  # fmt: skip
    pipe.save_pretrained(folder)
    return Path(folder)


def sample_size_problems(folder: str | Path, prompts: str | Path | None) -> list[str]:
    """Before training: the prompts of ``--sample_prompts`` whose size the decoder cannot make (unset sides: the
    family's 1024); an unreadable file is left to the sampling checks."""
    from library.cli.problems import ConfigError
    from library.sampling.prompts import read_prompt_file

    try:
        specs = read_prompt_file(prompts) if prompts else []
    except (FileNotFoundError, ConfigError):
        return []
    sizes = [(f"--sample_prompts {prompts}: prompt {s.index + 1}: {flag}", side or 1024) for s in specs
             for flag, side in (("--w", s.width), ("--h", s.height))]  # fmt: skip
    return size_problems(folder, sizes)
