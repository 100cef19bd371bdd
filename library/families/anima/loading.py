"""Reading Anima's files: the DiT (sd-scripts / ComfyUI names, ``net.`` optional; the LLM adapter inside it or from
``--llm_adapter_path``), Qwen3-0.6B (``--qwen3``: a transformers folder or one file, ``model.`` stripped), the
Qwen-Image VAE (``--vae``: diffusers or ComfyUI names). sd-scripts' ``anima_utils.load_anima_model`` /
``load_qwen3_text_encoder`` and ``qwen_image_autoencoder_kl.load_vae`` read the same files; the configs come from
the weights' shapes (the DiT, the adapter), the folder's ``config.json`` or the shipped Qwen3-0.6B config (a single
Qwen3 file), and the VAE's released config or the tiny one, whichever fits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autoencoders import qwen_image
from ..base import PartDtypes, Parts
from ..loading import KeyView, finish, instantiate, instantiate_fitting, read_weights
from ..tokenizers import DeferredTokenizer
from . import keys as K
from . import model as M
from . import text

log = logging.getLogger(__name__)

SCHEDULER = M.SCHEDULER


def _require(path: str | None, flag: str, what: str) -> Path:
    if path is None:
        raise ValueError(f"Anima needs {flag}: {what} (sd-scripts' anima_train_network.py requires it too)")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p}: no such file or folder ({what})")
    return p


def _adapter_names(keys: list[str]) -> dict[str, str]:
    """``llm_adapter.*`` key -> file key of an adapter file (keys bare, under ``llm_adapter.`` or
    ``net.llm_adapter.``)."""
    out = {}
    for key in keys:
        bare = key[len(K.NET) :] if key.startswith(K.NET) else key
        bare = bare if bare.startswith("llm_adapter.") else "llm_adapter." + bare
        out[bare] = key
    return out


class _Joined(Mapping):
    """Two key views as one mapping (the DiT file and the adapter file)."""

    def __init__(self, *views: KeyView) -> None:
        self.views = views

    def _view(self, key: str) -> KeyView:
        for view in self.views:
            if key in view.names:
                return view
        raise KeyError(key)

    def __getitem__(self, key: str) -> Any:
        return self._view(key)[key]

    def shape(self, key: str) -> torch.Size:
        return self._view(key).shape(key)

    def __iter__(self):
        for view in self.views:
            yield from view

    def __len__(self) -> int:
        return sum(len(v) for v in self.views)


def dit_state(path: Path, adapter_path: str | None) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """(diffusers-named lazy view of the DiT weights, its :func:`model.config_from_state` config)."""
    source, _ = read_weights(path)
    names = K.strip_net(list(source.keys()))
    if "x_embedder.proj.1.weight" not in names:
        raise ValueError(f"--pretrained_model_name_or_path {path}: no Anima DiT weights (expected "
                         "x_embedder.proj.1.weight, with or without the net. prefix)")  # fmt: skip
    sd_view = KeyView(source, names)
    has_adapter = "llm_adapter.out_proj.weight" in names
    views = []
    if adapter_path is not None:
        adapter_file = Path(adapter_path)
        adapter_source, _ = read_weights(adapter_file)
        adapter_names = _adapter_names(list(adapter_source.keys()))
        if "llm_adapter.out_proj.weight" not in adapter_names:
            raise ValueError(f"--llm_adapter_path {adapter_file}: no LLM adapter weights (expected out_proj.weight, "
                             "bare or under llm_adapter.)")  # fmt: skip
        if has_adapter:
            log.info("--llm_adapter_path %s replaces the LLM adapter inside %s", adapter_file, path)
        names = {k: v for k, v in names.items() if not k.startswith("llm_adapter.")}
        sd_view = KeyView(source, names)
        views.append(KeyView(adapter_source, adapter_names))
        has_adapter = True
    elif not has_adapter:
        raise ValueError(f"--pretrained_model_name_or_path {path} holds no LLM adapter (llm_adapter.*); pass its "
                         "weights with --llm_adapter_path FILE")  # fmt: skip
    joined = _Joined(sd_view, *views)
    keys = list(joined)
    config = M.config_from_state(joined.shape, keys, with_adapter=has_adapter)
    diff_names = K.sd_to_diffusers_names(keys)
    return KeyView(joined, diff_names), config


def load_dit(path: Path, adapter_path: str | None, dtype: torch.dtype, device: Any) -> nn.Module:
    state, config = dit_state(path, adapter_path)
    return instantiate(lambda: M.build(config), state, "Anima DiT", path, "its weights' shapes", dtype, device=device)


def load_qwen3(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    """``--qwen3``: a transformers folder (config.json + weights) or one .safetensors (the shipped Qwen3-0.6B
    config, then the tiny one, whichever fits)."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--qwen3 {path}: no .safetensors weights in this folder")
        sources = [read_weights(f)[0] for f in files]
        names = {}
        for i, src in enumerate(sources):
            for new, old in text.qwen3_names(list(src.keys())).items():
                names[new] = (i, old)
        view = KeyView(_Indexed(sources), {k: v for k, v in names.items()})
        config = text.qwen3_config(path)
        return instantiate(text.qwen3_factory(config), view, "Qwen3 (--qwen3)", path, f"{path}/config.json", dtype,
                           device=device)  # fmt: skip
    source, _ = read_weights(path)
    view = KeyView(source, text.qwen3_names(list(source.keys())))
    if "embed_tokens.weight" not in view.names:
        raise ValueError(
            f"--qwen3 {path}: no Qwen3 weights (expected model.embed_tokens.weight or embed_tokens.weight)"
        )
    candidates = [(text.qwen3_config(), "the Qwen3-0.6B config"), (text.TINY_QWEN3, "the tiny test config")]
    return instantiate_fitting(candidates, text.qwen3_factory, view, "Qwen3 (--qwen3)", path, dtype, device)


class _Indexed(Mapping):
    """Several weight sources addressed by ``(index, key)`` (a sharded folder)."""

    def __init__(self, sources: list[Mapping[str, Any]]) -> None:
        self.sources = sources

    def __getitem__(self, key: tuple[int, str]) -> Any:
        return self.sources[key[0]][key[1]]

    def shape(self, key: tuple[int, str]) -> Any:
        src = self.sources[key[0]]
        return src.shape(key[1]) if callable(getattr(src, "shape", None)) else src[key[1]].shape

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def load_vae(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    """``--vae``: diffusers or ComfyUI names; the released config, else the tiny one."""
    source, _ = read_weights(path)
    keys = list(source.keys())
    candidates = []
    for config, where in ((qwen_image.RELEASED, "the Qwen-Image VAE config"), (qwen_image.TINY, "the tiny config")):
        candidates.append((config, where))
    view = KeyView(source, qwen_image.comfy_to_diffusers(keys, int(qwen_image.RELEASED["num_res_blocks"])))
    if not any(k.startswith("decoder.") for k in view.names):
        raise ValueError(f"--vae {path}: no Qwen-Image VAE weights (expected encoder.* / decoder.* keys)")
    return instantiate_fitting(candidates, qwen_image.factory, view, "Qwen-Image VAE (--vae)", path, dtype, device)


def load_anima(name: str, path: str | Path, *, dtype: torch.dtype | PartDtypes, vae: str | None, device: Any,
               options: Any) -> Parts:  # fmt: skip
    """The four parts of an Anima model (module docstring); ``ValueError`` naming the flag for what is missing."""
    dtypes = PartDtypes.of(dtype)
    path = source = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {path}: no such file (expected an Anima DiT "
                                ".safetensors)")  # fmt: skip
    qwen3, vae = options.qwen3, vae
    if path.is_dir():  # an Anima folder (saving.FOLDER_FILES): its files stand in for the flags not given
        from .saving import FOLDER_FILES

        if not (path / FOLDER_FILES["dit"]).is_file():
            raise ValueError(f"--pretrained_model_name_or_path {path}: a folder without {FOLDER_FILES['dit']}; Anima's "
                             "DiT is one .safetensors file (with --qwen3 and --vae beside it)")  # fmt: skip
        qwen3 = qwen3 or str(path / FOLDER_FILES["qwen3"])
        vae = vae or str(path / FOLDER_FILES["vae"])
        path = path / FOLDER_FILES["dit"]
    qwen3_path = _require(qwen3, "--qwen3", "the Qwen3-0.6B text encoder, a folder or one .safetensors")
    vae_path = _require(vae, "--vae", "the Qwen-Image VAE .safetensors")
    denoiser = load_dit(path, options.llm_adapter_path, dtypes.denoiser, device)
    encoder = load_qwen3(qwen3_path, dtypes.text_encoders, device)
    autoencoder = load_vae(vae_path, dtypes.vae, device)
    text.check_t5_tokenizer_path(options.t5_tokenizer_path)  # a wrong folder is named now, not at first use
    # built at first use: a run whose text outputs are all cached never tokenizes (Qwen3's 151k-token BPE)
    tokenizers = [DeferredTokenizer(text.load_qwen3_tokenizer, qwen3_path),
                  DeferredTokenizer(text.load_t5_tokenizer, options.t5_tokenizer_path)]  # fmt: skip
    parts = Parts(denoiser, autoencoder, [encoder], tokenizers, dict(SCHEDULER), name, str(source), options)
    return finish(parts, device)
