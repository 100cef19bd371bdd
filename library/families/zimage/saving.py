"""Writing Z-Image's files: the DiT as one .safetensors in diffusers' names (musubi-tuner's zimage_train.py output
layout; ``original=True``: the original / ComfyUI names, fused ``qkv``), Qwen3 under ``model.`` (ComfyUI's
``qwen_3_4b.safetensors`` layout), the AE in BFL's names (``ae.safetensors``), and a folder of the three
(``zimage_dit.safetensors``, ``text_encoder/``, ``vae/``) that ``load`` takes without ``--text_encoder`` / ``--vae``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.files.weights import save_state_dict

from ..base import Parts
from ..convert import vae_to_ldm
from ..loading import META_FAMILY
from ..saving import atomic_dir
from . import model as M
from .loading import FOLDER_DIT

FOLDER_FILES = {"dit": FOLDER_DIT, "text_encoder": "text_encoder/model.safetensors",
                "vae": "vae/diffusion_pytorch_model.safetensors"}  # fmt: skip


def save_dit(parts: Parts, path: Path, family: Any, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, original: bool = False) -> Path:  # fmt: skip
    meta = {"format": "pt", META_FAMILY: family.name, **family.modelspec(path.stem), **(metadata or {})}
    state = dict(parts.denoiser.state_dict())
    return save_state_dict(M.to_original(state) if original else state, path, meta, dtype)


def save_text_encoder(parts: Parts, path: Path, dtype: torch.dtype | None = None) -> Path:
    state = {"model." + k: v for k, v in parts.text_encoders[0].state_dict().items()}
    return save_state_dict(state, path, {"format": "pt"}, dtype)


def save_vae(parts: Parts, path: Path, bfl: bool = True, dtype: torch.dtype | None = None) -> Path:
    vae = parts.vae
    state = vae_to_ldm(vae.state_dict(), vae.config) if bfl else dict(vae.state_dict())
    return save_state_dict(state, path, {"format": "pt"}, dtype)


def save_folder(parts: Parts, folder: Path, family: Any, dtype: torch.dtype | None = None,
                metadata: Mapping[str, str] | None = None) -> Path:  # fmt: skip
    with atomic_dir(folder) as tmp:
        (tmp / "text_encoder").mkdir()
        (tmp / "vae").mkdir()
        save_dit(parts, tmp / FOLDER_FILES["dit"], family, dtype, metadata)
        save_text_encoder(parts, tmp / FOLDER_FILES["text_encoder"], dtype)
        save_vae(parts, tmp / FOLDER_FILES["vae"], False, dtype)
    return folder
