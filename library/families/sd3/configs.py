"""The configs of the released SD3-medium, SD3.5-medium and SD3.5-large models (diffusers / transformers names) and
the module classes they build, for loading single files and for ``reference_parts`` (meta device).

Transformer (diffusers' ``transformer/config.json`` of stabilityai/stable-diffusion-3-medium-diffusers,
stable-diffusion-3.5-medium, stable-diffusion-3.5-large; sd-scripts' ``sd3_utils.analyze_state_dict_state`` reads the
same numbers from the weights: width = 64 × depth, ``pos_embed`` of pos_embed_max_size² patches):

==============  ======  =====  =====  ==================  =======  =========================
variant         blocks  width  heads  pos_embed_max_size  qk_norm  dual_attention_layers
==============  ======  =====  =====  ==================  =======  =========================
sd3             24      1536   24     192                 none     none
sd3.5-medium    24      1536   24     384                 rms      0..12
sd3.5-large     38      2432   38     192                 rms      none
==============  ======  =====  =====  ==================  =======  =========================

The VAE is FLUX's 16-channel AE with SD3's scale 1.5305 and shift 0.0609; the text encoders are CLIP-L and CLIP-G
(both ``CLIPTextModelWithProjection``) and the T5-XXL encoder, with the shared encoders' released configs
(``encoders/``, ``autoencoders/``); the scheduler
is ``FlowMatchEulerDiscreteScheduler`` with the static shift 3.0 of all three releases.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from functools import cache

from torch import nn

from ..autoencoders import flux_ae
from ..encoders import clip, t5
from .keys import SD3, SD35_LARGE, SD35_MEDIUM

VARIANTS = (SD3, SD35_MEDIUM, SD35_LARGE)
SCALE, SHIFT = 1.5305, 0.0609
_COMMON = dict(sample_size=128, patch_size=2, in_channels=16, attention_head_dim=64, joint_attention_dim=4096,
               pooled_projection_dim=2048, out_channels=16)  # fmt: skip
TRANSFORMERS = {
    SD3: dict(
        _COMMON,
        num_layers=24,
        num_attention_heads=24,
        caption_projection_dim=1536,
        pos_embed_max_size=192,
        dual_attention_layers=(),
        qk_norm=None,
    ),  # fmt: skip
    SD35_MEDIUM: dict(
        _COMMON,
        num_layers=24,
        num_attention_heads=24,
        caption_projection_dim=1536,
        pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)),
        qk_norm="rms_norm",
    ),  # fmt: skip
    SD35_LARGE: dict(
        _COMMON,
        num_layers=38,
        num_attention_heads=38,
        caption_projection_dim=2432,
        pos_embed_max_size=192,
        dual_attention_layers=(),
        qk_norm="rms_norm",
    ),  # fmt: skip
}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "prediction_type": "flow_matching"}


@cache
def _released(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown SD3 variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    return {
        "transformer": TRANSFORMERS[variant],
        "vae": dict(flux_ae.released_config(), scaling_factor=SCALE, shift_factor=SHIFT),
        "text_encoders": [clip.released_config(0), clip.released_config(1), t5.released_config()],
        "scheduler": SCHEDULER,
    }


def released(variant: str) -> dict:
    """``{"transformer", "vae", "text_encoders": [CLIP-L, CLIP-G, T5], "scheduler"}``, a fresh copy."""
    return copy.deepcopy(_released(variant))


def scheduler_config(variant: str = SD3) -> dict:
    """The ``FlowMatchEulerDiscreteScheduler`` config, plus ``prediction_type`` "flow_matching"."""
    return released(variant)["scheduler"]


def scheduler_kwargs(config: Mapping) -> dict:
    """The scheduler config without our ``prediction_type`` key (for ``FlowMatchEulerDiscreteScheduler``)."""
    return {k: v for k, v in config.items() if k != "prediction_type"}


def transformer_factory(config: Mapping) -> Callable[[], nn.Module]:
    from diffusers import SD3Transformer2DModel

    return lambda: SD3Transformer2DModel.from_config(dict(config))


# the shared parts' classes
vae_factory = flux_ae.factory
t5_factory = t5.factory


def clip_factory(config: Mapping) -> Callable[[], nn.Module]:
    """CLIP-L or CLIP-G with its text projection (SD3's pooled output is ``text_embeds``)."""
    return clip.factory(config, with_projection=True)
