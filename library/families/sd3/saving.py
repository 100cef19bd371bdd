"""Saving an SD3 / SD3.5 model: the SAI single file, or everything as a diffusers folder.

A ``.safetensors`` path gets the SAI layout sd-scripts' ``sd3_train.py`` writes (``sd3_train_utils.save_models``):
the transformer under ``model.diffusion_model.`` and the VAE under ``first_stage_model.`` (LDM names), here with the
text encoders too under ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.`` (transformers names; the layout of SAI's
``sd3_medium_incl_clips_t5xxlfp16.safetensors``, which diffusers' ``from_single_file`` and ComfyUI read whole;
``text_encoders=False`` leaves them out, as sd-scripts does). The metadata carries ModelSpec (architecture
``stable-diffusion-3-medium`` / ``-3-5-medium`` / ``-3-5-large``), ``sdtrain.family`` and ``sdtrain.configs``. Any
other path is a ``StableDiffusion3Pipeline`` folder written component by component, atomically.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import save_state_dict

from ..base import Parts
from ..convert import hf_state_dict, vae_to_ldm
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import _save_weights, atomic_dir, clean_config
from ..tokenizers import write_vocab_files
from . import keys as K
from .configs import scheduler_kwargs

NAMES = ("clip_l", "clip_g", "t5xxl")


def model_configs(parts: Parts) -> dict:
    """The part configs as JSON-able data (``sdtrain.configs``)."""
    return {
        "family": parts.family,
        "transformer": clean_config(parts.denoiser.config),
        "vae": clean_config(parts.vae.config) if parts.vae is not None else None,
        "text_encoders": [clean_config(te.config.to_dict()) for te in parts.text_encoders],
        "scheduler": dict(parts.scheduler_config),
    }


def sd3_modelspec(architecture: str, implementation: str, title: str, resolution: int = 1024) -> dict[str, str]:
    """ModelSpec 1.0.1 of a full SD3 checkpoint, as sd-scripts' ``sai_model_spec.py`` writes it."""
    return {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": architecture,
        "modelspec.implementation": implementation,
        "modelspec.title": title,
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
    }


def text_encoder_state(te: nn.Module) -> dict[str, Tensor]:
    """A text encoder's tensors under transformers names as SD3 files hold them: CLIP ``text_model.*`` +
    ``text_projection.weight``; T5 ``shared.weight`` + ``encoder.*``, the embedding under both names (diffusers'
    single-file T5 reader does not tie them: without ``encoder.embed_tokens.weight`` its T5 keeps a meta tensor
    there). Copies where tensors are shared (safetensors stores no aliases)."""
    if hasattr(te, "shared"):  # T5
        state = dict(te.state_dict())
        tied = state.get("encoder.embed_tokens.weight")
        if tied is not None and "shared.weight" in state and tied.data_ptr() == state["shared.weight"].data_ptr():
            state["encoder.embed_tokens.weight"] = tied.clone()
        return state
    return {k: v for k, v in hf_state_dict(te).items() if not k.endswith("position_ids")}


def sai_state_dict(parts: Parts, text_encoders: bool = True) -> dict[str, Tensor]:
    """The SAI single-file tensors of ``parts`` (see the module docstring)."""
    state = K.diffusers_to_sai(parts.denoiser.state_dict(), prefix=K.SAI_PREFIX)
    if parts.vae is not None:
        state.update(
            {f"first_stage_model.{k}": v for k, v in vae_to_ldm(parts.vae.state_dict(), parts.vae.config).items()}
        )
    if text_encoders:
        for name, te in zip(NAMES, parts.text_encoders):
            state.update({f"text_encoders.{name}.transformer.{k}": v for k, v in text_encoder_state(te).items()})
    return state


def save_sai_file(parts: Parts, path: Path, dtype: torch.dtype | None, metadata: Mapping[str, str],
                  spec_meta: Mapping[str, str], text_encoders: bool = True) -> Path:  # fmt: skip
    """The SAI single file (atomic; ``metadata`` is merged over ours)."""
    meta = {META_FAMILY: parts.family, META_CONFIGS: json.dumps(model_configs(parts)), **spec_meta, **metadata}
    return save_state_dict(sai_state_dict(parts, text_encoders), path, meta, dtype)


def save_diffusers_folder(parts: Parts, folder: Path, dtype: torch.dtype | None, safetensors: bool, pipeline: Any
                          ) -> Path:  # fmt: skip
    """Write ``parts`` as a diffusers ``StableDiffusion3Pipeline`` folder (``pipeline``: one over the same modules,
    for ``model_index.json``)."""
    suffix = ".safetensors" if safetensors else ".bin"
    model = "diffusion_pytorch_model" + suffix
    text_model = ("model" if safetensors else "pytorch_model") + suffix
    with atomic_dir(folder) as tmp:
        pipeline.save_config(tmp)
        for name, module in (("transformer", parts.denoiser), ("vae", parts.vae)):
            module.save_config(tmp / name)
            _save_weights(module.state_dict(), tmp / name / model, dtype)
        subs = ("text_encoder", "text_encoder_2", "text_encoder_3")
        tok_subs = ("tokenizer", "tokenizer_2", "tokenizer_3")
        for sub, tok_sub, te, tok in zip(subs, tok_subs, parts.text_encoders, parts.tokenizers):
            te.config.save_pretrained(tmp / sub)
            state = dict(te.state_dict())
            tied = state.get("encoder.embed_tokens.weight")
            if tied is not None and "shared.weight" in state and tied.data_ptr() == state["shared.weight"].data_ptr():
                del state["encoder.embed_tokens.weight"]
            _save_weights(state, tmp / sub / text_model, dtype)
            tok.save_pretrained(tmp / tok_sub)
            if len(tok) == 49408 and not (tmp / tok_sub / "vocab.json").exists():
                write_vocab_files(tmp / tok_sub)
        from diffusers import FlowMatchEulerDiscreteScheduler

        FlowMatchEulerDiscreteScheduler(**scheduler_kwargs(parts.scheduler_config)).save_pretrained(tmp / "scheduler")
    return folder


def pipeline_of(parts: Parts, scheduler: Any = None) -> Any:
    """``StableDiffusion3Pipeline`` over ``parts`` (the same modules) with ``scheduler`` (None: a
    ``FlowMatchEulerDiscreteScheduler`` of the model's config)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    if scheduler is None:
        scheduler = FlowMatchEulerDiscreteScheduler(**scheduler_kwargs(parts.scheduler_config))
    tokenizers = parts.tokenizers or [None, None, None]
    encoders = parts.text_encoders or [None, None, None]
    return StableDiffusion3Pipeline(
        transformer=parts.denoiser, scheduler=scheduler, vae=parts.vae,
        text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1], tokenizer_2=tokenizers[1],
        text_encoder_3=encoders[2], tokenizer_3=tokenizers[2],
    )  # fmt: skip
