"""Saving a FLUX.1 / Chroma model: the transformer as a BFL single file, or everything as a diffusers folder.

A ``.safetensors`` path gets what sd-scripts' ``flux_train.py`` writes: the transformer alone under BFL names (no
prefix), which ComfyUI, Forge and sd-scripts load with their own ``--clip_l --t5xxl --ae``; the metadata carries
ModelSpec (architecture ``flux-1-dev`` / ``flux-1-schnell`` / ``chroma``, the BFL or Chroma implementation URL),
``sdtrain.family`` and ``sdtrain.configs`` (every part's config, so non-released shapes reload exactly). Any other path
is a diffusers folder (``FluxPipeline`` / ``ChromaPipeline`` layout) written component by component, atomically.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.files.weights import save_state_dict

from ..base import Parts
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import _save_weights, atomic_dir, clean_config
from ..tokenizers import write_vocab_files
from . import keys as K
from .configs import scheduler_kwargs


def model_configs(parts: Parts) -> dict:
    """The part configs as JSON-able data (``sdtrain.configs``)."""
    return {
        "family": parts.family,
        "transformer": clean_config(parts.denoiser.config),
        "vae": clean_config(parts.vae.config) if parts.vae is not None else None,
        "text_encoders": [clean_config(te.config.to_dict()) for te in parts.text_encoders],
        "scheduler": dict(parts.scheduler_config),
    }


def flux_modelspec(architecture: str, implementation: str, title: str, resolution: int = 1024) -> dict[str, str]:
    """ModelSpec 1.0.1 of a full FLUX checkpoint, as sd-scripts' ``sai_model_spec.py`` writes it (no prediction type
    for FLUX)."""
    return {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": architecture,
        "modelspec.implementation": implementation,
        "modelspec.title": title,
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
    }


def save_bfl_file(
    parts: Parts, path: Path, dtype: torch.dtype | None, metadata: Mapping[str, str], spec_meta: Mapping[str, str]
) -> Path:
    """The transformer under BFL names (atomic; ``metadata`` is merged over ours); each BFL tensor is made as the
    writer takes it (:class:`keys.BflView`; ``--mem_eff_save`` writes them one at a time)."""
    state = K.BflView(parts.denoiser.state_dict())
    meta = {META_FAMILY: parts.family, META_CONFIGS: json.dumps(model_configs(parts)), **spec_meta, **metadata}
    return save_state_dict(state, path, meta, dtype)


def save_diffusers_folder(
    parts: Parts, folder: Path, dtype: torch.dtype | None, safetensors: bool, pipeline: Any
) -> Path:
    """Write ``parts`` as a diffusers FLUX / Chroma pipeline folder (``pipeline``: one over the same modules, for
    ``model_index.json``)."""
    suffix = ".safetensors" if safetensors else ".bin"
    model = "diffusion_pytorch_model" + suffix
    text_model = ("model" if safetensors else "pytorch_model") + suffix
    chroma = parts.family == "chroma"
    te_dirs = ["text_encoder"] if chroma else ["text_encoder", "text_encoder_2"]
    tok_dirs = ["tokenizer"] if chroma else ["tokenizer", "tokenizer_2"]
    with atomic_dir(folder) as tmp:
        pipeline.save_config(tmp)
        for name, module in (("transformer", parts.denoiser), ("vae", parts.vae)):
            module.save_config(tmp / name)
            _save_weights(module.state_dict(), tmp / name / model, dtype)
        for sub, tok_sub, te, tok in zip(te_dirs, tok_dirs, parts.text_encoders, parts.tokenizers):
            te.config.save_pretrained(tmp / sub)
            state = dict(te.state_dict())
            tied = state.get("encoder.embed_tokens.weight")
            if tied is not None and "shared.weight" in state and tied.data_ptr() == state["shared.weight"].data_ptr():
                del state["encoder.embed_tokens.weight"]  # tied to shared.weight (transformers ties them on load)
            _save_weights(state, tmp / sub / text_model, dtype)
            tok.save_pretrained(tmp / tok_sub)
            if len(tok) == 49408 and not (tmp / tok_sub / "vocab.json").exists():
                write_vocab_files(tmp / tok_sub)
        from diffusers import FlowMatchEulerDiscreteScheduler

        FlowMatchEulerDiscreteScheduler(**scheduler_kwargs(parts.scheduler_config)).save_pretrained(tmp / "scheduler")
    return folder
