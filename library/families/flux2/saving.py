"""Writing FLUX.2's files: the DiT in BFL's names (the layout of ``flux2-klein-4b.safetensors`` that musubi-tuner and
ComfyUI read), Qwen3 under ``model.`` (the released split files' names) and the AE in BFL's ``ae.safetensors``
names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.files.weights import save_state_dict

from ..autoencoders import flux2 as ae
from ..base import Parts
from ..loading import META_FAMILY
from . import keys as K


def save_dit(parts: Parts, path: Path, family: Any, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None) -> Path:  # fmt: skip
    meta = {"format": "pt", META_FAMILY: family.name, **family.modelspec(path.stem), **(metadata or {})}
    return save_state_dict(K.to_bfl(parts.denoiser.state_dict()), path, meta, dtype)


def save_text_encoder(parts: Parts, path: Path, dtype: torch.dtype | None = None) -> Path:
    state = {"model." + k: v for k, v in parts.text_encoders[0].state_dict().items()}
    return save_state_dict(state, path, {"format": "pt"}, dtype)


def save_vae(parts: Parts, path: Path, dtype: torch.dtype | None = None) -> Path:
    num_up = len(parts.vae.config.up_block_types)
    return save_state_dict(ae.to_bfl(parts.vae.state_dict(), num_up), path, {"format": "pt"}, dtype)
