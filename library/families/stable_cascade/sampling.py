"""Stage C sampling: the reverse of the continuous cosine DDPM (``objective.alpha_cumprod``) on the ratios
``linspace(1, 0, steps + 1)``, classifier-free guidance as ``lerp(uncond, cond, scale)``, the ancestral noise of each
step drawn from the generator (``DDPMWuerstchenScheduler.step``'s law and draw order, so a seed gives the
``StableCascadePriorPipeline``'s latents); then the user's stage B / A (a diffusers ``StableCascadeDecoderPipeline``
folder) turn the stage C latents into an image.

During training (``--previewer_checkpoint_path``, as the stable-cascade branch): the shared DDPM sampling path asks
the family for a pipeline and decodes its latents; :class:`StageCPipeline` is that pipeline (this sampler on the
prompts the shared path encoded) and the family decodes with the Previewer (``previewer.py``).

Latent size: ``ceil(side / 42.67)`` (the released resolution multiple: 24 x 24 at 1024 px).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..base import Cond, Parts
from .objective import alpha_cumprod

RESOLUTION_MULTIPLE = 42.67


def latent_shape(batch: int, height: int, width: int, channels: int = 16) -> tuple[int, int, int, int]:
    return (batch, channels, math.ceil(height / RESOLUTION_MULTIPLE), math.ceil(width / RESOLUTION_MULTIPLE))


def sample_stage_c(family: Any, prior: nn.Module, cond: Cond, uncond: Cond | None, shape: tuple[int, ...], *,
                   steps: int, guidance: float, generator: torch.Generator) -> Tensor:  # fmt: skip
    """Stage C latents (B, 16, h, w) from noise: ``steps`` reverse steps, CFG when ``guidance > 1`` (``uncond``: the
    negative prompt's conditioning)."""
    device = next(prior.parameters()).device
    dtype = next(prior.parameters()).dtype
    latents = torch.randn(shape, generator=generator, dtype=dtype).to(device)
    ratios = torch.linspace(1.0, 0.0, steps + 1)
    guided = guidance > 1 and uncond is not None
    pooled = None if cond.pooled is None or not guided else torch.cat([cond.pooled, uncond.pooled])  # Würstchen: none
    both = Cond(torch.cat([cond.hidden_states, uncond.hidden_states]), pooled) if guided else cond
    for i in range(steps):
        t, prev = ratios[i : i + 1], ratios[i + 1 : i + 2]
        with torch.no_grad():
            if guided:
                out = family.predict(prior, torch.cat([latents, latents]), t.expand(2 * shape[0]), both)
                text, empty = out.chunk(2)
                eps = torch.lerp(empty, text, guidance)
            else:
                eps = family.predict(prior, latents, t.expand(shape[0]), cond)
        a_t, a_prev = alpha_cumprod(t).to(device), alpha_cumprod(prev).to(device)
        alpha = a_t / a_prev
        mu = (1.0 / alpha).sqrt() * (latents - (1 - alpha) * eps / (1 - a_t).sqrt())
        noise = torch.randn(shape, generator=generator, dtype=eps.dtype).to(device)
        std = ((1 - alpha) * (1 - a_prev) / (1 - a_t)).sqrt() * noise
        latents = (mu + std * float(prev.item() != 0)).to(dtype)
    return latents


def decode_with_stage_b(decoder: str | Path, latents: Tensor, prompt: str, negative: str, *, steps: int = 10,
                        guidance: float = 0.0, generator: torch.Generator | None = None, device: Any = "cpu") -> Any:  # fmt: skip
    """PIL images from stage C latents through a diffusers ``StableCascadeDecoderPipeline`` folder (stage B and the
    stage A VQGAN, as stabilityai/stable-cascade ships them)."""

    folder = Path(decoder)
    if not (folder / "model_index.json").is_file():
        raise ValueError(f"--decoder {folder}: not a diffusers StableCascadeDecoderPipeline folder (decoder/, vqgan/, "
                         "text_encoder/, tokenizer/, scheduler/ and model_index.json, as stabilityai/stable-cascade)")  # fmt: skip
    pipe = decoder_pipeline(folder).to(device)
    pipe.set_progress_bar_config(disable=True)
    dtype = pipe.decoder.dtype
    return pipe(image_embeddings=latents.to(device, dtype), prompt=[prompt] * latents.shape[0],
                negative_prompt=[negative] * latents.shape[0] if negative else None, num_inference_steps=steps,
                guidance_scale=guidance, generator=generator, output_type="pil").images  # fmt: skip


def decoder_pipeline(folder: Path) -> Any:
    """The folder's ``StableCascadeDecoderPipeline``, built from its parts: diffusers 0.42 keeps stage A's
    ``PaellaVQModel`` among its deprecated pipelines, not at the top level its ``model_index.json`` names, so
    ``from_pretrained`` on the folder fails."""
    import json

    from diffusers import DDPMWuerstchenScheduler, StableCascadeDecoderPipeline, StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    index = json.loads((folder / "model_index.json").read_text())
    return StableCascadeDecoderPipeline(
        decoder=StableCascadeUNet.from_pretrained(folder / "decoder"),
        tokenizer=CLIPTokenizer.from_pretrained(str(folder / "tokenizer")),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder"),
        scheduler=DDPMWuerstchenScheduler.from_pretrained(folder / "scheduler"),
        vqgan=PaellaVQModel.from_pretrained(folder / "vqgan"),
        latent_dim_scale=float(index.get("latent_dim_scale", 10.67)),
    )


def encode_pair(family: Any, parts: Parts, prompt: str, negative: str, batch: int) -> tuple[Cond, Cond]:
    cond = family.encode_prompt(parts, [prompt] * batch)
    uncond = family.encode_prompt(parts, [negative] * batch)
    return cond, uncond


class StageCPipeline:
    """The pipeline the shared samplers (``library/sampling/generate.py``) call, over stage C: ``__call__`` takes
    the encoded prompts and returns ``.images`` = stage C latents of :func:`sample_stage_c`, each image from its own
    generator (batch 1, as gen_img draws one seed per image)."""

    def __init__(self, family: Any, prior: nn.Module) -> None:
        self.family, self.prior = family, prior

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        pass

    def __call__(self, *, height: int, width: int, num_inference_steps: int, guidance_scale: float,
                 generator: list[torch.Generator], prompt_embeds: Tensor, negative_prompt_embeds: Tensor,
                 pooled_prompt_embeds: Tensor, negative_pooled_prompt_embeds: Tensor, output_type: str = "latent",
                 **unused: Any) -> Any:  # fmt: skip
        from types import SimpleNamespace

        latents = []
        for i, gen in enumerate(generator):
            cond = Cond(prompt_embeds[i : i + 1], pooled_prompt_embeds[i : i + 1])
            uncond = Cond(negative_prompt_embeds[i : i + 1], negative_pooled_prompt_embeds[i : i + 1])
            latents.append(sample_stage_c(self.family, self.prior, cond, uncond, latent_shape(1, height, width),
                                          steps=num_inference_steps, guidance=guidance_scale, generator=gen))  # fmt: skip
        return SimpleNamespace(images=torch.cat(latents))
