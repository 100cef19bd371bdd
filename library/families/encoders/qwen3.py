"""Qwen3 as a text encoder (Anima's Qwen3-0.6B, FLUX.2 klein's Qwen3-4B / -8B, Z-Image's Qwen3-4B): the shipped
tokenizer, the chat template with thinking off, the model builder, key names and the released file layouts.

Tokenizer: ``data/qwen3_tokenizer.json.gz`` + ``data/qwen3_tokenizer_config.json`` (sd-scripts' ``configs/qwen3_06b``
vocab.json + merges.txt, Apache-2.0, as one tokenizers file; every Qwen3 size shares it), unpacked once into the
sdtrain cache; a folder's own tokenizer is used when it has one.

Chat template (:func:`chat`): Qwen3's own Jinja template (``data/qwen3_chat_template.jinja``, the ``chat_template``
of Qwen3's tokenizer_config.json as sd-scripts' ``configs/qwen3_06b`` ships it, Apache-2.0; every Qwen3 size shares
it) rendered by transformers' ``apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
enable_thinking=False)``, as diffusers' ``Flux2KleinPipeline`` and musubi-tuner's ``Qwen3Embedder`` call it:
``<|im_start|>user\\n{c}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``.

Weights (:func:`load`): one file (``model.``-prefixed as ``Qwen3ForCausalLM`` / ComfyUI save it, or bare; bf16 or
ComfyUI's fp8_scaled, ``weight`` x ``scale_weight``), the first part of a split ``-00001-of-0000N`` file (the others
are found beside it), or a transformers folder (its ``text_encoder/``); ``lm_head`` is left out. The model is
transformers' ``Qwen3Model``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting, read_weights
from ..tokenizers import _cache_root

DATA = Path(__file__).parent.parent / "data"
TOKENIZER_FILE = DATA / "qwen3_tokenizer.json.gz"
TOKENIZER_CONFIG = DATA / "qwen3_tokenizer_config.json"
CHAT_TEMPLATE = DATA / "qwen3_chat_template.jinja"
SPLIT_FILE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
_COMMON = dict(hidden_act="silu", attention_bias=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
               rope_theta=1000000, model_type="qwen3", vocab_size=151936, head_dim=128)  # fmt: skip
# Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json (the text encoders of FLUX.2 klein 4B / 9B and Z-Image)
QWEN3_4B = dict(_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True)  # fmt: skip
QWEN3_8B = dict(_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip

# Z-Image's prompt: the user turn and the assistant's start, no thinking block (diffusers' ZImagePipeline)
USER_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
MAX_LENGTH = 512
LAYER = -2

# Qwen3-4B (Z-Image's text encoder; musubi-tuner's zimage_utils QWEN3_4B_CONFIG_JSON)
RELEASED_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000,
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, max_window_layers=36,
    bos_token_id=151643, eos_token_id=151645,
)  # fmt: skip
# the tiny test encoder: the real vocabulary (the shipped tokenizer's ids fit) at width 16, 3 layers (layer -2 is
# then a middle block's output, not the last)
TINY = dict(RELEASED_4B, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_window_layers=3, max_position_embeddings=1024)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tokenizer
def bundled_folder() -> Path:
    """The shipped Qwen3 tokenizer unpacked once into the sdtrain cache (atomically)."""
    folder = _cache_root() / "qwen3_tokenizer"
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in (("tokenizer_config.json", TOKENIZER_CONFIG.read_bytes()),
                           ("tokenizer.json", gzip.decompress(TOKENIZER_FILE.read_bytes()))):  # fmt: skip
            tmp = folder / f"{name}.tmp{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, folder / name)
    return folder


@lru_cache(maxsize=4)
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(path: str | Path | None = None) -> Any:
    """A Qwen3 folder's own tokenizer (the folder or its ``tokenizer/``) when it has one, else the shipped one."""
    if path is not None and Path(path).is_dir():
        for folder in (Path(path), Path(path) / "tokenizer", Path(path).parent / "tokenizer"):
            if any((folder / name).is_file() for name in ("tokenizer.json", "vocab.json")):
                return _tokenizer(str(folder))
    return _tokenizer(str(bundled_folder()))


@lru_cache(maxsize=1)
def chat_template() -> str:
    return CHAT_TEMPLATE.read_text(encoding="utf-8")


def chat(tokenizer: Any, caption: str) -> str:
    """``caption`` in Qwen3's chat template (the tokenizer's own when it has one, else the shipped one): a user
    turn, the generation prompt, thinking off (module docstring)."""
    template = getattr(tokenizer, "chat_template", None) or chat_template()
    return tokenizer.apply_chat_template([{"role": "user", "content": caption}], chat_template=template,
                                         tokenize=False, add_generation_prompt=True, enable_thinking=False)  # fmt: skip


def tokenize_chat(tokenizer: Any, captions: Sequence[str], length: int) -> tuple[Tensor, Tensor]:
    """(ids, mask) (B, ``length``) int64 of the captions in the chat template, padded to ``length`` and truncated
    (diffusers' ``Flux2KleinPipeline._get_qwen3_prompt_embeds``, musubi-tuner's ``Qwen3Embedder``)."""
    out = tokenizer([chat(tokenizer, c) for c in captions], return_tensors="pt", padding="max_length", truncation=True,
                    max_length=length)  # fmt: skip
    return out["input_ids"], out["attention_mask"]


def stacked_layers(model: nn.Module, ids: Tensor, mask: Tensor, layers: Sequence[int]) -> Tensor:
    """(B, L, len(layers) · D): the hidden states of ``layers`` (indices into transformers' ``hidden_states``, 0 the
    embeddings) side by side per token, as FLUX.2 reads its text encoders."""
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[k] for k in layers], dim=-1)


def tokenize(tokenizer: Any, captions: Sequence[str], template: str = USER_TURN,
             max_length: int = MAX_LENGTH) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(ids, mask) (B, L) int64 of the captions in ``template``, padded to the batch's longest, at most
    ``max_length`` tokens (the reference pads to 512; the padding's states are never read)."""
    out = tokenizer([template.format(c) for c in captions], max_length=max_length, padding=True, truncation=True,
                    return_tensors="pt")  # fmt: skip
    return out.input_ids, out.attention_mask


def hidden(model: nn.Module, ids: Tensor, mask: Tensor, layer: int = LAYER) -> Tensor:
    """(B, L, D) states of transformers' ``hidden_states[layer]`` of ``model`` (``Qwen3Model``); rows past the mask
    zeroed."""
    device = next(model.parameters()).device
    mask = mask.to(device)
    out = model(input_ids=ids.to(device), attention_mask=mask, output_hidden_states=True, use_cache=False)
    states = out.hidden_states[layer]
    return states * mask.unsqueeze(-1).to(states.dtype)


# ------------------------------------------------------------------------------------------------ the encoder
def factory(config: Mapping):
    """A ``Qwen3Model`` builder for ``config`` (a config.json dict)."""
    from transformers import Qwen3Config, Qwen3Model

    def make() -> nn.Module:
        cfg = Qwen3Config(**{k: v for k, v in dict(config).items() if k not in ("architectures", "transformers_version",
                                                                               "torch_dtype", "dtype")})  # fmt: skip
        cfg.use_cache = False
        return Qwen3Model(cfg)

    return make


def names(keys: Sequence[str]) -> dict[str, str]:
    """``Qwen3Model`` key -> file key: ``model.`` stripped (a ``Qwen3ForCausalLM`` file or ComfyUI's), ``lm_head``
    left out."""
    out = {}
    for key in keys:
        if key.startswith("lm_head."):
            continue
        out[key[len("model.") :] if key.startswith("model.") else key] = key
    return out


class _Merged(Mapping):
    """Several weight files (split / sharded) read as one lazy mapping."""

    def __init__(self, sources: Sequence[Mapping[str, Any]]) -> None:
        self.where = {k: s for s in sources for k in s.keys()}

    def __getitem__(self, key: str) -> Tensor:
        return self.where[key][key]

    def shape(self, key: str) -> torch.Size:
        source = self.where[key]
        return torch.Size(source.shape(key) if callable(getattr(source, "shape", None)) else source[key].shape)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def weight_files(path: str | Path, where: str = "--text_encoder") -> list[Path]:
    """The files holding the weights at ``path``: a folder's (or its ``text_encoder/``'s) .safetensors, every part of
    a ``-0000k-of-0000N`` split file, else the file itself; ``FileNotFoundError`` naming what is missing."""
    path = Path(path)
    if path.is_dir():
        folder = path / "text_encoder" if (path / "text_encoder").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{where} {path}: no .safetensors files in this folder")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"{where} {path}: no such file or folder")
    match = SPLIT_FILE.match(path.stem)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}{path.suffix}") for i in range(1, count + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{where} {path}: a split file whose parts are missing: {', '.join(missing)}")
    return files


def read(path: str | Path, where: str = "--text_encoder") -> Mapping[str, Any]:
    """The lazy weights of ``path`` (:func:`weight_files`, merged; ComfyUI's fp8_scaled files dequantized by the
    shared ``qwen25vl.Dequantized``)."""
    from .qwen25vl import Dequantized

    readers = [read_weights(f)[0] for f in weight_files(path, where)]
    state = readers[0] if len(readers) == 1 else _Merged(readers)
    if "scaled_fp8" in state.keys() or any(k.endswith(".scale_weight") for k in state.keys()):
        state = Dequantized(state)
    return state


def config_from_shapes(state: Mapping[str, Any], shape, candidates: list[dict]) -> dict | None:
    """A Qwen3 config read from the weights (vocabulary, width, depth, MLP width, heads from the q / k projections
    at the candidates' head width 128)."""
    keys = list(state.keys())
    if not candidates or not all(k in keys for k in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                                                     "layers.0.self_attn.k_proj.weight",
                                                     "layers.0.mlp.gate_proj.weight")):  # fmt: skip
        return None
    head = int(candidates[0]["head_dim"])
    vocab, width = shape("embed_tokens.weight")
    depth = 1 + max(int(k.split(".")[1]) for k in keys if k.startswith("layers."))
    return dict(candidates[0], vocab_size=vocab, hidden_size=width,
                num_attention_heads=shape("layers.0.self_attn.q_proj.weight")[0] // head,
                num_key_value_heads=shape("layers.0.self_attn.k_proj.weight")[0] // head,
                intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0], num_hidden_layers=depth,
                max_window_layers=depth)  # fmt: skip


def folder_config(path: str | Path) -> dict | None:
    for folder in (Path(path) / "text_encoder", Path(path)):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text())
    return None


def load(path: str | Path, candidates: Sequence[tuple[dict, str]] | None = None, dtype: Any = torch.bfloat16,
         device: Any = "cpu", *, where: str = "--text_encoder") -> nn.Module:  # fmt: skip
    """The ``Qwen3Model`` (eval mode, no gradients) of ``path``, read tensor by tensor, cast to ``dtype`` on
    ``device``: built from the folder's config.json, else the first of ``candidates`` (default: Qwen3-4B, then the
    tiny test Qwen3) that fits, else a config read from the weights' shapes (:func:`config_from_shapes`)."""
    state = read(path, where)
    view = KeyView(state, names(list(state.keys())))
    if "layers.0.self_attn.q_norm.weight" not in view.names:
        raise ValueError(f"{where} {path}: no Qwen3 weights (expected model.layers.0.self_attn.q_norm.weight); is this "
                         "the Qwen3 text encoder?")  # fmt: skip
    options = list(candidates or [(RELEASED_4B, "Qwen3-4B"), (TINY, "the tiny test Qwen3")])
    config = folder_config(path) if Path(path).is_dir() else None
    if config is not None:
        options.insert(0, (config, f"{path}'s config.json"))
    model = instantiate_fitting(options, factory, view, "Qwen3", Path(path), dtype, device, derive=config_from_shapes)
    return model.eval().requires_grad_(False)
