"""Saving a full model as a single-file checkpoint (.safetensors / .ckpt) or as a diffusers folder, atomically.

Single files use the key layout every SD tool reads (docs/formats.md "Single-file checkpoints", conversion in
``convert.py``) and carry metadata: ModelSpec 1.0.1 (``modelspec.architecture``, ``.prediction_type``,
``.resolution``...), ``sdtrain.family`` and ``sdtrain.configs`` (the component configs as JSON, so tiny and
non-standard models reload exactly). A v-prediction model also gets the ``v_pred`` marker tensor (and ``ztsnr`` for
zero-terminal-SNR), the convention ComfyUI and Forge read for SDXL; other readers ignore unknown top-level keys.

Diffusers folders are written component by component (so ``dtype`` can differ from the modules' dtype without a
copy of the model): ``model_index.json`` as diffusers writes it, weights as safetensors (or ``.bin`` pickles under
diffusers' and transformers' names, as ``save_pretrained(safe_serialization=False)``), text-encoder weights with
the ``text_model.`` level and tokenizers with ``vocab.json`` / ``merges.txt`` so that transformers 4 reads them too.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from library.families.protocol import ModelFamily
from library.files.weights import save_state_dict

from ..base import FamilySpec, Parts
from ..convert import VAE_PREFIX, hf_state_dict, vae_to_ldm
from ..loading import META_CONFIGS, META_FAMILY, shipped_configs
from ..saving import _save_weights, atomic_dir, clean_config
from ..tokenizers import write_vocab_files
from .convert import text_encoder_to_ldm, unet_to_ldm
from .loading import subfolder

IMPL_SGM = "https://github.com/Stability-AI/generative-models"


def model_configs(parts: Parts) -> dict:
    """The component configs of ``parts`` as JSON-able data (what ``sdtrain.configs`` stores)."""
    return {
        "family": parts.family,
        "unet": clean_config(parts.denoiser.config),
        "vae": clean_config(parts.vae.config),
        "text_encoders": [clean_config(te.config.to_dict()) for te in parts.text_encoders],
        "scheduler": dict(parts.scheduler_config),
    }


def modelspec(architecture: str, resolution: int, prediction_type: str, title: str) -> dict[str, str]:
    """ModelSpec 1.0.1 metadata for a full checkpoint, as sd-scripts writes it (``sai_model_spec.py``)."""
    return {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": architecture,
        "modelspec.implementation": IMPL_SGM,
        "modelspec.title": title,
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
        "modelspec.prediction_type": "v" if prediction_type == "v_prediction" else "epsilon",
    }


def single_file_state_dict(spec: FamilySpec, parts: Parts) -> dict[str, Tensor]:
    """All weights of ``parts`` under single-file keys (UNet, VAE, text encoders, v-prediction markers)."""
    sd = unet_to_ldm(parts.denoiser)
    sd.update({VAE_PREFIX + k: v for k, v in vae_to_ldm(parts.vae.state_dict(), parts.vae.config).items()})
    extras = parts.text_encoder_extras or [{} for _ in parts.text_encoders]
    for te, te_spec, extra in zip(parts.text_encoders, spec.text_encoders, extras):
        add_block = te_spec.final_block_after is not None and te.config.num_hidden_layers == te_spec.final_block_after
        converted = text_encoder_to_ldm(te, te_spec.layout, extra, add_block)
        sd.update({te_spec.prefix + k: v for k, v in converted.items()})
    if parts.prediction_type == "v_prediction":
        sd["v_pred"] = torch.tensor([])
    if parts.scheduler_config.get("rescale_betas_zero_snr"):
        sd["ztsnr"] = torch.tensor([])
    return sd


def save_single_file(
    spec: FamilySpec, parts: Parts, path: Path, dtype: torch.dtype | None, metadata: Mapping[str, str]
) -> Path:
    """Write ``parts`` to ``path`` (.safetensors / .ckpt) atomically; ``metadata`` is merged over our own keys."""
    meta = {META_FAMILY: spec.name, META_CONFIGS: json.dumps(model_configs(parts)), **metadata}
    return save_state_dict(single_file_state_dict(spec, parts), path, meta, dtype)


def save_diffusers(
    spec: FamilySpec, parts: Parts, folder: Path, dtype: torch.dtype | None, safetensors: bool = True
) -> Path:
    """Write ``parts`` as a diffusers pipeline folder loadable by ``DiffusionPipeline.from_pretrained``; the
    weights as safetensors, or (``safetensors=False``) as the ``.bin`` pickles diffusers and transformers write."""
    suffix = ".safetensors" if safetensors else ".bin"
    model, text_model = "diffusion_pytorch_model" + suffix, ("model" if safetensors else "pytorch_model") + suffix
    with atomic_dir(folder) as tmp:
        make_pipeline(spec, parts).save_config(tmp)  # model_index.json, exactly as diffusers writes it
        for name, module in (("unet", parts.denoiser), ("vae", parts.vae)):
            module.save_config(tmp / name)
            _save_weights(module.state_dict(), tmp / name / model, dtype)
        for i, (te, tok) in enumerate(zip(parts.text_encoders, parts.tokenizers)):
            te.config.save_pretrained(tmp / subfolder(i))
            _save_weights(hf_state_dict(te), tmp / subfolder(i) / text_model, dtype)
            tok.save_pretrained(tmp / subfolder(i, "tokenizer"))
            if len(tok) == 49408 and not (tmp / subfolder(i, "tokenizer") / "vocab.json").exists():
                write_vocab_files(tmp / subfolder(i, "tokenizer"))
        _scheduler(spec, parts.scheduler_config).save_pretrained(tmp / "scheduler")
    return folder


def _scheduler(spec: FamilySpec, config: Mapping[str, Any]) -> Any:
    import diffusers

    name = config.get("_class_name") or shipped_configs(next(iter(spec.configs.values())))["scheduler"]["_class_name"]
    cls = getattr(diffusers, name, None) or diffusers.DDIMScheduler
    return cls.from_config({k: v for k, v in config.items() if k != "_class_name"})


def make_pipeline(spec: FamilySpec, parts: Parts, scheduler: Any = None) -> Any:
    """A diffusers pipeline of class ``spec.pipeline_class`` over ``parts`` (the same modules, no copies).

    Writes ``model_index.json`` (scheduler from the model's config) and samples (``family.pipeline``, with the
    sampler's ``scheduler``).
    """
    import diffusers

    components: dict[str, Any] = {"unet": parts.denoiser, "vae": parts.vae}
    components["scheduler"] = scheduler if scheduler is not None else _scheduler(spec, parts.scheduler_config)
    for i, (te, tok) in enumerate(zip(parts.text_encoders, parts.tokenizers)):
        components[subfolder(i)] = te
        components[subfolder(i, "tokenizer")] = tok
    if spec.pipeline_class == "StableDiffusionPipeline":
        components.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    else:
        components.update(add_watermarker=False)
    return getattr(diffusers, spec.pipeline_class)(**components)


def save_model(
    spec: FamilySpec,
    parts: Parts,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None,
    metadata: Mapping[str, str],
    safetensors: bool = True,
) -> Path:
    """``path`` ending in .safetensors / .ckpt: a single file; anything else: a diffusers folder (its weights in
    safetensors, or ``.bin`` with ``safetensors=False``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".safetensors", ".ckpt"):
        return save_single_file(spec, parts, path, dtype, metadata)
    if suffix in (".pt", ".pth", ".bin"):
        raise ValueError(f"{path}: save a full model as .safetensors or .ckpt (or a folder name for diffusers)")
    return save_diffusers(spec, parts, path, dtype, safetensors)


def save_family_model(
    family: ModelFamily,
    parts: Parts,
    path: str | os.PathLike,
    dtype: torch.dtype | None,
    metadata: Mapping[str, str] | None,
    safetensors: bool = True,
) -> Path:
    """``family.save``: modelspec for the family and prediction type, then :func:`save_model`."""
    if parts.family != family.name:
        raise ValueError(f"cannot save a {parts.family} model with the {family.name} family")
    pred = parts.prediction_type
    arch = family.modelspec_architecture("", pred)
    meta = modelspec(arch, family.default_resolution(pred), pred, Path(path).stem)
    meta = {**meta, **(metadata or {})}
    return save_model(family.spec, parts, path, dtype=dtype, metadata=meta, safetensors=safetensors)
