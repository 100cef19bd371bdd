"""What every model family provides, and the containers passed between the family and the rest of the toolkit.

A family (SD1, SD2, SDXL) is one small object that holds everything that differs between the architectures. Code
outside ``library/families/`` asks the family; it never tests ``is_sdxl`` or ``v2`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn


@dataclass
class Parts:
    """The loaded modules of one Stable Diffusion model.

    ``text_encoders`` and ``tokenizers`` are lists: one entry for SD1/SD2, two for SDXL (CLIP-L, then OpenCLIP-bigG).
    ``scheduler_config`` is the noise schedule (diffusers scheduler config dict: betas, num_train_timesteps,
    prediction_type "epsilon" | "v_prediction", and ``rescale_betas_zero_snr: True`` for zero-terminal-SNR models).
    ``extra["text_encoder_extras"]``: per text encoder, OpenCLIP tensors of the source file that the HF model does not
    hold (SD2's 24th block, ``logit_scale``...), written back unchanged when the model is saved as a single file.
    """

    denoiser: nn.Module
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

    ``hidden_states``: (B, 77, D) cross-attention context, or (B, 75·k + 2, D) for ``--max_token_length`` 150/225
    (k = 2 or 3 chunks of 75 tokens, laid out as sd-scripts does: BOS, the chunks' tokens, the last EOS/PAD).
    Unpadded (train_db.py's ``--no_token_padding``): (B, L, D), L = 2 + the batch's longest caption (at most 77).
    ``pooled``: (B, P) pooled text embedding (SDXL: the second encoder's projected pooled output), else None.
    """

    hidden_states: Tensor
    pooled: Tensor | None = None

    def to(self, *args, **kwargs) -> Cond:
        pooled = self.pooled.to(*args, **kwargs) if self.pooled is not None else None
        return Cond(self.hidden_states.to(*args, **kwargs), pooled)


@dataclass(frozen=True)
class TextEncoderSpec:
    """How one text encoder of a family is stored and tokenized.

    ``prefix``: its key prefix in a single-file checkpoint. ``layout``: "clip" (HF names under ``text_model.``) or
    "open_clip" (OpenCLIP names, stacked in_proj). ``with_projection``: a ``CLIPTextModelWithProjection`` (SDXL TE2).
    ``pad_token``: "<|endoftext|>" (CLIP-L) or "!" (OpenCLIP). ``tokenizer_id``: the hub id sd-scripts loads, looked
    up as ``<--tokenizer_cache_dir>/<id with / replaced by _>``. ``final_block_after``: when the HF model has this many
    layers, single files get one more (dummy) OpenCLIP block (SD2: OpenCLIP-H has 24 blocks, SD uses 23).
    """

    prefix: str
    layout: str
    with_projection: bool
    pad_token: str
    tokenizer_id: str
    ti_key: str
    final_block_after: int | None = None


@dataclass(frozen=True)
class FamilySpec:
    """The data a family hands to the shared loading / saving code.

    ``configs``: prediction type -> shipped config file stem (``configs/<stem>.json``). ``guess_prediction``: a
    last-resort detector of the prediction type from single-file weights (returns None when it cannot tell).
    """

    name: str
    title: str
    text_encoders: tuple[TextEncoderSpec, ...]
    configs: Mapping[str, str]
    pipeline_class: str
    guess_prediction: Callable[[Mapping[str, Tensor]], str | None] | None = None


class ModelFamily(Protocol):
    """The interface each of ``library.families.SD1 / SD2 / SDXL`` satisfies (by composition, no shared base class)."""

    name: str  # "sd1" | "sd2" | "sdxl"
    vae_scale: float
    resolution: int  # native resolution of the flagship release (512 / 768 / 1024)
    num_text_encoders: int
    ti_embedding_keys: tuple[str, ...]

    def load(self, path: str, **options: Any) -> Parts: ...

    def save(self, parts: Parts, path: str, **options: Any) -> Any: ...

    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]: ...

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond: ...

    def encode_prompt(self, parts: Parts, captions: list[str], **options: Any) -> Cond: ...

    def predict(self, unet: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, **options: Any) -> Tensor: ...

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor: ...

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor: ...

    def adapter_roots(self, parts: Parts) -> list[tuple[str, nn.Module, Callable[[str], str]]]: ...

    def base_model_version(self, prediction_type: str = "epsilon") -> str: ...

    def modelspec_architecture(self, kind: str = "", prediction_type: str = "epsilon") -> str: ...


def module_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device
