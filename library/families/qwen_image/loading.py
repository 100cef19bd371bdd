"""Reading Qwen-Image's files: the DiT (``--dit``: the official / ComfyUI single file, bf16 or fp8, diffusers names
bare or under ``model.diffusion_model.``; or a diffusers Qwen-Image folder, whose ``transformer/`` is read), the
Qwen2.5-VL text encoder (``--text_encoder``, else the folder's ``text_encoder/``: ``encoders/qwen25vl.py``) and the
Qwen-Image VAE (``--vae``, diffusers or ComfyUI names, else the folder's ``vae/``: ``autoencoders/qwen_image.py``).
musubi-tuner's ``load_qwen_image_model`` / ``load_qwen2_5_vl`` / ``load_vae`` read the same files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autoencoders import qwen_image
from ..base import PartDtypes, Parts
from ..encoders import qwen25vl, qwen25vl_edit
from ..loading import KeyView, finish, instantiate_fitting, read_weights
from ..tokenizers import DeferredTokenizer
from . import model as M

log = logging.getLogger(__name__)

COMFY_PREFIX = "model.diffusion_model."
EDIT_2511_MARKER = "__index_timestep_zero__"


def is_dit(keys: Any) -> bool:
    keys = set(keys)
    return any(p + "txt_in.weight" in keys and p + "img_in.weight" in keys and
               p + "transformer_blocks.0.img_mod.1.weight" in keys for p in ("", COMFY_PREFIX))  # fmt: skip


def is_folder(path: Path) -> bool:
    index = Path(path) / "model_index.json"
    if index.is_file():
        try:
            return "QwenImage" in json.loads(index.read_text()).get("_class_name", "")
        except (ValueError, UnicodeDecodeError):
            return False
    config = Path(path) / "transformer" / "config.json"
    return config.is_file() and "QwenImage" in config.read_text()


def _weights(files: list[Path]) -> Mapping[str, Any]:
    readers = [read_weights(f)[0] for f in files]
    state = readers[0] if len(readers) == 1 else qwen25vl.MergedWeights(readers)
    if any(k.endswith(".scale_weight") for k in state.keys()):
        state = qwen25vl.Dequantized(state)
    return state


def dit_names(keys: list[str]) -> dict[str, str]:
    """diffusers key -> file key (``model.diffusion_model.`` stripped)."""
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX + "img_in.") for k in keys) else ""
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix) and k != EDIT_2511_MARKER}


def load_dit(path: Path, dtype: torch.dtype, device: Any, flag: str = "--dit", zero_cond_t: bool = False) -> nn.Module:
    """The DiT of a single file or a diffusers folder's ``transformer/``; config from the folder's config.json,
    else released / tiny / the weights' shapes. ``zero_cond_t``: the Edit-2511 DiT (``--model_version edit-2511``,
    as musubi-tuner's ``load_qwen_image_model`` sets it from the version: the weights' names are the same; its
    ComfyUI file's ``__index_timestep_zero__`` marker is dropped, and refused for the other versions)."""
    extra = {"zero_cond_t": True} if zero_cond_t else {}
    candidates = [(dict(M.RELEASED, **extra), "Qwen-Image (60 blocks)"), (dict(M.TINY, **extra), "the tiny test DiT")]
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{flag} {path}: no .safetensors in {folder}")
        if (folder / "config.json").is_file():
            cfg = json.loads((folder / "config.json").read_text())
            cfg = {k: v for k, v in cfg.items() if k in M.RELEASED or k == "zero_cond_t"}
            candidates.insert(0, (dict(M.RELEASED, **cfg, **extra), f"{folder}/config.json"))
        state = _weights(files)
    else:
        state = _weights([path])
    keys = list(state.keys())
    if EDIT_2511_MARKER in keys and not zero_cond_t:
        raise ValueError(f"{flag} {path}: a Qwen-Image-Edit-2511 DiT (its {EDIT_2511_MARKER} marker); train it with "
                         "--model_version edit-2511")  # fmt: skip
    if not is_dit(keys):
        raise ValueError(f"{flag} {path}: no Qwen-Image DiT weights (expected img_in.weight, txt_in.weight, "
                         "transformer_blocks.0.img_mod.1.weight, bare or under model.diffusion_model.)")  # fmt: skip
    view = KeyView(state, dit_names(keys))
    # (the shapes' config is the first candidate's with other sizes: it keeps zero_cond_t)
    return instantiate_fitting(candidates, M.factory, view, "Qwen-Image DiT", path, dtype, device,
                               derive=M.config_from_shapes)  # fmt: skip


def load_vae(path: Path, dtype: torch.dtype, device: Any, flag: str = "--vae") -> nn.Module:
    """diffusers or ComfyUI names; the released config, else the tiny one."""
    if path.is_dir():
        folder = path / "vae" if (path / "vae").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{flag} {path}: no .safetensors in {folder}")
        source = _weights(files)
    else:
        source, _ = read_weights(path)
    keys = list(source.keys())
    view = KeyView(source, qwen_image.comfy_to_diffusers(keys, int(qwen_image.RELEASED["num_res_blocks"])))
    if not any(k.startswith("decoder.") for k in view.names):
        raise ValueError(f"{flag} {path}: no Qwen-Image VAE weights (expected encoder.* / decoder.* keys)")
    candidates = [(qwen_image.RELEASED, "the Qwen-Image VAE config"), (qwen_image.TINY, "the tiny config")]
    return instantiate_fitting(candidates, qwen_image.factory, view, "Qwen-Image VAE (--vae)", path, dtype, device)


def _part(given: str | None, folder: Path | None, sub: str, flag: str, what: str) -> Path:
    if given is not None:
        p = Path(given)
        if not p.exists():
            raise FileNotFoundError(f"{flag} {p}: no such file or folder ({what})")
        return p
    if folder is not None and (folder / sub).is_dir():
        return folder / sub
    raise ValueError(f"Qwen-Image needs {flag}: {what} (musubi-tuner's qwen_image_train_network.py requires it too)")


def load_qwen_image(name: str, path: str | Path, *, dtype: torch.dtype | PartDtypes, vae: str | None, device: Any,
                    options: Any) -> Parts:  # fmt: skip
    """The parts of a Qwen-Image model (module docstring); errors name the flag."""
    dtypes = PartDtypes.of(dtype)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--dit {path}: no such file or folder (expected the Qwen-Image DiT .safetensors or a "
                                "diffusers Qwen-Image folder)")  # fmt: skip
    folder = path if path.is_dir() else None
    te_path = _part(options.text_encoder, folder, "text_encoder", "--text_encoder",
                    "Qwen2.5-VL-7B, e.g. ComfyUI's qwen_2.5_vl_7b.safetensors")  # fmt: skip
    vae_path = _part(vae, folder, "vae", "--vae", "the Qwen-Image VAE, e.g. qwen_image_vae.safetensors")
    version = getattr(options, "model_version", "original")
    denoiser = load_dit(path, dtypes.denoiser, device, zero_cond_t=version == "edit-2511")
    if version in qwen25vl_edit.VERSIONS:  # the edit models' prompts see the control images: the vision tower too
        encoder = qwen25vl_edit.load(te_path, dtypes.text_encoders, device, where="--text_encoder")
    else:
        encoder = qwen25vl.load(te_path, dtypes.text_encoders, device, where="--text_encoder")
    if getattr(options, "fp8_vl", False):  # musubi-tuner's --fp8_vl: Qwen2.5-VL in float8, computed as loaded
        stored = qwen25vl.store_fp8(getattr(encoder, "language_model", encoder), dtypes.text_encoders)
        log.info("--fp8_vl: %d Qwen2.5-VL layers stored in float8", stored)
    autoencoder = load_vae(vae_path, dtypes.vae, device)
    # built at first use: a run whose text outputs are all cached never tokenizes
    tokenizers = [DeferredTokenizer(qwen25vl.load_tokenizer, te_path if te_path.is_dir() else None)]
    parts = Parts(denoiser, autoencoder, [encoder], tokenizers, dict(M.SCHEDULER), name, str(path), options)
    return finish(parts, device)
