"""Writing Anima's files: the DiT as sd-scripts' full fine-tune writes it (``anima_utils.save_anima_model``: every key
under ``net.``, ``format: pt`` metadata; plus sd-scripts' RoPE buffers so its strict loader and ComfyUI find every
key), Qwen3 under ``model.`` (ComfyUI's layout), the VAE in ComfyUI's / Wan names or diffusers', and an Anima folder
(``anima.safetensors``, ``qwen3.safetensors``, ``vae.safetensors``: what ``load`` takes without ``--qwen3`` /
``--vae``).
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
from . import keys as K

FOLDER_FILES = {"dit": "anima.safetensors", "qwen3": "qwen3.safetensors", "vae": "vae.safetensors"}


def dit_state(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The denoiser's weights in sd-scripts' names under ``net.`` with the RoPE buffers."""
    state = {k: v for k, v in denoiser.state_dict().items()}
    out = K.diffusers_to_sd(state)
    c = denoiser.config
    for key, value in K.rope_buffers(int(c.attention_head_dim), tuple(c.max_size), tuple(c.patch_size)).items():
        out[K.NET + key] = value
    return out


def save_dit(parts: Parts, path: Path, family: Any, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None) -> Path:  # fmt: skip
    meta = {"format": "pt", META_FAMILY: family.name, **family.modelspec(path.stem), **(metadata or {})}
    return save_state_dict(dit_state(parts.denoiser), path, meta, dtype)


def save_qwen3(parts: Parts, path: Path, dtype: torch.dtype | None = None) -> Path:
    state = {"model." + k: v for k, v in parts.text_encoders[0].state_dict().items()}
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
        save_dit(parts, tmp / FOLDER_FILES["dit"], family, dtype, metadata)
        save_qwen3(parts, tmp / FOLDER_FILES["qwen3"], dtype)
        save_vae(parts, tmp / FOLDER_FILES["vae"], True, dtype)
    return folder
