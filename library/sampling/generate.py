"""Text-to-image with the diffusers pipelines, conditioned by our own prompt encoder.

The family builds the pipeline (``family.pipeline(parts, scheduler)``: StableDiffusionPipeline or
StableDiffusionXLPipeline over the same modules, no copies). Prompts are encoded here with
:func:`library.text.prompt_weighting.encode_weighted` (weighting, long prompts, clip_skip, textual inversion) and passed
as ``prompt_embeds`` / ``negative_prompt_embeds`` (+ the pooled embeddings where the pipeline takes them), so the
denoising loop, classifier-free guidance and the scheduler are diffusers' own. The pipeline returns latents and the
family's VAE decodes them (fp16 VAEs that overflow are upcast there).

The negative prompt is always encoded, also when empty (sd-scripts does the same); SDXL's pipeline would otherwise
use zeros for an empty negative prompt (``force_zeros_for_empty_prompt``).

Flow-matching families (FLUX.1, Chroma: ``family.objective(parts) == "flow_matching"``) sample with our own Euler
sampler instead (``flow_generate.py``): :func:`resolve` and :func:`generate_batch` dispatch on the objective, so the
callers (sampling during training, gen_img.py) are the same for every family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.text.prompt_weighting import encode_weighted

from .config import DEFAULT_MAX_EMBEDDINGS_MULTIPLES, DEFAULT_SAMPLE_STEPS, DEFAULT_SCALE
from .flow_generate import encode_flow_prompts, flow_texts, resolve_flow, sample_flow_latents, uses_flow_sampler
from .prompts import GUIDANCE_IGNORED_NOTE, PromptSpec
from .schedulers import make_scheduler

log = logging.getLogger(__name__)
_SEED_RANGE = 2**31
_PER_IMAGE = ("prompt", "negative_prompt", "seeds", "file_name", "index")


def random_seed() -> int:
    """A fresh seed from the OS (does not touch any RNG that training reads)."""
    return random.SystemRandom().randrange(_SEED_RANGE)


def resolve(
    spec: PromptSpec,
    family: ModelFamily,
    parts: Parts,
    *,
    sampler: str = "ddim",
    ddpm_defaults: dict[str, Any] | None = None,
    **defaults: Any,
) -> PromptSpec:
    """``spec`` with every unset setting filled: ``defaults`` first (None values are skipped), then for the DDPM
    families ``ddpm_defaults`` (a caller's own, e.g. gen_img's 50 steps), then the family's native size for the
    model's prediction type, 30 steps, scale 7.5 and ``sampler``. Embedded guidance (``--g``) is noted and dropped.

    Flow-matching families: :func:`flow_generate.resolve_flow` (20 steps, scale 1.0, guidance 3.5 where the model
    takes it, always the Euler sampler; ``sampler``, a default ``sampler`` and ``ddpm_defaults`` are not applied)."""
    size = family.default_resolution(parts.prediction_type)
    if uses_flow_sampler(family, parts):
        spec = spec.with_defaults(**{k: v for k, v in defaults.items() if v is not None and k != "sampler"})
        return resolve_flow(spec, family, parts, size=size)
    spec = spec.with_defaults(**{k: v for k, v in defaults.items() if v is not None})
    spec = spec.with_defaults(**(ddpm_defaults or {}))
    if spec.guidance is not None:
        log.info("prompt %d: %s", spec.index + 1, GUIDANCE_IGNORED_NOTE)
        spec = dataclasses.replace(spec, guidance=None)
    return spec.with_defaults(width=size, height=size, steps=DEFAULT_SAMPLE_STEPS, scale=DEFAULT_SCALE, sampler=sampler)


def same_settings(a: PromptSpec, b: PromptSpec) -> bool:
    """True when ``a`` and ``b`` can be generated in one batch (they differ at most in prompts, seeds, names)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a) if f.name not in _PER_IMAGE)


@torch.no_grad()
def generate_batch(
    family: ModelFamily,
    parts: Parts,
    specs: Sequence[PromptSpec],
    generators: Sequence[torch.Generator],
    *,
    scheduler: Any = None,
    clip_skip: int | None = None,
    max_embeddings_multiples: int = DEFAULT_MAX_EMBEDDINGS_MULTIPLES,
    normalize: str = "original",
    zero_terminal_snr: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    stage: Callable[[Sequence[Any]], contextlib.AbstractContextManager] | None = None,
    conds: Mapping[str, Any] | None = None,
) -> list[Image.Image]:
    """One image per spec; the specs must be resolved (:func:`resolve`) and share their settings
    (:func:`same_settings`); ``generators[i]`` draws image i's noise (a CPU generator gives the same image on any
    device). ``scheduler`` overrides ``make_scheduler(spec.sampler, ...)``. ``autocast``: a factory of the autocast
    context to run in (e.g. ``accelerator.autocast``).

    Flow-matching families sample with :func:`flow_generate.generate_flow_latents`' two steps (no scheduler;
    ``clip_skip``, ``max_embeddings_multiples``, ``normalize`` and ``zero_terminal_snr`` are DDPM/CLIP settings it
    does not read), in three stages that each need one part on the device: ``stage(modules)`` (e.g.
    ``devices.on_device(modules, device)``) brings the text encoders for encoding, the denoiser for denoising, the
    VAE for decoding; ``conds`` (:func:`flow_generate.encode_prompt_texts`) replaces encoding when it has every text.
    The DDPM path ignores both (the pipeline wants every part on one device)."""
    first = specs[0]
    if any(not same_settings(first, s) for s in specs[1:]):
        raise ValueError("generate_batch: the prompts of one batch must share size, steps, scale and sampler")
    autocast = autocast if autocast is not None else contextlib.nullcontext
    if uses_flow_sampler(family, parts):
        if scheduler is not None:
            raise ValueError("generate_batch: flow-matching models sample with their own Euler sampler; a diffusers "
                             "scheduler cannot be given")  # fmt: skip
        return _flow_images(family, parts, specs, generators, autocast=autocast, stage=stage, conds=conds)
    return _ddpm_images(
        family,
        parts,
        specs,
        generators,
        scheduler=scheduler,
        zero_terminal_snr=zero_terminal_snr,
        autocast=autocast,
        clip_skip=clip_skip,
        max_embeddings_multiples=max_embeddings_multiples,
        normalize=normalize,
    )


def _flow_images(
    family: ModelFamily,
    parts: Parts,
    specs: Sequence[PromptSpec],
    generators: Sequence[torch.Generator],
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    stage: Callable[[Sequence[Any]], contextlib.AbstractContextManager] | None,
    conds: Mapping[str, Any] | None,
) -> list[Image.Image]:
    """Flow matching (:func:`generate_batch`): encode, Euler-sample (``flow_generate.py``) and decode, each stage with
    its part on the device (``stage``); ``conds`` replaces encoding when it has every text."""
    stage = stage or (lambda modules: contextlib.nullcontext())
    with autocast():
        if conds is not None and all(text in conds for text in flow_texts(family, parts, specs)):
            cond = encode_flow_prompts(family, parts, specs, conds)  # no text encoder runs
        else:
            with stage(parts.text_encoders):
                cond = encode_flow_prompts(family, parts, specs)
        with stage([parts.denoiser]):
            latents = sample_flow_latents(family, parts, specs, cond, generators)
        with stage([parts.vae]):
            return to_pil(_decode(family, parts, latents))


def _ddpm_images(
    family: ModelFamily,
    parts: Parts,
    specs: Sequence[PromptSpec],
    generators: Sequence[torch.Generator],
    *,
    scheduler: Any,
    zero_terminal_snr: bool,
    autocast: Callable[[], contextlib.AbstractContextManager],
    clip_skip: int | None,
    max_embeddings_multiples: int,
    normalize: str,
) -> list[Image.Image]:
    """DDPM sampling (:func:`generate_batch`): our weighted prompt encoding, then the family's diffusers pipeline with
    ``scheduler`` (default: the specs' sampler) denoises to latents, which the family's VAE decodes. A pipeline that
    takes ``prompt_texts`` (the prompts, then the negatives) decodes itself and returns the images."""
    first = specs[0]
    scheduler = scheduler or make_scheduler(first.sampler, parts.scheduler_config, zero_terminal_snr=zero_terminal_snr)
    pipe = family.pipeline(parts, scheduler)
    pipe.set_progress_bar_config(disable=True)
    texts = [s.prompt for s in specs] + [s.negative_prompt for s in specs]
    with autocast():
        if weighted_prompts(family):
            cond = encode_weighted(
                family, parts, texts, clip_skip=clip_skip, max_embeddings_multiples=max_embeddings_multiples,
                normalize=normalize,
            )  # fmt: skip
        else:  # a T5-conditioned DDPM family (PixArt): its own encoder, prompts as written, with the padding mask
            cond = family.encode_prompt(parts, texts)
        n = len(specs)
        kwargs = _condition_kwargs(pipe, cond, n, first)
        decodes = "prompt_texts" in inspect.signature(pipe.__call__).parameters
        if decodes:  # a two-stage model whose second stage reads the texts: the pipeline returns the images
            kwargs["prompt_texts"] = texts
        latents = pipe(
            height=first.height,
            width=first.width,
            num_inference_steps=first.steps,
            guidance_scale=first.scale,
            generator=list(generators),
            output_type="pil" if decodes else "latent",
            **kwargs,
        ).images
        if decodes:
            return latents
        pixels = _decode(family, parts, latents)
    return to_pil(pixels)


def weighted_prompts(family: ModelFamily) -> bool:
    """Whether the family's prompts are CLIP prompts, encoded with A1111-style weights and 75-token chunks."""
    return all(te.layout in ("clip", "open_clip") for te in family.spec.text_encoders)


def _decode(family: ModelFamily, parts: Parts, latents: Tensor) -> Tensor:
    if not torch.isfinite(latents).all():
        log.warning("the denoised latents contain NaN/inf (fp16 overflow? try --no_half_vae or bf16); the image "
                    "will be black")  # fmt: skip
    return family.decode_latents(parts, latents)


def _condition_kwargs(pipe: Any, cond: Any, n: int, spec: PromptSpec) -> dict[str, Any]:
    """Pipeline keyword arguments for the first n rows (prompts) and the last n rows (negatives) of ``cond``."""
    params = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {
        "prompt_embeds": cond.hidden_states[:n],
        "negative_prompt_embeds": cond.hidden_states[n:],
    }
    if cond.mask is not None and "prompt_attention_mask" in params:  # T5 padding (PixArt)
        kwargs["prompt_attention_mask"] = cond.mask[:n]
        kwargs["negative_prompt_attention_mask"] = cond.mask[n:]
        kwargs["negative_prompt"] = None  # its default "" would be encoded again beside the embeddings
    if "use_resolution_binning" in params:  # PixArt: the size asked for, not the nearest trained aspect ratio
        kwargs["use_resolution_binning"] = False
    if cond.pooled is not None and "pooled_prompt_embeds" in params:
        kwargs["pooled_prompt_embeds"] = cond.pooled[:n]
        kwargs["negative_pooled_prompt_embeds"] = cond.pooled[n:]
    if "original_size" in params:  # size / crop conditioning (SDXL); (height, width) order as diffusers
        kwargs["original_size"] = (spec.original_height or spec.height, spec.original_width or spec.width)
        kwargs["crops_coords_top_left"] = (spec.crop_top or 0, spec.crop_left or 0)
        if spec.original_height_negative or spec.original_width_negative:
            kwargs["negative_original_size"] = (
                spec.original_height_negative or spec.height,
                spec.original_width_negative or spec.width,
            )
    return kwargs


def generate(
    family: ModelFamily,
    parts: Parts,
    spec: PromptSpec,
    *,
    generator: torch.Generator | None = None,
    sampler: str = "ddim",
    **options: Any,
) -> Image.Image:
    """One image for ``spec`` (unset settings resolved with :func:`resolve`). Without ``generator`` the noise comes
    from ``spec.seed`` (or a fresh random seed). ``options``: see :func:`generate_batch`."""
    spec = resolve(spec, family, parts, sampler=sampler)
    if generator is None:
        seed = spec.seed if spec.seed is not None else random_seed()
        generator = torch.Generator("cpu").manual_seed(seed)
    return generate_batch(family, parts, [spec], [generator], **options)[0]


def to_pil(pixels: Tensor) -> list[Image.Image]:
    """(B, 3, H, W) pixels in [-1, 1] -> B RGB images (rounded as diffusers' image processor rounds)."""
    array = (pixels.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in (array * 255).round().astype(np.uint8)]
