"""What every model family provides, and the containers passed between the family and the rest of the toolkit.

A family (SD1, SD2, SDXL) is one small object that holds everything that differs between the architectures. Code
outside ``library/families/`` asks the family; it never tests ``is_sdxl`` or ``v2`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn


@dataclass
class Parts:
    """The loaded modules of one Stable Diffusion model.

    ``text_encoders`` and ``tokenizers`` are lists: one entry for SD1/SD2, two for SDXL (CLIP-L, then OpenCLIP-bigG).
    ``scheduler_config`` is the noise schedule (diffusers scheduler config dict: betas, num_train_timesteps,
    prediction_type "epsilon" | "v_prediction").
    """

    unet: nn.Module
    vae: nn.Module
    text_encoders: list[nn.Module]
    tokenizers: list[Any]
    scheduler_config: dict
    family: str
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def prediction_type(self) -> str:
        return self.scheduler_config.get("prediction_type", "epsilon")


@dataclass
class Cond:
    """Prompt conditioning for the UNet.

    ``hidden_states``: (B, 77*k, D) cross-attention context (k = number of 75-token chunks).
    ``pooled``: (B, P) pooled text embedding (SDXL: the second encoder's projected pooled output), else None.
    """

    hidden_states: Tensor
    pooled: Tensor | None = None

    def to(self, *args, **kwargs) -> Cond:
        pooled = self.pooled.to(*args, **kwargs) if self.pooled is not None else None
        return Cond(self.hidden_states.to(*args, **kwargs), pooled)


class ModelFamily(Protocol):
    """The interface each of ``library.families.SD1 / SD2 / SDXL`` satisfies (by composition, no shared base class)."""

    name: str  # "sd1" | "sd2" | "sdxl"
    vae_scale: float
    resolution: int  # native training resolution (512 / 768 / 1024)

    def load(self, path: str, **options: Any) -> Parts: ...

    def encode_prompt(self, parts: Parts, captions: list[str], **options: Any) -> Cond: ...

    def predict(self, unet: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, **options: Any) -> Tensor: ...


def module_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
