"""Reading HunyuanImage 2.1's files, as sd-scripts' ``hunyuan_image_train_network.py`` takes them:

* the DiT (``--pretrained_model_name_or_path``): Tencent's ``hunyuanimage2.1.safetensors`` (no prefix; ComfyUI's
  ``model.diffusion_model.`` accepted), read tensor by tensor into diffusers' transformer through ``keys.py``;
* ``--text_encoder``: Qwen2.5-VL-7B (Comfy-Org's ``qwen_2.5_vl_7b.safetensors``, a transformers file or folder):
  the shared ``encoders/qwen25vl.load``;
* ``--byt5``: byT5-small Glyph (Comfy-Org's ``byt5_small_glyphxl_fp16.safetensors``: ``encoder.*`` and
  ``shared.weight``, what transformers' ``T5EncoderModel`` names; bare T5Stack names are accepted too);
* ``--vae``: Comfy-Org's ``hunyuan_image_2.1_vae_fp16.safetensors`` (Tencent names, ``keys.vae_tencent_to_diffusers``)
  or diffusers names.

Configs: the released one, else the tiny one (``tiny.py``), whichever fits the weights' shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..base import PartDtypes, Parts, keep_on_host
from ..encoders import qwen25vl
from ..loading import finish, instantiate_fitting, read_weights
from ..tokenizers import DeferredTokenizer
from . import keys as K
from . import model as M
from . import tiny

log = logging.getLogger(__name__)


class PlannedView(Mapping):
    """A lazy state dict under other names whose tensors are row ranges of the source's (``keys.tencent_plan``):
    nothing is read until asked, one tensor at a time."""

    def __init__(self, source: Mapping[str, Any], plan: Mapping[str, K.Piece], shapes: Mapping[str, tuple]) -> None:
        self.source, self.plan, self.shapes = source, dict(plan), shapes

    def __getitem__(self, key: str) -> Tensor:
        where = self.plan[key]
        return K.piece(self.source[where[0]], where)

    def shape(self, key: str) -> torch.Size:
        src, start, stop, _ = self.plan[key]
        full = self.shapes[src]
        rows = (full[0] if stop is None else stop) - start
        return torch.Size((rows, *full[1:]))

    def __iter__(self):
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


def _shapes(source: Mapping[str, Any]) -> dict[str, tuple]:
    if callable(getattr(source, "shape", None)):
        return {k: tuple(source.shape(k)) for k in source.keys()}
    return {k: tuple(v.shape) for k, v in source.items()}


def _require(path: str | Path | None, flag: str, what: str) -> Path:
    if path is None:
        raise ValueError(f"HunyuanImage 2.1 needs {flag}: {what} (sd-scripts' hunyuan_image_train_network.py requires "
                         "it too)")  # fmt: skip
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p}: no such file or folder ({what})")
    return p


def load_dit(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    source, _ = read_weights(path)
    shapes = _shapes(source)
    if not K.is_tencent(shapes):
        hint = " (a diffusers-named transformer: convert it to Tencent's layout)" if K.is_diffusers(shapes) else ""
        raise ValueError(f"--pretrained_model_name_or_path {path}: no HunyuanImage 2.1 DiT weights in Tencent's layout "
                         f"(expected byt5_in.fc1.weight, double_blocks.0.img_attn_qkv.weight ...){hint}")  # fmt: skip
    try:
        plan = K.tencent_plan(shapes)
    except ValueError as e:
        raise ValueError(f"--pretrained_model_name_or_path {path}: {e}") from None
    view = PlannedView(source, plan, shapes)
    candidates = [(M.TRANSFORMER, "the HunyuanImage 2.1 config"), (tiny.TRANSFORMER, "the tiny test config")]
    return instantiate_fitting(candidates, M.transformer_factory, view, "HunyuanImage 2.1 DiT", path, dtype, device,
                               derive=_derive_depths)  # fmt: skip


def _derive_depths(state: Mapping[str, Any], shape: Any, candidates: list[dict]) -> dict | None:
    """The candidate of the file's width with the file's numbers of double and single blocks (pruned or tiny
    variants), else None."""
    counts = {"transformer_blocks": 0, "single_transformer_blocks": 0}
    for key in state:
        head, _, rest = key.partition(".")
        if head in counts:
            counts[head] = max(counts[head], int(rest.split(".", 1)[0]) + 1)
    width = tuple(shape("x_embedder.proj.weight"))
    for config in candidates:
        inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
        if width[:2] == (inner, int(config["in_channels"])):
            return dict(config, num_layers=counts["transformer_blocks"],
                        num_single_layers=counts["single_transformer_blocks"])  # fmt: skip
    return None


def load_vae(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    source, _ = read_weights(path)
    keys = list(source.keys())
    if K.is_tencent_vae(keys):
        state = K.vae_tencent_to_diffusers({k: source[k] for k in keys})
    elif any(k.startswith("encoder.down_blocks.") for k in keys):
        state = {k: source[k] for k in keys}
    else:
        raise ValueError(f"--vae {path}: no HunyuanImage 2.1 VAE weights (expected encoder.down.0.block.0.conv1.weight "
                         "as in hunyuan_image_2.1_vae_fp16.safetensors, or diffusers names)")  # fmt: skip
    candidates = [(M.VAE, "the HunyuanImage 2.1 VAE config"), (tiny.VAE, "the tiny test config")]
    return instantiate_fitting(candidates, M.vae_factory, state, "HunyuanImage 2.1 VAE (--vae)", path, dtype, device)


def _byt5_names(keys: list[str]) -> dict[str, str]:
    """``T5EncoderModel`` name -> file key: Comfy-Org's names as they are; bare T5Stack names get ``encoder.``;
    ``embed_tokens.weight`` stands in for ``shared.weight``."""
    names: dict[str, str] = {}
    for key in keys:
        if key == "shared.weight" or key.startswith("encoder."):
            names[key] = key
        elif key == "embed_tokens.weight":
            names.setdefault("shared.weight", key)
        elif key.startswith(("block.", "final_layer_norm.")):
            names["encoder." + key] = key
    if "shared.weight" in names:
        names.setdefault("encoder.embed_tokens.weight", names["shared.weight"])
    return names


def load_byt5(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    from ..loading import KeyView

    source, _ = read_weights(path)
    names = _byt5_names(list(source.keys()))
    if "encoder.block.0.layer.0.SelfAttention.q.weight" not in names:
        raise ValueError(f"--byt5 {path}: no byT5 encoder weights (expected encoder.block.0.layer.0.SelfAttention.q."
                         "weight, as in byt5_small_glyphxl_fp16.safetensors)")  # fmt: skip
    candidates = [(M.BYT5, "the byT5-small Glyph config"), (tiny.BYT5, "the tiny test config")]
    model = instantiate_fitting(candidates, M.byt5_factory, KeyView(source, names), "byT5 Glyph (--byt5)", path,
                                dtype, device)  # fmt: skip
    return model.eval().requires_grad_(False)


def load_text_encoder(path: Path, dtype: torch.dtype, device: Any) -> nn.Module:
    candidates = [(qwen25vl.RELEASED_TEXT, "Qwen2.5-VL-7B"), (qwen25vl.TINY_TEXT, "the tiny test encoder")]
    return qwen25vl.load(path, dtype, device, where="--text_encoder", candidates=candidates)


def load_hunyuan(name: str, path: str | Path, *, dtype: torch.dtype | PartDtypes, vae: str | None, device: Any,
                 options: Any) -> Parts:  # fmt: skip
    """The four parts (module docstring); ``ValueError`` / ``FileNotFoundError`` naming the flag."""
    dtypes = PartDtypes.of(dtype)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {path}: no such file (expected Tencent's "
                                "hunyuanimage2.1.safetensors)")  # fmt: skip
    te_path = _require(options.text_encoder, "--text_encoder", "Qwen2.5-VL-7B, e.g. qwen_2.5_vl_7b.safetensors")
    byt5_path = _require(options.byt5, "--byt5", "byT5-small Glyph, e.g. byt5_small_glyphxl_fp16.safetensors")
    vae_path = _require(vae, "--vae", "the HunyuanImage 2.1 VAE, e.g. hunyuan_image_2.1_vae_fp16.safetensors")
    denoiser = load_dit(path, dtypes.denoiser, device)
    qwen = load_text_encoder(te_path, dtypes.text_encoders, "cpu" if options.fp8_vl else device)
    if options.fp8_vl:  # cast on the host: the device never holds the bf16 copy
        qwen25vl.store_fp8_as_sd_scripts(qwen, dtypes.text_encoders)
    byt5 = load_byt5(byt5_path, dtypes.text_encoders, device)
    autoencoder = load_vae(vae_path, dtypes.vae, device)
    # built at first use: a run whose text outputs are all cached never tokenizes (Qwen2.5-VL's 151k-token BPE)
    qwen_folder = te_path if te_path.is_dir() else None
    tokenizers = [DeferredTokenizer(qwen25vl.load_tokenizer, qwen_folder), DeferredTokenizer(M.load_byt5_tokenizer)]
    parts = Parts(denoiser, autoencoder, [qwen, byt5], tokenizers, dict(M.SCHEDULER), name, str(path), options)
    parts = finish(parts, device)
    if options.text_encoder_cpu:  # sd-scripts' --text_encoder_cpu: they compute on the host
        for te in parts.text_encoders:
            keep_on_host(te.to("cpu"))
    return parts
