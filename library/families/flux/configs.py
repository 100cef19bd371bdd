"""The shipped configs of the released FLUX.1 dev / schnell and Chroma models (``families/configs/<variant>.json``)
and the module classes they build, for loading single files and for ``reference_parts`` (meta device)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from functools import cache

from torch import nn

from ..autoencoders import flux_ae
from ..encoders import clip, t5
from ..loading import shipped_configs

VARIANTS = ("flux-dev", "flux-schnell", "chroma")


@cache
def _shipped(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown FLUX variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    return shipped_configs(variant)


def released(variant: str) -> dict:
    """``{"transformer", "vae", "text_encoders": [CLIP-L, T5] (Chroma: [T5]), "scheduler"}``, a fresh copy."""
    return copy.deepcopy(_shipped(variant))


def scheduler_config(variant: str) -> dict:
    """The ``FlowMatchEulerDiscreteScheduler`` config of the released model, plus ``prediction_type``
    "flow_matching" (what ``Parts.prediction_type`` reports)."""
    return released(variant)["scheduler"]


def scheduler_kwargs(config: Mapping) -> dict:
    """The scheduler config without our ``prediction_type`` key (for ``FlowMatchEulerDiscreteScheduler``)."""
    return {k: v for k, v in config.items() if k != "prediction_type"}


def transformer_factory(config: Mapping) -> Callable[[], nn.Module]:
    """``ChromaTransformer2DModel`` for a config with an approximator, else ``FluxTransformer2DModel``."""
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    cls = ChromaTransformer2DModel if "approximator_layers" in config else FluxTransformer2DModel
    return lambda: cls.from_config(dict(config))


# the shared parts' classes (FLUX.1's CLIP-L has no projection)
ae_factory = flux_ae.factory
t5_factory = t5.factory


def clip_l_factory(config: Mapping) -> Callable[[], nn.Module]:
    return clip.factory(config, with_projection=False)
