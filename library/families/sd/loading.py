"""Loading a Stable Diffusion model: a diffusers folder or a single-file checkpoint, without the hub.

Single files are built from component configs: those stored in the file by our writer (``sdtrain.configs``
metadata, so tiny and non-standard models reload exactly), else the configs of the released model shipped in
``configs/``. Every weight is checked against the architecture before loading; a mismatch is a ``ValueError``
naming the file, the component, the config used and the first differing keys.

Prediction type, in order: the ``v_parameterization`` argument (``--v_parameterization``) > a ``v_pred`` marker key
(ComfyUI / Forge convention) > configs stored by us > ``modelspec.prediction_type`` metadata > a family heuristic
(SD2: see ``family.py``) > epsilon. A ``ztsnr`` key (or stored ``rescale_betas_zero_snr``) marks zero-terminal-SNR.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import SafetensorsReader, load_state_dict, mmap_disabled

from ..base import FamilySpec, PartDtypes, Parts
from ..convert import hf_for_model, strip_prefix, vae_diffusers_rename_old, vae_from_ldm, vae_ldm_keys
from ..encoders.clip import factory as text_encoder_factory
from ..encoders.clip import text_encoder_class
from ..loading import (
    META_CONFIGS,
    _tf_dtype,
    check_model_path,
    family_of_folder,
    family_of_state_dict,
    finish,
    instantiate,
    shipped_configs,
)
from ..registry import family_title, get_family
from ..tokenizers import load_tokenizers
from .convert import UNET_PREFIX, text_encoder_from_ldm, unet_from_ldm

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ detection
def sd_family_of_keys(sd: Mapping[str, Any]) -> str | None:
    """ "sd1" | "sd2" | "sdxl" for a single-file state dict's keys (and the context width), "sdxl-refiner", or None:
    the text encoder keys, then the UNet (SDXL's ``label_emb``, else the context width 1024 of SD2, as diffusers'
    ``infer_diffusers_model_type``). The SD families' ``spec.detect``."""
    keys = sd.keys()
    if any(k.startswith("conditioner.embedders.0.model.") for k in keys):
        return "sdxl-refiner"  # OpenCLIP-bigG alone: not supported, but named in the error
    if any(k.startswith("conditioner.embedders.1.") for k in keys) or UNET_PREFIX + "label_emb.0.0.weight" in keys:
        return "sdxl"
    if any(k.startswith("cond_stage_model.model.") for k in keys):
        return "sd2"
    if any(k.startswith("cond_stage_model.transformer.") for k in keys):
        return "sd1"
    to_k = sd.get(UNET_PREFIX + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight")
    if to_k is not None:
        return "sd2" if to_k.shape[-1] == 1024 else "sd1"
    return None


def refuse_refiner(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> str | None:
    """SDXL's ``spec.refuse``: a refiner checkpoint (OpenCLIP-bigG alone) is named in detection errors."""
    return "an SDXL refiner, which is not supported" if sd_family_of_keys(sd) == "sdxl-refiner" else None


def sd_family_of_folder(folder: Path) -> str | None:
    """ "sd1" | "sd2" | "sdxl" of a diffusers folder (``unet/config.json``), or None if it is none. The SD families'
    ``spec.detect_folder``."""
    if not (folder / "unet" / "config.json").is_file():
        return None
    index = _read_json(folder / "model_index.json") or {}
    if (folder / "text_encoder_2").is_dir() or "XL" in str(index.get("_class_name", "")):
        return "sdxl"
    te = _read_json(folder / "text_encoder" / "config.json")
    if te is not None:
        return "sd2" if te.get("hidden_act") == "gelu" else "sd1"
    return "sd2" if _read_json(folder / "unet" / "config.json").get("cross_attention_dim") == 1024 else "sd1"


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def wrong_family(spec: FamilySpec, path: Path, found: str | None) -> ValueError:
    """The error for a model of another family (or none)."""
    if found is None:
        return ValueError(
            f"{path}: no Stable Diffusion model found in this file (no model.diffusion_model.* / cond_stage_model.* "
            f"/ conditioner.* keys); expected a {spec.title} checkpoint"
        )
    return ValueError(
        f"{path}: this is an {family_title(found)} model, but an {spec.title} model was expected; load it as "
        f"{family_title(found)} ({get_family(found).spec.load_hint})"
    )


# ------------------------------------------------------------------------------------------------ prediction type
def resolve_prediction(
    spec: FamilySpec,
    flag: bool | None,
    sd: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    stored: Mapping | None,
) -> tuple[str, bool, str]:
    """``(prediction_type, zero_terminal_snr, where it came from)`` for a single file (see the module docstring)."""
    stored_sched = (stored or {}).get("scheduler", {})
    ztsnr = "ztsnr" in sd or bool(stored_sched.get("rescale_betas_zero_snr"))
    if flag is not None:
        return ("v_prediction" if flag else "epsilon"), ztsnr, "--v_parameterization"
    if "v_pred" in sd:
        return "v_prediction", ztsnr, "the v_pred key in the file"
    if stored_sched.get("prediction_type"):
        return stored_sched["prediction_type"], ztsnr, "the configs stored in the file"
    spec_value = metadata.get("modelspec.prediction_type", "").lower()
    if spec_value in ("v", "v_prediction", "epsilon", "eps"):
        pred = "v_prediction" if spec_value.startswith("v") else "epsilon"
        return pred, ztsnr, "modelspec.prediction_type metadata"
    guess = spec.guess_prediction(sd) if spec.guess_prediction else None
    if guess:
        return guess, ztsnr, f"the {spec.title} weight statistics (pass --v_parameterization to be explicit)"
    return "epsilon", ztsnr, "default: the file does not say"


def build_unet(
    config: Mapping, state: Mapping[str, Tensor], path: Path, source: str, dtype: Any, device: Any = None
) -> nn.Module:
    from diffusers import UNet2DConditionModel

    factory = lambda: UNet2DConditionModel.from_config(dict(config))  # noqa: E731
    return instantiate(factory, state, "UNet", path, source, dtype, device=device)


def build_vae(
    config: Mapping, state: Mapping[str, Tensor], path: Path, source: str, dtype: Any, device: Any = None
) -> nn.Module:
    from diffusers import AutoencoderKL

    factory = lambda: AutoencoderKL.from_config(dict(config))  # noqa: E731
    return instantiate(factory, state, "VAE", path, source, dtype, device=device)


# ------------------------------------------------------------------------------------------------ single files
def load_single_file(
    spec: FamilySpec,
    path: Path,
    dtype: Any,
    v_parameterization: bool | None,
    vae: str | Path | None = None,
    device: Any = None,
) -> Parts:
    """Read ``path`` and build the family's modules from it (tokenizers are added by the caller)."""
    sd, metadata = load_state_dict(path)
    return parts_from_single_file(spec, sd, metadata, path, dtype, v_parameterization, vae, device)


def parts_from_single_file(
    spec: FamilySpec,
    sd: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    path: Path,
    dtype: Any,
    v_parameterization: bool | None,
    vae_override: str | Path | None = None,
    device: Any = None,
) -> Parts:
    """Build the modules from a single-file state dict (``path`` only names it in messages); ``dtype``: one dtype
    or a :class:`PartDtypes`; each tensor goes to ``device`` as it is read."""
    dtypes = PartDtypes.of(dtype)
    found = family_of_state_dict(sd, metadata)
    if found is None and sd_family_of_keys(sd) == "sdxl-refiner":
        raise ValueError(f"{path}: SDXL refiner checkpoints are not supported (only SDXL base and its fine-tunes)")
    if found != spec.name:
        raise wrong_family(spec, path, found)
    stored = json.loads(metadata[META_CONFIGS]) if META_CONFIGS in metadata else None
    pred, ztsnr, why = resolve_prediction(spec, v_parameterization, sd, metadata, stored)
    log.info("%s: prediction type %s (from %s)", path, pred, why)
    if stored is not None:
        configs, source = stored, f"the configs stored in {path.name}"
    else:
        stem = spec.configs[pred]
        configs, source = shipped_configs(stem), f"the released {spec.title} model (shipped config {stem}.json)"
    try:
        unet_state = unet_from_ldm(sd, configs["unet"])
    except KeyError as e:
        raise ValueError(f"{path}: UNet key {UNET_PREFIX}{e.args[0]} does not exist in {source}") from e
    unet = build_unet(configs["unet"], unet_state, path, source, dtypes.denoiser, device)
    vae = _vae(sd, configs["vae"], path, source, dtypes.vae, vae_override, device)
    text_encoders, extras = [], []
    for te_spec, te_config in zip(spec.text_encoders, configs["text_encoders"]):
        state, extra = text_encoder_from_ldm(
            strip_prefix(sd, te_spec.prefix), te_spec.layout, te_config["num_hidden_layers"], te_spec.with_projection
        )
        factory = text_encoder_factory(te_config, te_spec.with_projection)
        what = f"text encoder ({te_spec.prefix}*)"
        te_dtype = dtypes.text_encoders
        text_encoders.append(
            instantiate(factory, state, what, path, source, te_dtype, adapt=hf_for_model, device=device)
        )
        extras.append({k: v.to(te_dtype) if v.is_floating_point() else v for k, v in extra.items()})
    scheduler = dict(configs["scheduler"], prediction_type=pred)
    if ztsnr:
        scheduler["rescale_betas_zero_snr"] = True
    return Parts(unet, vae, text_encoders, [], scheduler, spec.name, str(path), text_encoder_extras=extras)


def _vae(
    sd: Mapping[str, Tensor],
    config: Mapping,
    path: Path,
    source: str,
    dtype: Any,
    override: str | Path | None,
    device: Any = None,
) -> nn.Module:
    if override is not None:  # the file's own VAE is not even converted
        return load_vae(override, config, dtype, device)
    ldm = vae_ldm_keys(sd)
    if not ldm:
        raise ValueError(f"{path}: the checkpoint has no VAE (no first_stage_model.* keys); pass one with --vae")
    return _vae_from_ldm_file(ldm, config, path, source, dtype, device)


def _vae_from_ldm_file(
    ldm: Mapping[str, Tensor], config: Mapping, path: Path, source: str, dtype: Any, device: Any = None
) -> nn.Module:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    with init_empty_weights():
        keys = list(AutoencoderKL.from_config(dict(config)).state_dict())
    return build_vae(config, vae_from_ldm(ldm, config, keys), path, source, dtype, device)


# ------------------------------------------------------------------------------------------------ diffusers folders
def load_diffusers(
    spec: FamilySpec, folder: Path, dtype: Any, v_parameterization: bool | None, device: Any = None
) -> Parts:
    """Load a diffusers folder with diffusers / transformers (tokenizers are added by the caller); ``dtype``: one
    dtype or a :class:`PartDtypes`; each component goes to ``device`` as soon as it is read."""
    dtypes = PartDtypes.of(dtype)
    from diffusers import AutoencoderKL, UNet2DConditionModel

    found = family_of_folder(folder)
    if found != spec.name:
        raise wrong_family(spec, folder, found)
    subfolders = ["unet", "vae"] + [subfolder(i) for i in range(len(spec.text_encoders))]
    missing = [s for s in subfolders if not (folder / s / "config.json").is_file()]
    if missing:
        raise ValueError(f"{folder}: the diffusers model lacks {', '.join(f'{m}/config.json' for m in missing)}")
    no_mmap = {"disable_mmap": True} if mmap_disabled() else {}  # --disable_mmap_load_safetensors
    unet = _read_component(
        folder / "unet", build_unet, dtypes.denoiser, device
    ) or UNet2DConditionModel.from_pretrained(
        folder, subfolder="unet", torch_dtype=dtypes.denoiser, variant=_variant(folder / "unet"), **no_mmap
    ).to(device)
    vae = _read_component(folder / "vae", build_vae, dtypes.vae, device) or AutoencoderKL.from_pretrained(
        folder, subfolder="vae", torch_dtype=dtypes.vae, variant=_variant(folder / "vae"), **no_mmap
    ).to(device)
    text_encoders = []
    for i, te_spec in enumerate(spec.text_encoders):
        cls = text_encoder_class(te_spec.with_projection)
        sub = subfolder(i)
        te = cls.from_pretrained(folder / sub, variant=_variant(folder / sub), **_tf_dtype(dtypes.text_encoders))
        text_encoders.append(te.to(device))
    scheduler = _read_json(folder / "scheduler" / "scheduler_config.json")
    if scheduler is None:
        scheduler = shipped_configs(next(iter(spec.configs.values())))["scheduler"]
    if v_parameterization is not None:
        scheduler["prediction_type"] = "v_prediction" if v_parameterization else "epsilon"
    scheduler.setdefault("prediction_type", "epsilon")
    log.info("%s: prediction type %s", folder, scheduler["prediction_type"])
    return Parts(unet, vae, text_encoders, [], scheduler, spec.name, str(folder))


def _read_component(sub: Path, build: Callable, dtype: Any, device: Any = None) -> nn.Module | None:
    """A diffusers component stored in another dtype than ``dtype`` as one safetensors file, read and cast tensor by
    tensor (the peak is the model in ``dtype`` plus one tensor as stored; diffusers' loader holds the stored copy
    whole while it casts). None when no cast is needed (diffusers' memory map is the lighter way then: the kernel
    may drop clean pages) and for other layouts (sharded, variants, .bin, old key names): diffusers loads those."""
    files = list(sub.glob("*.safetensors"))
    if len(files) != 1 or not (sub / "config.json").is_file() or ".fp16." in files[0].name:
        return None
    reader = SafetensorsReader(files[0])
    stored = {reader.DTYPES.get(e["dtype"]) for e in reader.entries.values()}
    on_host = device is None or torch.device(device).type == "cpu"
    if (stored <= {dtype} and on_host) or not any(t is not None and t.is_floating_point for t in stored):
        return None
    config = json.loads((sub / "config.json").read_text())
    try:
        return build(config, reader, sub, f"{sub / 'config.json'}", dtype, device)
    except ValueError:  # keys of an older diffusers layout: diffusers' own loader renames them
        return None


def subfolder(index: int, kind: str = "text_encoder") -> str:
    return kind if index == 0 else f"{kind}_{index + 1}"


def _variant(folder: Path) -> str | None:
    """The variant "fp16" when a component folder only has ``*.fp16.*`` weight files (diffusers' variant naming)."""
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    plain = any(n.endswith((".safetensors", ".bin")) and ".fp16." not in n for n in names)
    return "fp16" if not plain and any(".fp16." in n for n in names) else None


# ------------------------------------------------------------------------------------------------ --vae
def load_vae(path: str | Path, config: Mapping, dtype: Any, device: Any = None) -> nn.Module:
    """A replacement VAE (``--vae``): a diffusers VAE folder (or a model folder with ``vae/``), a single file with
    ldm keys (``first_stage_model.*`` or bare ``encoder.down.*``), or a diffusers-format VAE weight file. Files are
    built with ``config``, the VAE architecture of the model being loaded."""
    from diffusers import AutoencoderKL

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--vae {path}: no such file or folder")
    if path.is_dir():
        sub = path / "vae" if (path / "vae" / "config.json").is_file() else path
        if not (sub / "config.json").is_file():
            raise ValueError(f"--vae {path}: not a diffusers VAE folder (no config.json or vae/config.json)")
        return AutoencoderKL.from_pretrained(sub, torch_dtype=dtype, variant=_variant(sub)).to(device)
    sd, _ = load_state_dict(path)
    config = dict(config)
    source = "the model's VAE config"
    ldm = vae_ldm_keys(sd)
    if ldm:
        return _vae_from_ldm_file(ldm, config, path, source, dtype, device)
    state = vae_diffusers_rename_old(strip_prefix(sd, "vae.") or sd)
    if not any(k.startswith("encoder.down_blocks.") for k in state):
        raise ValueError(
            f"--vae {path}: no VAE weights found; expected ldm keys (first_stage_model.encoder.down.*, or "
            "encoder.down.* in a VAE-only file) or diffusers keys (encoder.down_blocks.*)"
        )
    return build_vae(config, state, path, source, dtype, device)


def load_model(
    spec: FamilySpec,
    path: str | Path,
    *,
    dtype: Any = torch.float32,
    vae: str | Path | None = None,
    v_parameterization: bool | None = None,
    tokenizer_cache_dir: str | None = None,
    device: Any = "cpu",
) -> Parts:
    """Load a model of family ``spec`` from a diffusers folder or a single file (see ``ModelFamily.load``);
    ``dtype``: one dtype or a :class:`PartDtypes`; weights go to ``device`` as they are read."""
    path = check_model_path(path)
    if path.is_dir():
        parts = load_diffusers(spec, path, dtype, v_parameterization, device)
        if vae is not None:
            parts.vae = load_vae(vae, parts.vae.config, PartDtypes.of(dtype).vae, device)
    else:
        parts = load_single_file(spec, path, dtype, v_parameterization, vae, device)
    parts.tokenizers = load_tokenizers(spec.text_encoders, path if path.is_dir() else None, tokenizer_cache_dir)
    return finish(parts, device)


def reference_parts(spec: FamilySpec) -> Parts:
    """The released architecture of ``spec`` (denoiser and text encoders from its first shipped config) on the meta
    device: module names and shapes without weights or memory; ``vae`` is None (``ModelFamily.reference_parts``)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    configs = shipped_configs(next(iter(spec.configs.values())))
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(configs["unet"])
        tes = [text_encoder_factory(c, s.with_projection)() for c, s in zip(configs["text_encoders"],
                                                                              spec.text_encoders)]  # fmt: skip
    return Parts(unet, None, tes, [], configs["scheduler"], spec.name)
