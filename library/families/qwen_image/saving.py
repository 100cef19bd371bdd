"""Writing Qwen-Image's files: the DiT as one .safetensors in diffusers' names (the official / ComfyUI layout that
musubi-tuner's loader and ComfyUI read), Qwen2.5-VL's language model under ``model.`` (ComfyUI's split file layout),
the VAE in ComfyUI's names, and a folder of the three (``dit.safetensors``, ``text_encoder/``, ``vae/``) that
``load`` takes without ``--text_encoder`` / ``--vae``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.files.weights import save_state_dict

from ..autoencoders import qwen_image
from ..base import Parts
from ..loading import META_FAMILY
from ..saving import atomic_dir

FOLDER_FILES = {"dit": "dit.safetensors", "text_encoder": "text_encoder/model.safetensors",
                "vae": "vae/diffusion_pytorch_model.safetensors"}  # fmt: skip


def save_dit(parts: Parts, path: Path, family: Any, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None) -> Path:  # fmt: skip
    meta = {"format": "pt", META_FAMILY: family.name, **family.modelspec(path.stem), **(metadata or {})}
    return save_state_dict(dict(parts.denoiser.state_dict()), path, meta, dtype)


def save_text_encoder(parts: Parts, path: Path, dtype: torch.dtype | None = None) -> Path:
    """ComfyUI's layout: the language model under ``model.``, an edit model's vision tower under ``visual.``."""
    encoder = parts.text_encoders[0]
    state = {"model." + k: v for k, v in getattr(encoder, "language_model", encoder).state_dict().items()}
    if hasattr(encoder, "visual"):
        state.update({"visual." + k: v for k, v in encoder.visual.state_dict().items()})
    return save_state_dict(state, path, {"format": "pt"}, dtype)


def save_vae(parts: Parts, path: Path, comfy: bool = True, dtype: torch.dtype | None = None) -> Path:
    state = parts.vae.state_dict()
    if comfy:
        nrb = int(parts.vae.config.num_res_blocks)
        state = {qwen_image.diffusers_to_comfy_name(k, nrb): v for k, v in state.items()}
    return save_state_dict(dict(state), path, {"format": "pt"}, dtype)


def save_folder(parts: Parts, folder: Path, family: Any, dtype: torch.dtype | None = None,
                metadata: Mapping[str, str] | None = None) -> Path:  # fmt: skip
    with atomic_dir(folder) as tmp:
        (tmp / "text_encoder").mkdir()
        (tmp / "vae").mkdir()
        save_dit(parts, tmp / FOLDER_FILES["dit"], family, dtype, metadata)
        save_text_encoder(parts, tmp / FOLDER_FILES["text_encoder"], dtype)
        save_vae(parts, tmp / FOLDER_FILES["vae"], False, dtype)
    return folder
