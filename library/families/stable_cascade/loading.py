"""Loading Stable Cascade stage C as users have it, without the hub.

* ``path``: Stability's ``stage_c.safetensors`` / ``stage_c_lite.safetensors`` (``nn.MultiheadAttention`` names; bf16
  files too), a file our writer saved (the same names, with ``sdtrain.configs``), or a diffusers
  ``StableCascadePriorPipeline`` folder (``prior/``, ``text_encoder/``, ``tokenizer/``).
* ``--text_model_checkpoint_path``: CLIP-bigG with projection under transformers names (``text_model.*``,
  ``text_projection.weight``: what the stable-cascade branch reads and writes); a folder's ``text_encoder/``
  otherwise (the flag replaces it).
* ``--effnet_checkpoint_path`` (or ``--vae``): Stability's ``effnet_encoder.safetensors`` (``backbone.*``,
  ``mapper.*``; a ``state_dict`` wrapper is read too), else a folder's ``effnet/effnet_encoder.safetensors`` (what
  sdtrain writes there). Without either ``Parts.vae`` is a ``MissingEncoder`` (generation needs none; asked for latents it names the flag).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base import PartDtypes, Parts
from ..encoders import clip
from ..loading import META_FAMILY, _tf_dtype, check_weights_path, instantiate, read_weights, shape_reader
from ..part_files import stored_configs
from ..tokenizers import PAD_OPEN_CLIP, load_clip_tokenizer
from .effnet import V2_S, EfficientNetEncoder, MissingEncoder, Stage, tiny_stages
from .model import CLIP_BIG_G, SCHEDULER, config_from_weights, is_prior, prior_factory, stability_to_diffusers

log = logging.getLogger(__name__)
PIPELINE = "StableCascadePriorPipeline"
NAME = "stable_cascade"
EFFNET_FOLDER, EFFNET_FILE = "effnet", "effnet_encoder.safetensors"  # our folders keep the encoder there


def is_prior_folder(folder: Path) -> bool:
    index = Path(folder) / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == PIPELINE


def detect(state: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return metadata.get(META_FAMILY) == NAME or is_prior(state.keys())


def check_path(path: str | Path) -> Path:
    return check_weights_path(path, "--pretrained_model_name_or_path", lambda p: NAME if is_prior_folder(p) else None,
                              "a Stable Cascade stage C .safetensors or a diffusers StableCascadePriorPipeline folder",
                              "not a diffusers Stable Cascade prior folder (no model_index.json of "
                              "StableCascadePriorPipeline)")  # fmt: skip


def read_prior(path: Path, dtype: Any, device: Any, tiny: Mapping | None) -> nn.Module:
    state, metadata = read_weights(path)
    if not is_prior(state.keys()):
        raise ValueError(f"{path}: no Stable Cascade stage C weights (no clip_txt_mapper.weight); pass "
                         "stage_c.safetensors / stage_c_lite.safetensors or a StableCascadePriorPipeline folder")  # fmt: skip
    stored = stored_configs(metadata) or {}
    named = stability_to_diffusers(state)
    fallback = stored.get("prior") or (tiny or {}).get("prior")
    config = config_from_weights(named, shape_reader(named), fallback)
    return instantiate(prior_factory(config), named, "stage C", path, "the shapes of its weights", dtype,
                       device=device)  # fmt: skip


def read_text_model(path: Path, dtype: Any, device: Any, tiny: Mapping | None) -> nn.Module:
    state, metadata = read_weights(path)
    state = state.get("state_dict", state) if "state_dict" in state else state
    candidates = [dict(CLIP_BIG_G)] + ([dict(tiny["text_encoder"])] if tiny else [])
    stored = (stored_configs(metadata) or {}).get("text_encoder")
    config = dict(stored) if stored else clip.config_from_shapes(state, shape_reader(state), candidates)
    if config is None or "text_projection.weight" not in state:
        raise ValueError(f"--text_model_checkpoint_path {path}: not a CLIP text model with projection under "
                         "transformers names (text_model.*, text_projection.weight)")  # fmt: skip
    return instantiate(clip.factory(config, with_projection=True), state, "CLIP-bigG", path, "its shapes", dtype,
                       device=device)  # fmt: skip


def effnet_stages(state: Mapping[str, Any]) -> tuple[tuple[Stage, ...], int, int]:
    """(stages, head width, latent channels) of an encoder file: the released V2-S, or the tiny test layout."""
    shape = shape_reader(state)
    stem = shape("backbone.0.0.weight")[0]
    stages = V2_S if stem == V2_S[0].width_in else tiny_stages()
    head, latent = shape("mapper.0.weight")[1], shape("mapper.0.weight")[0]
    return stages, head, latent


def read_effnet(path: Path, dtype: Any, device: Any) -> nn.Module:
    state, _ = read_weights(path)
    if "state_dict" in state:
        state = state["state_dict"]
    if "backbone.0.0.weight" not in state or "mapper.0.weight" not in state:
        raise ValueError(f"--effnet_checkpoint_path {path}: no EfficientNet encoder (backbone.*, mapper.*); pass "
                         "Stability's effnet_encoder.safetensors")  # fmt: skip
    stages, head, latent = effnet_stages(state)
    affine = "mapper.1.weight" in state  # Würstchen 2's mapper BatchNorm has affine weights
    return instantiate(lambda: EfficientNetEncoder(latent, stages, head, affine), state, "EfficientNet encoder", path,
                       "EfficientNetV2-S", dtype, device=device)  # fmt: skip


def load_cascade(path: str | Path, *, dtype: Any = torch.float32, device: Any = "cpu", effnet: str | Path | None = None,
                 text_model: str | Path | None = None, save_text_model: bool = False,
                 tokenizer_cache_dir: str | None = None, tiny: Mapping | None = None) -> Parts:  # fmt: skip
    """Frozen parts from ``path`` and the part files (module docstring); ``vae`` is the EfficientNet encoder."""
    dtypes = PartDtypes.of(dtype)
    path = check_path(path)
    folder = path if path.is_dir() else None
    if folder is None:
        prior = read_prior(path, dtypes.denoiser, device, tiny)
    else:
        from diffusers import StableCascadeUNet

        prior = StableCascadeUNet.from_pretrained(folder / "prior", torch_dtype=dtypes.denoiser)
    if text_model is not None and not save_text_model:
        encoder = read_text_model(Path(text_model), dtypes.text_encoders, device, tiny)
    elif folder is not None and (folder / "text_encoder" / "config.json").is_file():
        from transformers import CLIPTextModelWithProjection

        encoder = CLIPTextModelWithProjection.from_pretrained(
            folder / "text_encoder", **_tf_dtype(dtypes.text_encoders)
        )
        if save_text_model and text_model is not None:
            from library.files.weights import save_state_dict

            save_state_dict(encoder.state_dict(), Path(text_model), {}, None)
            log.info("wrote the text model to %s", text_model)
    else:
        raise ValueError(f"{path}: the single file holds stage C only; pass the CLIP-bigG text model with "
                         "--text_model_checkpoint_path (a .safetensors in transformers names, e.g. written by "
                         "--save_text_model from a diffusers stable-cascade-prior folder)")  # fmt: skip
    if effnet is None and folder is not None and (folder / EFFNET_FOLDER / EFFNET_FILE).is_file():
        effnet = folder / EFFNET_FOLDER / EFFNET_FILE
    effnet_module = read_effnet(Path(effnet), dtypes.vae, device) if effnet is not None else MissingEncoder()
    tokenizer = None
    if folder is not None and (folder / "tokenizer" / "tokenizer_config.json").is_file():
        from transformers import CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    elif tokenizer_cache_dir:
        cached = Path(tokenizer_cache_dir) / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k"
        if (cached / "tokenizer_config.json").is_file():
            from transformers import CLIPTokenizer

            tokenizer = CLIPTokenizer.from_pretrained(str(cached))
    tokenizer = tokenizer or load_clip_tokenizer(PAD_OPEN_CLIP)
    parts = Parts(prior, effnet_module, [encoder], [tokenizer], dict(SCHEDULER), NAME, str(path))
    for module in (prior, effnet_module, encoder):
        module.to(device).eval().requires_grad_(False)
    parts.text_encoder_extras = [{}]
    return parts
