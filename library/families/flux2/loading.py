"""Reading FLUX.2's files: the DiT (``--dit``: BFL's ``flux2-dev.safetensors`` / ``flux2-klein-4b.safetensors`` ...,
bare or under ``model.diffusion_model.`` (ComfyUI), a file in diffusers names, or a diffusers folder whose
``transformer/`` is read), the text encoder (``--text_encoder``, else the folder's ``text_encoder/``: Qwen3 for klein,
``encoders/qwen3.py``; Mistral 3 for dev, ``encoders/mistral3.py``, its tokenizer from beside it), the AE (``--vae``, BFL or diffusers names, else the folder's ``vae/``:
``autoencoders/flux2.py``). The architecture (dev, klein 4B, klein 9B) is read from the DiT's shapes; klein base
from ``--model_version`` or a file name with "base" (its weights have klein's shapes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autoencoders import flux2 as ae
from ..base import PartDtypes, Parts
from ..encoders import mistral3, qwen3
from ..loading import KeyView, finish, instantiate, read_weights
from ..tokenizers import DeferredTokenizer
from . import keys as K
from . import model as M

TINY_QWEN3 = dict(qwen3.QWEN3_4B, hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)  # fmt: skip
TEXT_LAYERS = {"qwen3": (9, 18, 27), "mistral": (10, 20, 30)}  # musubi-tuner's OUTPUT_LAYERS_QWEN3 / _MISTRAL
TEXT_LENGTH = 512
GUIDANCE_DISTILLED = {"dev": True, "klein-4b": True, "klein-9b": True, "klein-base-4b": False, "klein-base-9b": False}
SAMPLING = {True: (4, 1.0), False: (50, 4.0)}  # (steps, guidance) of musubi-tuner's klein / base defaults
DEV_SAMPLING = (50, 4.0)
VAE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip


def is_dit(keys: Any) -> bool:
    keys = set(keys)
    return any(p + "single_stream_modulation.lin.weight" in keys for p in ("", K.BFL_PREFIX)) or \
        "single_stream_modulation.linear.weight" in keys  # fmt: skip


def is_folder(path: Path) -> bool:
    index = Path(path) / "model_index.json"
    if index.is_file():
        try:
            return "Flux2" in json.loads(index.read_text()).get("_class_name", "")
        except (ValueError, UnicodeDecodeError):
            return False
    config = Path(path) / "transformer" / "config.json"
    return config.is_file() and "Flux2Transformer2DModel" in config.read_text()


def dit_state(path: Path, flag: str = "--dit") -> Any:
    """The DiT's weights under diffusers' names (a lazy view)."""
    if path.is_dir():
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{flag} {path}: no .safetensors in {folder}")
        state = qwen3._Merged([read_weights(f)[0] for f in files]) if len(files) > 1 else read_weights(files[0])[0]
    else:
        state = read_weights(path)[0]
    keys = list(state.keys())
    if not is_dit(keys):
        raise ValueError(f"{flag} {path}: no FLUX.2 DiT weights (expected single_stream_modulation.lin.weight, bare or "
                         "under model.diffusion_model., or diffusers' single_stream_modulation.linear.weight)")  # fmt: skip
    if "single_stream_modulation.linear.weight" in keys:
        return KeyView(state, {k: k for k in keys})
    return K.BflView(state)


def load_dit(path: Path, dtype: torch.dtype, device: Any, flag: str = "--dit") -> nn.Module:
    from ..loading import shape_reader

    view = dit_state(path, flag)
    config = M.config_from_shapes(view, shape_reader(view), [])
    if config is None:
        raise ValueError(f"{flag} {path}: the FLUX.2 DiT file lacks img_in / txt_in / final_layer weights")
    source = M.variant_of(config) or "the shapes of its weights"
    return instantiate(M.factory(config), view, "FLUX.2 DiT", path, source, dtype, device=device)


def variant(config: dict, version: str | None, path: Path) -> str:
    """The model version: the architecture's (``model.variant_of``; tiny and pruned models count as klein 4B), base
    when ``version`` or the file name says so; ``ValueError`` when ``version`` names another architecture."""
    arch = M.variant_of(config) or ("dev" if config.get("guidance_embeds") else "klein-4b")
    if version is not None:
        if version.replace("base-", "") != arch and M.variant_of(config) is not None:
            raise ValueError(f"--model_version {version}: the DiT {path} is FLUX.2 {arch}; give --model_version {arch} "
                             f"(or {arch.replace('klein-', 'klein-base-')} for its base model)")  # fmt: skip
        return version
    if arch != "dev" and "base" in path.name.lower():
        return arch.replace("klein-", "klein-base-")
    return arch


def _part(given: str | None, folder: Path | None, sub: str, flag: str, what: str) -> Path:
    if given is not None:
        p = Path(given)
        if not p.exists():
            raise FileNotFoundError(f"{flag} {p}: no such file or folder ({what})")
        return p
    if folder is not None and (folder / sub).is_dir():
        return folder / sub
    raise ValueError(f"FLUX.2 needs {flag}: {what} (musubi-tuner's flux_2_train_network.py requires it too)")


def load_text_encoder(path: Path, version: str, dtype: Any, device: Any) -> nn.Module:
    if version == "dev":
        candidates = [(mistral3.RELEASED, "Mistral-Small-3.1"), (mistral3.TINY, "the tiny test Mistral 3")]
        return mistral3.load(path, candidates, dtype, device)
    released = (qwen3.QWEN3_8B, "Qwen3-8B") if version.endswith("9b") else (qwen3.QWEN3_4B, "Qwen3-4B")
    return qwen3.load(path, [released, (TINY_QWEN3, "the tiny test Qwen3")], dtype, device)


def load_tokenizer(path: Path, version: str) -> Any:
    """Mistral's tokenizer beside the text encoder for dev; Qwen3's (the folder's, else the shipped one) for klein."""
    if version == "dev":
        return mistral3.load_tokenizer(path)
    return DeferredTokenizer(qwen3.load_tokenizer, path if path.is_dir() else None)  # cached runs never tokenize


def load_flux2(name: str, path: str | Path, *, dtype: torch.dtype | PartDtypes, vae: str | None, device: Any,
               options: Any) -> Parts:  # fmt: skip
    """The parts of a FLUX.2 model (module docstring); errors name the flag."""
    dtypes = PartDtypes.of(dtype)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--dit {path}: no such file or folder (expected the FLUX.2 DiT .safetensors, e.g. "
                                "flux2-klein-base-4b.safetensors, or a diffusers FLUX.2 folder)")  # fmt: skip
    folder = path if path.is_dir() else None
    te_path = _part(options.text_encoder, folder, "text_encoder", "--text_encoder",
                    "Qwen3 for klein, Mistral 3 for dev (the first file of a split set, e.g. "
                    "00001-of-00002.safetensors)")  # fmt: skip
    vae_path = _part(vae, folder, "vae", "--vae", "FLUX.2's AE, ae.safetensors")
    denoiser = load_dit(path, dtypes.denoiser, device)
    version = variant(dict(denoiser.config), options.model_version, path)
    tokenizers = [load_tokenizer(te_path, version)]
    encoder = load_text_encoder(te_path, version, dtypes.text_encoders, device)
    autoencoder = ae.load(vae_path, VAE_DTYPES.get(options.vae_dtype or "", dtypes.vae), device)  # --vae_dtype
    steps, guidance = DEV_SAMPLING if version == "dev" else SAMPLING[GUIDANCE_DISTILLED[version]]
    scheduler = {"model_version": version, "guidance_distilled": GUIDANCE_DISTILLED[version],
                 "default_steps": steps, "default_guidance": guidance, "prediction_type": "flow_matching"}  # fmt: skip
    parts = Parts(denoiser, autoencoder, [encoder], tokenizers, scheduler, name, str(path), options)
    return finish(parts, device)
