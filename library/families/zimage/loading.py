"""Reading Z-Image's files: the DiT (``--dit``: the original / ComfyUI single file, bf16 or fp8-scaled, bare or under
``model.diffusion_model.``; diffusers names in one file or a ``-00001-of-0000N`` split set given by its first part
(Tongyi-MAI's ``transformer/``); or a diffusers Z-Image folder), Qwen3-4B (``--text_encoder``, else the folder's
``text_encoder/``: ``encoders/qwen3.py``) and the FLUX.1 AE (``--vae``, BFL's ``ae.safetensors`` or diffusers names,
else the folder's ``vae/``: ``autoencoders/flux_ae.py``). musubi-tuner's ``load_zimage_model`` / ``load_qwen3`` /
``load_autoencoder_kl`` read the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from library.device.fp8 import store_in_fp8

from ..autoencoders import flux_ae
from ..base import PartDtypes, Parts
from ..encoders import qwen3, qwen25vl
from ..loading import KeyView, finish, instantiate_fitting, read_weights
from ..tokenizers import DeferredTokenizer
from . import model as M

FOLDER_CLASS = "ZImage"
FOLDER_DIT = "zimage_dit.safetensors"  # saving.FOLDER_FILES["dit"]


def is_dit(keys: Any) -> bool:
    """Z-Image DiT keys: the caption embedder and the noise refiner, in either naming, bare or ComfyUI-prefixed."""
    keys = set(keys)
    return any(p + "cap_embedder.1.weight" in keys and (p + "noise_refiner.0.attention.qkv.weight" in keys or
               p + "noise_refiner.0.attention.to_q.weight" in keys) for p in ("", M.COMFY_PREFIX))  # fmt: skip


def is_folder(path: Path) -> bool:
    index = Path(path) / "model_index.json"
    if index.is_file():
        try:
            return FOLDER_CLASS in json.loads(index.read_text()).get("_class_name", "")
        except (ValueError, UnicodeDecodeError):
            return False
    config = Path(path) / "transformer" / "config.json"
    return config.is_file() and FOLDER_CLASS in config.read_text()


def dit_view(state: Any) -> Any:
    """The DiT's weights in diffusers' names: an original / ComfyUI file through :class:`model.DiffusersView`, a
    diffusers file as it is (a ComfyUI prefix stripped)."""
    keys = list(state.keys())
    if M.is_original(keys):
        return M.DiffusersView(state)
    prefix = M.COMFY_PREFIX if any(k.startswith(M.COMFY_PREFIX) for k in keys) else ""
    return KeyView(state, {k[len(prefix) :]: k for k in keys if k.startswith(prefix)})


def load_dit(path: Path, dtype: torch.dtype, device: Any, flag: str = "--dit") -> nn.Module:
    """The DiT of a single file, a split set, or a diffusers folder's ``transformer/``; config from the folder's
    config.json, else released / tiny / the weights' shapes."""
    candidates = [(M.RELEASED, "Z-Image (30 blocks)"), (M.TINY, "the tiny test DiT")]
    if path.is_dir() and (path / FOLDER_DIT).is_file():  # our folder (saving.py): the DiT file beside the parts
        path = path / FOLDER_DIT
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"{flag} {path}: no .safetensors in {folder}")
        if (folder / "config.json").is_file():
            cfg = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k in M.RELEASED}
            candidates.insert(0, (dict(M.RELEASED, **cfg), f"{folder}/config.json"))
        state, _ = qwen25vl.read(folder)
    else:
        state, _ = qwen25vl.read(path)  # one file or a split set; fp8-scaled files dequantized
    if not is_dit(state.keys()):
        raise ValueError(f"{flag} {path}: no Z-Image DiT weights (expected cap_embedder.1.weight and "
                         "noise_refiner.0.attention.qkv / to_q, bare or under model.diffusion_model.)")  # fmt: skip
    return instantiate_fitting(candidates, M.factory, dit_view(state), "Z-Image DiT", path, dtype, device,
                               derive=M.config_from_shapes)  # fmt: skip


def load_vae(path: Path, dtype: torch.dtype, device: Any, flag: str = "--vae") -> nn.Module:
    """BFL's ``ae.safetensors`` (FLUX.1's AE, which Z-Image uses) or diffusers names (a folder's ``vae/``)."""
    if path.is_dir():
        folder = path / "vae" if (path / "vae").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{flag} {path}: no .safetensors in {folder}")
        state, _ = read_weights(files[0])
    else:
        state, _ = read_weights(path)
    candidates = [(flux_ae.released_config(), "FLUX.1's AE config"), (dict(flux_ae.TINY_AE), "the tiny AE config")]
    return flux_ae.load(path, state, candidates, dtype, device, where=flag, what="AE (--vae)",
                        this="Z-Image's AE (FLUX.1's)")  # fmt: skip


def load_text_encoder(path: Path, dtype: torch.dtype, device: Any, fp8_llm: bool) -> nn.Module:
    """Qwen3-4B in ``dtype``; ``--fp8_llm``: its Linear weights stored in float8, computed in ``dtype`` (training and
    zimage_cache_text_encoder_outputs.py load it alike: the text cache keys include its storage)."""
    encoder = qwen3.load(path, dtype=dtype, device=device, where="--text_encoder")
    if fp8_llm:
        store_in_fp8(encoder, dtype, skip=("norm",))
    return encoder


def _part(given: str | None, folder: Path | None, sub: str, flag: str, what: str) -> Path:
    if given is not None:
        p = Path(given)
        if not p.exists():
            raise FileNotFoundError(f"{flag} {p}: no such file or folder ({what})")
        return p
    if folder is not None and (folder / sub).is_dir():
        return folder / sub
    raise ValueError(f"Z-Image needs {flag}: {what} (musubi-tuner's zimage_train_network.py requires it too)")


def _dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
    return table[name] if name else default


def load_zimage(name: str, path: str | Path, *, dtype: torch.dtype | PartDtypes, vae: str | None, device: Any,
                options: Any) -> Parts:  # fmt: skip
    """The parts of a Z-Image model (module docstring); errors name the flag."""
    dtypes = PartDtypes.of(dtype)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--dit {path}: no such file or folder (expected the Z-Image DiT .safetensors or a "
                                "diffusers Z-Image folder)")  # fmt: skip
    folder = path if path.is_dir() else None
    te_path = _part(options.text_encoder, folder, "text_encoder", "--text_encoder",
                    "Qwen3-4B, e.g. ComfyUI's qwen_3_4b.safetensors")  # fmt: skip
    vae_path = _part(vae, folder, "vae", "--vae", "the FLUX.1 AE, e.g. ae.safetensors")
    denoiser = load_dit(path, dtypes.denoiser, device)
    encoder = load_text_encoder(te_path, dtypes.text_encoders, device, options.fp8_llm)
    autoencoder = load_vae(vae_path, _dtype(options.vae_dtype, dtypes.vae), device)
    # built at first use: a run whose text outputs are all cached never tokenizes
    tokenizers = [DeferredTokenizer(qwen3.load_tokenizer, te_path if te_path.is_dir() else None)]
    parts = Parts(denoiser, autoencoder, [encoder], tokenizers, dict(M.SCHEDULER), name, str(path), options)
    return finish(parts, device)
