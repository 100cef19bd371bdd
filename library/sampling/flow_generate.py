"""Text-to-image for flow-matching families (FLUX.1 dev / schnell, Chroma, SD3 / SD3.5) with the Euler sampler of
``flow.py``.

Which sampler a family gets is read from the family, never from its name: a family whose ``objective(parts)`` is
"flow_matching" samples here (:func:`uses_flow_sampler`), with the settings of its ``flow_sampling(parts)``
(embedded guidance, schedule shift, noise layout, default steps and CFG scale); every other family samples with
diffusers' schedulers (``generate.py``).
``generate.generate_batch`` and ``generate.resolve`` dispatch on it, so sampling during training
(``training.py``) and gen_img.py need no other change.

Prompt options, as sd-scripts' ``flux_train_utils.sample_image_inference`` (and ``sd3_train_utils``') reads them:

=========  ===========================================================================================
option     meaning for flow matching
=========  ===========================================================================================
``--s``    steps, default ``FlowSampling.default_steps`` (FLUX 20, :data:`DEFAULT_FLOW_STEPS`; SD3 30)
``--g``    embedded guidance, default 3.5 (:data:`DEFAULT_GUIDANCE`); only for models that take it
           (``FlowSampling.embedded_guidance``: FLUX.1 dev); noted and ignored for schnell / Chroma
``--l``    true CFG scale, default ``FlowSampling.default_scale`` (FLUX 1.0 = no CFG; SD3 7.5); any value
           but 1 runs the model on the negative prompt too (``--n``, empty when not given) and uses
           ``v_neg + l·(v_pos - v_neg)``, as sd-scripts (SD3's ``do_sample`` guides the x0 estimates
           ``x - σ·v``: the same step, since the guidance is linear)
``--n``    the negative prompt; only read when ``--l`` is not 1 (noted otherwise, as sd-scripts)
``--ss``   ignored with a note: flow matching always samples with its Euler sampler. sd-scripts' FLUX
           sampling ignores ``--sample_sampler`` and ``--ss`` too; so are gen_img's ``--sampler``
           and ``--sample_sampler`` here
``--w/--h``  multiples of 16 (an 8x VAE, 2x2 latent patches), else an error (sd-scripts rounds down)
``--ctr``  CFG truncation: the negative prompt runs only while the model time 1 - σ is below it
           (``FlowSampling.cfg_trunc_ratio``: Lumina 2 0.25, none for the others: every step)
``--rcfg`` the guided velocity's norm capped at this times the conditional one
           (``FlowSampling.renorm_cfg``: Lumina 2 1.0, 0 = off for the others)
=========  ===========================================================================================

The schedule is FLUX's (``flow.flow_sigmas``, dynamic shift) or, for a family with ``FlowSampling.static_shift``
(SD3: 3.0), diffusers' discrete one (``flow.discrete_flow_sigmas``, = ``StableDiffusion3Pipeline``'s and sd-scripts'
``get_all_sigmas``); the noise is drawn packed (FLUX, ``flow.packed_noise``) or as (1, C, h, w) per image
(``FlowSampling.packed_noise`` False: SD3, ``flow.latent_noise``).

Differences from sd-scripts, on purpose: the noise comes from a per-image CPU generator in float32 (sd-scripts draws
FLUX's on the training device in the model dtype; SD3's on the CPU in float32 as here), so a seed gives the same
image on every device; the default size is the family's native resolution (sd-scripts: 512); the Euler update is
accumulated in float32 whatever the model dtype.
Prompts are encoded by the family (``encode_prompt``) without attention weighting, as sd-scripts' FLUX sampling.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from library.families.base import FLOW_MATCHING, FlowSampling, Parts
from library.families.protocol import ModelFamily

from .flow import (
    Velocity,
    discrete_flow_sigmas,
    flow_sigmas,
    image_seq_len,
    latent_noise,
    linear_flow_sigmas,
    packed_noise,
    sample_euler,
    shifted_linear_sigmas,
    with_cfg,
    with_truncated_cfg,
)
from .guidance import with_apg
from .prompts import PromptSpec

log = logging.getLogger(__name__)

FLOW_SAMPLER = "euler"  # the resolved PromptSpec.sampler of flow-matching samples (written to the PNG info)
DEFAULT_FLOW_STEPS = 20  # sd-scripts' FLUX sample defaults (flux_train_utils.sample_image_inference), = FlowSampling's
DEFAULT_GUIDANCE = 3.5
DEFAULT_FLOW_SCALE = 1.0
IGNORED_SAMPLER_FLAGS = ("--sample_sampler", "--sampler", "--ss")
"""Sampler flags that do not apply to flow matching (always the Euler sampler), ignored as in sd-scripts."""


def uses_flow_sampler(family: ModelFamily, parts: Parts) -> bool:
    """True when the loaded model samples with the flow-matching Euler sampler (its objective is flow matching)."""
    return family.objective(parts) == FLOW_MATCHING


def flow_settings(family: ModelFamily, parts: Parts) -> FlowSampling:
    """The family's :class:`FlowSampling` for the loaded model; ValueError if a flow-matching family has none."""
    settings = family.flow_sampling(parts)
    if settings is None:
        raise ValueError(
            f"family {family.name!r}: its objective is {FLOW_MATCHING!r} but flow_sampling(parts) returned None; "
            "return a FlowSampling (embedded guidance, schedule shift) so its samples can be generated"
        )
    return settings


def resolve_flow(spec: PromptSpec, family: ModelFamily, parts: Parts, *, size: int) -> PromptSpec:
    """``spec`` (caller defaults already applied) with every unset setting filled for flow matching (module
    docstring): ``size`` x ``size``, the family's default steps and CFG scale (``FlowSampling.default_steps`` /
    ``default_scale``: FLUX 20 / 1.0, SD3 30 / 7.5), embedded guidance 3.5 where the model takes it (else None),
    sampler "euler". A sampler set by ``--ss`` / ``--sample_sampler`` / ``--sampler`` is noted and replaced."""
    settings = flow_settings(family, parts)
    where = f"prompt {spec.index + 1}"
    if spec.sampler is not None and spec.sampler != FLOW_SAMPLER:
        log.info("%s: sampler %r ignored: flow-matching models always sample with their Euler sampler (%s do not "
                 "apply, as in sd-scripts)", where, spec.sampler, " / ".join(IGNORED_SAMPLER_FLAGS))  # fmt: skip
    guidance = spec.guidance
    if not settings.embedded_guidance:
        if guidance:
            log.info("%s: --g %s ignored: this model has no embedded guidance input", where, guidance)
        guidance = None
    elif guidance is None:
        guidance = DEFAULT_GUIDANCE
    spec = dataclasses.replace(spec, sampler=FLOW_SAMPLER, guidance=guidance)
    return spec.with_defaults(width=size, height=size, steps=settings.default_steps, scale=settings.default_scale)


def prompt_problems(family: ModelFamily, parts: Parts, specs: Sequence[PromptSpec], where: str) -> list[str]:
    """What the loaded model cannot sample in ``specs`` (from ``where``, e.g. the prompt file): for flow matching,
    sizes that are not multiples of two latent patches (16 for an 8x VAE: ``FlowSampling.latent_downscale``); none
    for the DDPM families (parsing checked their sizes)."""
    if not uses_flow_sampler(family, parts):
        return []
    settings = flow_settings(family, parts)
    downscale, patch = settings.latent_downscale, settings.latent_patch
    step = patch * downscale
    problems = []
    for spec in specs:
        for option, value in (("--w", spec.width), ("--h", spec.height)):
            if value is not None and value % step:
                lower = max(step, value - value % step)
                problems.append(f"{where}: prompt {spec.index + 1}: {option} {value} is not a multiple of "
                                f"{step}, which {family.name} needs (a {downscale}x VAE and {patch}x{patch} latent patches); "
                                f"try {lower}")  # fmt: skip
    return problems


def uses_cfg(spec: PromptSpec) -> bool:
    """sd-scripts' rule: true CFG (with the negative prompt, empty when not given) runs whenever ``--l`` is not 1."""
    return spec.scale is not None and spec.scale != 1.0


def flow_velocity(
    family: ModelFamily, parts: Parts, cond: Any, *, guidance: float | None, dtype: torch.dtype | None = None
) -> Velocity:
    """``velocity(x, sigma)`` = ``family.predict(parts.denoiser, x, t=sigma·1000, cond, guidance=g)`` as float32;
    ``guidance`` None leaves the option out (models without embedded guidance). ``dtype``: the dtype x is given to
    the model in (default: the denoiser's compute dtype, :func:`compute_dtype`)."""
    denoiser = parts.denoiser
    dtype = dtype or compute_dtype(denoiser)

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        options = {}
        if guidance is not None:
            options["guidance"] = torch.full((x.shape[0],), guidance, device=x.device, dtype=torch.float32)
        return family.predict(denoiser, x.to(dtype), sigma * 1000, cond, **options).float()

    return velocity


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype ``module`` computes in: that of its first floating-point parameter wider than 8 bits (under
    ``--fp8_base`` the Linear weights are stored in float8, while biases and norms keep the compute dtype)."""
    for parameter in module.parameters():
        if parameter.dtype.is_floating_point and parameter.dtype.itemsize > 1:
            return parameter.dtype
    raise ValueError(f"{type(module).__name__}: no floating-point parameter wider than 8 bits to compute in")


@torch.no_grad()
def generate_flow_latents(
    family: ModelFamily, parts: Parts, specs: Sequence[PromptSpec], generators: Sequence[torch.Generator]
) -> Tensor:
    """Denoised latents (B, C, H/8, W/8), float32, for resolved specs (:func:`resolve_flow`) that share their
    settings; ``generators[i]`` draws image i's noise (:func:`flow.packed_noise`). Runs under ``torch.no_grad`` (and
    the caller's autocast, if any): :func:`encode_flow_prompts` then :func:`sample_flow_latents`."""
    cond = encode_flow_prompts(family, parts, specs)
    return sample_flow_latents(family, parts, specs, cond, generators)


@torch.no_grad()
def encode_flow_prompts(
    family: ModelFamily, parts: Parts, specs: Sequence[PromptSpec], conds: Mapping[str, Any] | None = None
) -> Any:
    """The conditioning of resolved specs that share their settings, on the text encoders' device: the B prompts,
    or with true CFG (:func:`uses_cfg`) the doubled batch [B negatives; B prompts] that :func:`flow.with_cfg`
    expects. Only the text encoders run (a caller may hold the denoiser off the device meanwhile: ``--offload``).
    ``conds``: prompt text -> its conditioning (batch 1, :func:`encode_prompt_texts`); when it has every text the
    text encoders do not run at all (sd-scripts' cached sample prompts under ``--cache_text_encoder_outputs``)."""
    cfg = uses_cfg(specs[0])
    if not cfg and any(s.negative_prompt for s in specs):
        log.info("negative prompt ignored because the CFG scale (--l) is 1.0")
    texts = flow_texts(family, parts, specs)
    if conds is not None and all(t in conds for t in texts):
        cond = conds[texts[0]]
        for text in texts[1:]:
            cond = cat_conds(cond, conds[text])
    elif cfg and texts[-1].startswith(NEGATIVE):  # the negatives encoded apart (FlowSampling.plain_negative)
        n = len(specs)
        cond = cat_conds(family.encode_prompt(parts, texts[:n]), _encode_negatives(family, parts, texts[n:]))
    else:
        cond = family.encode_prompt(parts, texts)
    n = len(specs)
    if cfg:  # the doubled batch [negatives; prompts] that with_cfg expects
        cond = cat_conds(cond_rows(cond, n, 2 * n), cond_rows(cond, 0, n))
    return cond


@torch.no_grad()
def sample_flow_latents(
    family: ModelFamily, parts: Parts, specs: Sequence[PromptSpec], cond: Any, generators: Sequence[torch.Generator]
) -> Tensor:
    """Euler-sample the latents (B, C, H/8, W/8), float32, on the denoiser's device, from ``cond`` of
    :func:`encode_flow_prompts` for the same specs. Only the denoiser runs."""
    first = specs[0]
    settings = flow_settings(family, parts)
    device = next(parts.denoiser.parameters()).device
    cond = cond.to(device)
    sigmas = sampling_sigmas(settings, first.steps, first.height, first.width)
    if settings.packed_noise:
        noise = packed_noise(generators, first.height, first.width, settings.latent_channels, settings.latent_downscale)
    else:
        noise = latent_noise(generators, first.height, first.width, settings.latent_channels,
                             settings.latent_downscale, settings.latent_patch)  # fmt: skip
    noise = noise.to(device)
    velocity = flow_velocity(family, parts, cond, guidance=first.guidance)
    if uses_cfg(first) and settings.apg is not None:
        renders_text = settings.apg.renders_text or (lambda prompt: False)
        velocity = with_apg(velocity, first.scale, settings.apg, [renders_text(s.prompt) for s in specs])
    elif uses_cfg(first):
        ratio = first.cfg_trunc_ratio if first.cfg_trunc_ratio is not None else settings.cfg_trunc_ratio
        renorm = first.renorm_cfg if first.renorm_cfg is not None else settings.renorm_cfg
        if ratio is None and not renorm:
            velocity = with_cfg(velocity, first.scale)
        else:
            n = len(specs)
            conditional = flow_velocity(family, parts, cond_rows(cond, n, 2 * n), guidance=first.guidance)
            velocity = with_truncated_cfg(velocity, conditional, first.scale, ratio, renorm)
    return sample_euler(velocity, noise, sigmas)


def sampling_sigmas(settings: FlowSampling, steps: int, height: int, width: int) -> Tensor:
    """The (steps + 1,) noise levels for an H x W image: ``flow.discrete_flow_sigmas`` with a static shift (SD3),
    else ``flow.flow_sigmas`` with FLUX's resolution-dependent shift (or none: schnell)."""
    seq_len = image_seq_len(height, width, settings.latent_downscale, settings.latent_patch)
    if settings.static_shift is not None and settings.linear_shift:
        return shifted_linear_sigmas(steps, settings.static_shift)
    if settings.static_shift is not None and settings.linear_grid:
        return linear_flow_sigmas(steps, settings.static_shift)
    if settings.static_shift is not None:
        return discrete_flow_sigmas(steps, settings.static_shift)
    return flow_sigmas(
        steps, seq_len, shift=settings.shift, base_shift=settings.base_shift, max_shift=settings.max_shift
    )


@torch.no_grad()
def encode_prompt_texts(family: ModelFamily, parts: Parts, texts: Sequence[str]) -> dict[str, Any]:
    """Each distinct text's conditioning (batch 1, on the host) for :func:`encode_flow_prompts`' ``conds``: what a
    run caches for its sample prompts while the text encoders are on the device for ``--cache_text_encoder_outputs``,
    so a sampling round needs no text encoder on the device (sd-scripts does the same for FLUX)."""
    return {text: (_encode_negatives(family, parts, [text]) if text.startswith(NEGATIVE) else
                   family.encode_prompt(parts, [text])).to("cpu") for text in dict.fromkeys(texts)}  # fmt: skip


# the key of a negative prompt encoded apart from the prompts (FlowSampling.plain_negative), in texts and conds
NEGATIVE = "\x00negative\x00"


def negative_key(settings: FlowSampling, text: str) -> str:
    """How a negative prompt is keyed in :func:`flow_texts` and the cached conditionings: itself, or
    :data:`NEGATIVE` + itself for a family that encodes negatives apart (``FlowSampling.plain_negative``)."""
    return NEGATIVE + text if settings.plain_negative else text


def flow_texts(family: ModelFamily, parts: Parts, specs: Sequence[PromptSpec]) -> list[str]:
    """The texts (keys) the conditioning of ``specs`` is made of: the prompts, then with true CFG the negatives
    (:func:`negative_key`)."""
    settings = flow_settings(family, parts)
    negatives = [negative_key(settings, s.negative_prompt) for s in specs] if uses_cfg(specs[0]) else []
    return [s.prompt for s in specs] + negatives


def _encode_negatives(family: ModelFamily, parts: Parts, keys: Sequence[str]) -> Any:
    return family.encode_prompt(parts, [k.removeprefix(NEGATIVE) for k in keys], negative=True)


def cond_rows(cond: Any, start: int, stop: int) -> Any:
    """Rows ``[start:stop)`` of every tensor field of a conditioning dataclass (``Cond``); None fields stay None."""
    return dataclasses.replace(cond, **{k: v[start:stop] for k, v in _tensor_fields(cond).items()})


def cat_conds(first: Any, second: Any) -> Any:
    """Two conditionings of the same dataclass, rows of ``first`` then ``second`` in every tensor field; fields of
    different lengths (dim 1: encoders whose outputs are as long as each prompt, with a mask) are zero-padded to the
    longer first."""
    a, b = _tensor_fields(first), _tensor_fields(second)
    if a.keys() != b.keys():
        raise ValueError(f"cat_conds: fields {sorted(a)} and {sorted(b)} differ (one conditioning lacks a tensor)")
    return dataclasses.replace(first, **{k: torch.cat(_same_length(a[k], b[k])) for k in a})


def _same_length(x: Tensor, y: Tensor) -> list[Tensor]:
    if x.ndim < 2 or x.shape[1:] == y.shape[1:] or x.shape[2:] != y.shape[2:]:
        return [x, y]
    n = max(x.shape[1], y.shape[1])
    return [torch.cat([t, t.new_zeros((t.shape[0], n - t.shape[1], *t.shape[2:]))], dim=1) for t in (x, y)]


def _tensor_fields(cond: Any) -> dict[str, Tensor]:
    return {
        f.name: getattr(cond, f.name) for f in dataclasses.fields(cond) if isinstance(getattr(cond, f.name), Tensor)
    }
