"""Loading FLUX.1 dev / schnell and Chroma as users have them, without the hub.

* ``path``: the BFL single-file transformer (``flux1-dev.safetensors``; keys with or without
  ``model.diffusion_model.``; bf16, fp16 or float8_e4m3fn tensors, each cast to the load dtype as it is read), a
  diffusers ``FluxTransformer2DModel`` / ``ChromaTransformer2DModel`` single file, a diffusers transformer folder
  (``config.json`` + weights), or a full diffusers FLUX / Chroma folder (``transformer/``, ``vae/``,
  ``text_encoder/`` CLIP-L and ``text_encoder_2/`` T5 (Chroma: ``text_encoder/`` T5), tokenizers).
* ``clip_l`` / ``t5xxl`` / ``ae`` (sd-scripts' ``--clip_l --t5xxl --ae``): single files with transformers' CLIP names
  (``text_model.`` prefix or not), transformers' T5 names (``shared.weight`` + ``encoder.*``, or ``encoder.*`` only,
  fp8 too), and the AE under BFL / LDM names (``encoder.down.0.block.0...``, no quant convs) or diffusers names. Given
  with a diffusers folder they replace its parts. A part neither the folder nor a flag provides is an error naming
  the flag, raised before anything is read.

Configs: those stored in a file by our writer (``sdtrain.configs``), else the released model's
(``configs/<variant>.json``)
with the block counts read from the keys (as sd-scripts does), else the tiny test model's; the first whose shapes
fit every tensor is used, and a file none fits is a ``ValueError`` naming the file, the part and the first
differing keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from library.files.weights import load_state_dict

from ..base import PartDtypes, Parts
from ..convert import (
    clip_from_ldm,
    hf_for_model,
    strip_prefix,
    t5_names,
    vae_diffusers_rename_old,
    vae_from_ldm,
    vae_ldm_keys,
)
from ..loading import (
    META_CONFIGS,
    WEIGHT_SUFFIXES,
    KeyView,
    check_weights_path,
    finish,
    instantiate_fitting,
    read_weights,
)
from ..tokenizers import PAD_CLIP_L, load_tokenizers
from . import keys as K
from . import tiny
from .configs import ae_factory, clip_l_factory, released, t5_factory, transformer_factory
from .text import load_t5_tokenizer

log = logging.getLogger(__name__)

PIPELINE_CLASSES = ("FluxPipeline", "ChromaPipeline")
TRANSFORMER_CLASSES = ("FluxTransformer2DModel", "ChromaTransformer2DModel")


# ------------------------------------------------------------------------------------------------ reading files
def _keys(state: Mapping[str, Any]) -> list[str]:
    return list(state.keys())


# ------------------------------------------------------------------------------------------------ what a path is
def variant_of_folder(folder: Path) -> str | None:
    """The variant ("flux-dev" | "flux-schnell" | "chroma") of a diffusers FLUX / Chroma pipeline or transformer
    folder, else None."""
    config = _transformer_config_file(folder)
    if config is None:
        return None
    data = json.loads(config.read_text())
    if data.get("_class_name") == "ChromaTransformer2DModel":
        return "chroma"
    return "flux-dev" if data.get("guidance_embeds") else "flux-schnell"


def _transformer_config_file(folder: Path) -> Path | None:
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            try:
                if json.loads(candidate.read_text()).get("_class_name") in TRANSFORMER_CLASSES:
                    return candidate
            except json.JSONDecodeError:
                return None
    return None


def variant_of_keys(keys: list[str]) -> str | None:
    """The variant of a single-file state dict's keys: a BFL transformer (prefix or not) or a diffusers one."""
    if K.is_bfl(keys):
        return _variant(K.bfl_layout(keys))
    stripped = [k.removeprefix("transformer.") for k in keys]
    if K.is_diffusers(stripped):
        return _variant(K.diffusers_layout(stripped))
    return None


def _variant(layout: K.Layout) -> str:
    return {"dev": "flux-dev", "schnell": "flux-schnell", "chroma": "chroma"}[K.variant_name(layout)]


# ------------------------------------------------------------------------------------------------ configs that fit
def _with_blocks(config: dict, layout: K.Layout) -> dict:
    config = dict(config, num_layers=layout.num_double, num_single_layers=layout.num_single)
    if layout.variant == K.CHROMA:
        config["approximator_layers"] = layout.approximator_layers
    else:
        config["guidance_embeds"] = layout.guidance
    return config


def transformer_candidates(variant: str, layout: K.Layout, stored: Mapping | None) -> list[tuple[dict, str]]:
    """Stored config, else the released one, else the tiny one (block counts from the weights)."""
    if stored is not None:
        return [(dict(stored["transformer"]), "the configs stored in the file")]
    tiny_config = dict(
        tiny.TRANSFORMER, **(tiny.CHROMA_EXTRA if variant == "chroma" else {"pooled_projection_dim": 32})
    )
    return [
        (_with_blocks(released(variant)["transformer"], layout), f"the released {variant} config"),
        (_with_blocks(tiny_config, layout), "the tiny test config"),
    ]


def _stored(metadata: Mapping[str, str]) -> dict | None:
    return json.loads(metadata[META_CONFIGS]) if META_CONFIGS in metadata else None


# ------------------------------------------------------------------------------------------------ the transformer
def load_transformer_file(
    path: Path, variant: str | None, dtype: Any, device: Any
) -> tuple[nn.Module, str, dict | None]:
    """A BFL or diffusers transformer single file -> (module, variant, stored configs or None)."""
    state, metadata = read_weights(path)
    keys = _keys(state)
    found = variant_of_keys(keys)
    if found is None:
        raise ValueError(
            f"{path}: no FLUX.1 / Chroma transformer found (no double_blocks.0.img_attn.qkv.weight and no diffusers "
            "transformer_blocks.0.attn.add_k_proj.weight); pass the BFL transformer file (flux1-dev.safetensors) or "
            "a diffusers FLUX folder"
        )
    if variant is not None and found != variant:
        raise ValueError(f"{path}: this is a {found} model, but {variant} was expected; load it as {found}")
    stored = _stored(metadata)
    if K.is_bfl(keys):
        view = K.BflToDiffusers(state)
        missing = view.missing_sources()
        if missing:
            raise ValueError(f"{path}: the BFL transformer lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
                             " (a truncated or partial file?)")  # fmt: skip
        unused = [k for k in view.unused_sources() if k.removeprefix(view.prefix).split(".")[0] in K.TOP_MODULES]
        if unused:
            raise ValueError(
                f"{path}: transformer weights this {found} model has no place for: {', '.join(unused[:3])}"
            )
        state, layout = view, view.layout
    else:
        if any(k.startswith("transformer.") for k in keys):
            state = strip_prefix(state, "transformer.")
        layout = K.diffusers_layout(_keys(state))
    candidates = transformer_candidates(found, layout, stored)
    module = instantiate_fitting(candidates, transformer_factory, state, "transformer", path, dtype, device)
    return module, found, stored


def load_transformer_folder(folder: Path, dtype: Any, device: Any) -> nn.Module:
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    config = _transformer_config_file(folder)
    sub = config.parent
    cls = ChromaTransformer2DModel if json.loads(config.read_text())["_class_name"].startswith("Chroma") else (
        FluxTransformer2DModel)  # fmt: skip
    return cls.from_pretrained(sub, torch_dtype=dtype).to(device)


# ------------------------------------------------------------------------------------------------ text encoders, AE
def load_clip_l(path: Path, dtype: Any, device: Any, stored: Mapping | None = None) -> nn.Module:
    """``--clip_l``: transformers ``CLIPTextModel`` keys, with or without ``text_model.`` (or under
    ``text_encoders.clip_l.transformer.``)."""
    state, metadata = load_state_dict(path)
    for prefix in ("text_encoders.clip_l.transformer.", "cond_stage_model.transformer."):
        if any(k.startswith(prefix) for k in state):
            state = strip_prefix(state, prefix)
    if not any("encoder.layers.0.self_attn.q_proj.weight" in k for k in state):
        raise ValueError(f"--clip_l {path}: no CLIP text encoder weights (expected transformers CLIPTextModel keys "
                         "such as text_model.encoder.layers.0.self_attn.q_proj.weight)")  # fmt: skip
    canonical = {k: v for k, v in clip_from_ldm(state).items() if not k.startswith(("text_projection", "logit_scale"))}
    stored = _stored(metadata) or stored
    candidates = _te_candidates(stored, 0, "flux-dev", tiny.CLIP_L)
    return instantiate_fitting(
        candidates, clip_l_factory, canonical, "CLIP-L (--clip_l)", path, dtype, device, hf_for_model
    )


def load_t5(path: Path, dtype: Any, device: Any, stored: Mapping | None = None, variant: str = "flux-dev") -> nn.Module:
    """``--t5xxl``: transformers T5 encoder keys (see :func:`t5_names`), read tensor by tensor from .safetensors;
    fp8 files are cast to ``dtype``."""
    source, metadata = read_weights(path)
    state = KeyView(source, t5_names(list(source.keys())))
    if "encoder.block.0.layer.0.SelfAttention.q.weight" not in state:
        raise ValueError(f"--t5xxl {path}: no T5 encoder weights (expected transformers T5 keys such as "
                         "encoder.block.0.layer.0.SelfAttention.q.weight)")  # fmt: skip
    stored = _stored(metadata) or stored
    index = 0 if variant == "chroma" else 1
    candidates = _te_candidates(stored, index, variant, tiny.T5)
    return instantiate_fitting(candidates, t5_factory, state, "T5 (--t5xxl)", path, dtype, device)


def _te_candidates(stored: Mapping | None, index: int, variant: str, tiny_config: Mapping) -> list[tuple[dict, str]]:
    if stored is not None and len(stored.get("text_encoders", [])) > index:
        return [(dict(stored["text_encoders"][index]), "the configs stored in the file")]
    return [(released(variant)["text_encoders"][index], "the released config"), (dict(tiny_config), "the tiny config")]


def load_ae(path: Path, dtype: Any, device: Any, stored: Mapping | None = None) -> nn.Module:
    """``--ae``: the 16-channel AE under BFL / LDM names (``encoder.down.0.block.0...``, also under
    ``first_stage_model.`` / ``vae.``) or diffusers names, or a diffusers VAE folder."""
    from diffusers import AutoencoderKL

    if path.is_dir():
        sub = path / "vae" if (path / "vae" / "config.json").is_file() else path
        if not (sub / "config.json").is_file():
            raise ValueError(f"--ae {path}: not a diffusers VAE folder (no config.json or vae/config.json)")
        return AutoencoderKL.from_pretrained(sub, torch_dtype=dtype).to(device)
    state, metadata = load_state_dict(path)
    stored = _stored(metadata) or stored
    candidates = (
        [(stored["vae"], "the configs stored in the file")]
        if stored and "vae" in stored
        else [(released("flux-dev")["vae"], "the released AE config"), (dict(tiny.AE), "the tiny AE config")]
    )
    ldm = vae_ldm_keys(state)
    if ldm:
        if any(k.startswith(("quant_conv.", "post_quant_conv.")) for k in ldm):
            raise ValueError(f"--ae {path}: this VAE has quant convs (an SD/SDXL VAE?); FLUX's AE has none")

        def adapt(source, model):
            return vae_from_ldm(source, model.config, model.state_dict().keys())

        return instantiate_fitting(candidates, ae_factory, ldm, "AE (--ae)", path, dtype, device, adapt)
    state = vae_diffusers_rename_old(strip_prefix(state, "vae.") or state)
    if not any(k.startswith("encoder.down_blocks.") for k in state):
        raise ValueError(f"--ae {path}: no AE weights found; expected BFL/LDM keys (encoder.down.0.block.0...) or "
                         "diffusers keys (encoder.down_blocks.*)")  # fmt: skip
    return instantiate_fitting(candidates, ae_factory, state, "AE (--ae)", path, dtype, device)


# ------------------------------------------------------------------------------------------------ the whole model
def check_flux_path(path: str | Path, flag: str = "--pretrained_model_name_or_path") -> Path:
    return check_weights_path(
        path, flag, variant_of_folder, "a FLUX.1 / Chroma BFL .safetensors file or a diffusers FLUX folder",
        "not a diffusers FLUX / Chroma folder (no transformer/config.json of a FluxTransformer2DModel or "
        "ChromaTransformer2DModel)",
    )  # fmt: skip


def load_flux(
    variant: str,
    path: str | Path,
    *,
    dtype: Any = torch.float32,
    device: Any = "cpu",
    clip_l: str | Path | None = None,
    t5xxl: str | Path | None = None,
    ae: str | Path | None = None,
    tokenizer_cache_dir: str | None = None,
) -> Parts:
    """Load a ``variant`` ("flux-dev" | "flux-schnell" | "chroma") model from ``path`` and the part files (module
    docstring); ``dtype``: one dtype or :class:`PartDtypes`. Parts come back frozen, in eval mode, on ``device``."""
    dtypes = PartDtypes.of(dtype)
    path = check_flux_path(path)
    extra = {f: Path(p) for f, p in (("--clip_l", clip_l), ("--t5xxl", t5xxl), ("--ae", ae)) if p is not None}
    for flag, p in extra.items():
        if not p.exists():
            raise FileNotFoundError(f"{flag} {p}: no such file")
        if p.is_file() and p.suffix.lower() not in WEIGHT_SUFFIXES:
            raise ValueError(f"{flag} {p}: unsupported file type {p.suffix!r}; expected .safetensors")
    folder = path if path.is_dir() else None
    pipeline_root = folder if folder is not None and (folder / "transformer" / "config.json").is_file() else None
    found = variant_of_folder(path) if folder else None
    if folder is not None and found != variant:
        raise ValueError(f"{path}: this is a {found} model, but {variant} was expected; load it as {found}")
    te_folders = ["text_encoder"] if variant == "chroma" else ["text_encoder", "text_encoder_2"]
    has = lambda sub: pipeline_root is not None and (pipeline_root / sub / "config.json").is_file()  # noqa: E731
    needed = [("--ae", "vae")] + ([] if variant == "chroma" else [("--clip_l", "text_encoder")])
    needed += [("--t5xxl", te_folders[-1])]
    missing = [flag for flag, sub in needed if flag not in extra and not has(sub)]
    if missing:
        where = "a BFL single-file transformer" if folder is None else f"the diffusers folder {path} (it has no " + (
            ", ".join(f"{s}/" for f, s in needed if f in missing)) + ")"  # fmt: skip
        parts_needed = "the T5-XXL encoder and the AE" if variant == "chroma" else "CLIP-L, T5-XXL and the AE"
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with {where}: FLUX "
                         f"needs {parts_needed}"
                         "; pass the single files as sd-scripts does (e.g. --clip_l clip_l.safetensors --t5xxl "
                         "t5xxl_fp16.safetensors --ae ae.safetensors)")  # fmt: skip
    if variant == "chroma" and "--clip_l" in extra:
        log.warning("--clip_l is ignored: Chroma has no CLIP-L text encoder")
    stored = None
    if folder is None:
        denoiser, _, stored = load_transformer_file(path, variant, dtypes.denoiser, device)
    else:
        denoiser = load_transformer_folder(folder, dtypes.denoiser, device)
    vae = (load_ae(extra["--ae"], dtypes.vae, device, stored) if "--ae" in extra else
           _from_folder(pipeline_root, "vae", dtypes.vae, device))  # fmt: skip
    encoders = []
    if variant != "chroma":
        encoders.append(load_clip_l(extra["--clip_l"], dtypes.text_encoders, device, stored) if "--clip_l" in extra
                        else _from_folder(pipeline_root, te_folders[0], dtypes.text_encoders, device))  # fmt: skip
    encoders.append(load_t5(extra["--t5xxl"], dtypes.text_encoders, device, stored, variant) if "--t5xxl" in extra
                    else _from_folder(pipeline_root, te_folders[-1], dtypes.text_encoders, device))  # fmt: skip
    tokenizers = _tokenizers(variant, pipeline_root, tokenizer_cache_dir)
    scheduler = _scheduler_config(variant, pipeline_root, stored)
    parts = Parts(denoiser, vae, encoders, tokenizers, scheduler, variant, str(path))
    return finish(parts, device)


def _from_folder(root: Path, sub: str, dtype: Any, device: Any) -> nn.Module:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, T5EncoderModel

    from ..loading import _tf_dtype

    config = json.loads((root / sub / "config.json").read_text())
    if sub == "vae":
        return AutoencoderKL.from_pretrained(root / sub, torch_dtype=dtype).to(device)
    cls = T5EncoderModel if config.get("model_type") == "t5" else CLIPTextModel
    return cls.from_pretrained(root / sub, **_tf_dtype(dtype)).to(device)


def _tokenizers(variant: str, root: Path | None, cache_dir: str | None) -> list:
    if variant == "chroma":
        return [load_t5_tokenizer(root / "tokenizer" if root else None, cache_dir)]
    from ..base import TextEncoderSpec

    clip_spec = TextEncoderSpec("", "clip", False, PAD_CLIP_L, "openai/clip-vit-large-patch14", "clip_l")
    clip = load_tokenizers([clip_spec], root, cache_dir)[0]
    return [clip, load_t5_tokenizer(root / "tokenizer_2" if root else None, cache_dir)]


def _scheduler_config(variant: str, root: Path | None, stored: Mapping | None) -> dict:
    config = released(variant)["scheduler"]
    if stored is not None and "scheduler" in stored:
        config.update(stored["scheduler"])
    file = root / "scheduler" / "scheduler_config.json" if root is not None else None
    if file is not None and file.is_file():
        config.update({k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")})
    config["prediction_type"] = "flow_matching"
    return config
