"""Loading PixArt-α / PixArt-Σ as users have it, without the hub.

* ``path``: the official checkpoint (``PixArt-XL-2-1024-MS.pth``, ``PixArt-Sigma-XL-2-1024-MS.pth``: a pickle read with
  ``torch.load(weights_only=True)``, its tensors under ``state_dict``; or the same as ``.safetensors``, also under
  ComfyUI's ``model.diffusion_model.``), a diffusers ``PixArtTransformer2DModel`` single file, or a diffusers
  ``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` folder (``transformer/``, ``text_encoder/``, ``tokenizer/``,
  ``vae/``, ``scheduler/``).
* ``t5xxl`` / ``vae`` (``--t5xxl --vae``): the T5-XXL encoder (transformers names, fp8 too, or a folder) and the VAE
  (LDM or diffusers names, or a folder) beside a single file; a folder's own parts otherwise (a flag replaces them).

α or Σ (``variant_of_keys``): a file our writer saved says it (``sdtrain.family``); else the micro-condition embedders
(α 1024) or the null caption's rows (``y_embedder.y_embedding``: 120 α, 300 Σ) tell; else Σ (ComfyUI's rule: no
``ar_embedder`` is Σ). A folder: ``model_index.json``'s pipeline class.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autoencoders import flux_ae
from ..base import PartDtypes, Parts
from ..convert import strip_prefix, vae_diffusers_rename_old, vae_from_ldm, vae_ldm_keys
from ..encoders import t5
from ..loading import META_FAMILY, check_weights_path, finish, instantiate, instantiate_fitting, shape_reader
from ..part_files import ModelFiles, PartSource
from . import keys as K
from .model import ALPHA, PIPELINES, SIGMA, TOKENS, config_from_weights, released, transformer_factory

log = logging.getLogger(__name__)

PART_SOURCES = (PartSource("--t5xxl", "text_encoder", "T5-XXL"), PartSource("--vae", "vae", "VAE"))


def variant_of_folder(folder: Path) -> str | None:
    """ "pixart_alpha" / "pixart_sigma" for a diffusers PixArt pipeline folder, else None."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return None
    name = json.loads(index.read_text()).get("_class_name")
    return next((v for v, cls in PIPELINES.items() if cls == name), None)


def variant_of_keys(keys: list[str], metadata: Mapping[str, str], shape: Any = None) -> str | None:
    """α or Σ from a file's keys (module docstring); None when they are no PixArt transformer."""
    if metadata.get(META_FAMILY) in (ALPHA, SIGMA):
        return metadata[META_FAMILY]
    names = [k.removeprefix("transformer.") for k in keys]  # a diffusers file may keep the pipeline's prefix
    if not (K.is_official(names) or K.is_diffusers(names)):
        return None
    if K.has_micro_conditions(names):
        return ALPHA
    y = next((k for k in keys if K.strip(k) == K.Y_EMBEDDING), None)
    if y is not None and shape is not None and shape(y)[0] == TOKENS[ALPHA]:
        return ALPHA
    return SIGMA


def check_path(path: str | Path) -> Path:
    return check_weights_path(path, "--pretrained_model_name_or_path", variant_of_folder,
                              "a PixArt .pth / .safetensors file or a diffusers PixArt pipeline folder",
                              "not a diffusers PixArt folder (no model_index.json of a PixArt pipeline)")  # fmt: skip


def load_transformer_file(path: Path, state: Mapping[str, Any], stored: Mapping | None, variant: str, dtype: Any,
                          device: Any, tiny: Mapping | None) -> tuple[nn.Module, dict[str, torch.Tensor]]:  # fmt: skip
    """The transformer of an official or diffusers single file -> (module, the official extras it held: ``pos_embed``,
    ``y_embedder.y_embedding``, kept to be written back)."""
    keys = list(state.keys())
    if K.is_official(keys):
        extras = {K.strip(k): state[k] for k in keys if K.strip(k) in K.EXTRA}
        named: Mapping[str, Any] = K.official_to_diffusers({k: state[k] for k in keys})
        depth = K.depth(keys)
    else:
        named = strip_prefix(state, "transformer.") if any(k.startswith("transformer.") for k in keys) else state
        extras, depth = {}, 1 + max(int(k.split(".")[1]) for k in named if k.startswith("transformer_blocks."))
    if stored and "transformer" in stored:
        config, source = dict(stored["transformer"]), "the configs stored in the file"
    else:
        base = released(variant)["transformer"]
        if tiny is not None and depth == tiny["transformer"]["num_layers"]:
            base = dict(tiny["transformer"])
        config = config_from_weights(named, shape_reader(named), base, depth)
        if "y_embedder.y_embedding" in extras and config["caption_channels"] != extras[K.Y_EMBEDDING].shape[1]:
            raise ValueError(f"{path}: y_embedder.y_embedding does not match the caption projection's width")
        source = "the shapes of its weights"
    model = instantiate(transformer_factory(config), named, "transformer", path, source, dtype, device=device)
    return model, extras


def read_vae(path: Path, state: Mapping[str, Any], candidates: list[tuple[dict, str]], dtype: Any, device: Any,
             where: str) -> nn.Module:  # fmt: skip
    """An SD-style 4-channel ``AutoencoderKL`` from LDM names (``first_stage_model.`` or bare) or diffusers names."""
    ldm_state = vae_ldm_keys(dict(state.items()))
    if ldm_state:

        def adapt(source, model):
            return vae_from_ldm(source, model.config, model.state_dict().keys())

        return instantiate_fitting(candidates, flux_ae.factory, ldm_state, f"VAE ({where})", path, dtype, device, adapt)
    named = vae_diffusers_rename_old(strip_prefix(state, "vae.") or dict(state.items()))
    if not any(k.startswith("encoder.down_blocks.") for k in named):
        raise ValueError(f"{where} {path}: no VAE weights found; expected LDM keys (encoder.down.0.block.0...) or "
                         "diffusers keys (encoder.down_blocks.*)")  # fmt: skip
    return instantiate_fitting(candidates, flux_ae.factory, named, f"VAE ({where})", path, dtype, device)


def load_pixart(variant: str, path: str | Path, *, dtype: Any = torch.float32, device: Any = "cpu",
                t5xxl: str | Path | None = None, vae: str | Path | None = None, tokenizer_cache_dir: str | None = None,
                tiny: Mapping | None = None) -> tuple[Parts, dict[str, torch.Tensor]]:  # fmt: skip
    """``variant`` from ``path`` and the part files (module docstring) -> (frozen parts, the official extras)."""
    dtypes = PartDtypes.of(dtype)
    path = check_path(path)
    files = ModelFiles(path, PART_SOURCES, {"--t5xxl": t5xxl, "--vae": vae})
    if files.folder is not None:
        found = variant_of_folder(path)
    else:
        found = variant_of_keys(list(files.state.keys()), files.metadata, shape_reader(files.state))
        if found is None:
            raise ValueError(f"{path}: no PixArt transformer found (no t_block.1.weight and no diffusers "
                             "adaln_single + caption_projection weights); pass PixArt-XL-2-1024-MS.pth, "
                             "PixArt-Sigma-XL-2-1024-MS.pth or a diffusers PixArt folder")  # fmt: skip
    if found != variant:
        raise ValueError(f"{path}: this is a {found} model, but {variant} was expected; load it as {found}")
    files.require(lambda missing: (f"{', '.join(missing)} required: the single file {path} holds the transformer "
                                   "only; pass the T5-XXL encoder (--t5xxl t5xxl_fp16.safetensors or a folder) and "
                                   "the VAE (--vae: the SD VAE for PixArt-α, the SDXL VAE for PixArt-Σ)"))  # fmt: skip
    configs = released(variant)
    stored = files.stored
    extras: dict[str, torch.Tensor] = {}
    if files.folder is None:
        denoiser, extras = load_transformer_file(path, files.state, stored, variant, dtypes.denoiser, device, tiny)
    else:
        from diffusers import PixArtTransformer2DModel

        denoiser = PixArtTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtypes.denoiser)

    def te_candidates(stored_here: Mapping | None) -> list[tuple[dict, str]]:
        if stored_here and stored_here.get("text_encoder"):
            return [(dict(stored_here["text_encoder"]), "the configs stored in the file")]
        return [(configs["text_encoder"], "the released config")] + (
            [(dict(tiny["text_encoder"]), "the tiny config")] if tiny else [])  # fmt: skip

    def read_t5(where_path: Path, state: Mapping, stored_here: Mapping | None, where: str) -> nn.Module:
        return t5.load(where_path, state, te_candidates(stored_here), dtypes.text_encoders, device, where=where,
                       what=f"T5-XXL ({where})")  # fmt: skip

    def read_vae_file(where_path: Path, state: Mapping, stored_here: Mapping | None, where: str) -> nn.Module:
        candidates = flux_ae.candidates(stored_here, configs["vae"], tiny and tiny["vae"], kind="VAE")
        return read_vae(where_path, state, candidates, dtypes.vae, device, where)

    def t5_folder(folder: Path) -> nn.Module:
        from transformers import T5EncoderModel

        from ..loading import _tf_dtype

        return T5EncoderModel.from_pretrained(folder, **_tf_dtype(dtypes.text_encoders))

    def vae_folder(folder: Path) -> nn.Module:
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_pretrained(folder, torch_dtype=dtypes.vae)

    encoder = files.load("--t5xxl", read_t5, t5_folder)
    vae_module = files.load("--vae", read_vae_file, vae_folder)
    tokenizer = t5.load_t5_tokenizer(files.root / "tokenizer" if files.root else None, tokenizer_cache_dir)
    scheduler = dict(configs["scheduler"])
    if stored and "scheduler" in stored:
        scheduler.update(stored["scheduler"])
    parts = Parts(denoiser, vae_module, [encoder], [tokenizer], scheduler, variant, str(path))
    return finish(parts, device), extras
