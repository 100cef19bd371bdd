"""Qwen3 as a text encoder of an image DiT (Z-Image's Qwen3-4B; the same language model FLUX.2 klein uses): its
configs, the shipped tokenizer, the chat template, a chosen hidden-states layer and the released file layouts.

Tokenizer: Qwen3's byte-level BPE with its added tokens ships with the package (``data/qwen3_tokenizer.json.gz``,
Apache-2.0, the file Anima reads too); its config here is Qwen3-4B's (``eos_token`` ``<|im_end|>``, ``pad_token``
``<|endoftext|>``). A folder's own tokenizer (``tokenizer.json`` / ``vocab.json``; a diffusers folder's
``tokenizer/``) is used when given.

Prompt: :data:`CHAT_TEMPLATE` is what Qwen3's chat template writes for one user message with
``add_generation_prompt=True, enable_thinking=True`` (diffusers' ``ZImagePipeline._encode_prompt``, musubi-tuner's
``zimage_utils.get_text_embeds``); tokenized to at most 512 tokens; the states of hidden-states layer -2 (the
second-to-last block's output) at the real tokens.

Weights (:func:`load`): ComfyUI's ``qwen_3_4b.safetensors`` (``model.``-prefixed, bf16 or "fp8_scaled"), a
transformers ``Qwen3ForCausalLM`` file or sharded folder (``text_encoder/`` of a diffusers Z-Image folder), split
``-00001-of-0000N`` files given by the first: the file readers of ``encoders/qwen25vl.py``. ``lm_head`` is not
read (the encoder is ``Qwen3Model``).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting
from ..tokenizers import _cache_root
from . import qwen25vl

TOKENIZER_FILE = Path(__file__).parent.parent / "data" / "qwen3_tokenizer.json.gz"
TOKENIZER_CONFIG = {
    "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
    "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
}  # fmt: skip
CHAT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
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
PARTS = ("embed_tokens.", "layers.", "norm.")


# ------------------------------------------------------------------------------------------------ tokenizer
def _bundled_folder() -> Path:
    """The shipped Qwen3 tokenizer with Qwen3-4B's config, written once into the sdtrain cache (atomically)."""
    folder = _cache_root() / "qwen3_4b_tokenizer"
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in (("tokenizer_config.json", json.dumps(TOKENIZER_CONFIG, indent=2).encode()),
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
        tokenizer.pad_token = "<|endoftext|>"
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(folder: str | Path | None = None) -> Any:
    """A folder's own Qwen3 tokenizer (the folder or its ``tokenizer/``), else the shipped one (nothing fetched)."""
    if folder is not None:
        for candidate in (Path(folder), Path(folder) / "tokenizer", Path(folder).parent / "tokenizer"):
            if candidate.is_dir() and any((candidate / n).is_file() for n in ("tokenizer.json", "vocab.json")):
                return _tokenizer(str(candidate))
    return _tokenizer(str(_bundled_folder()))


def tokenize(tokenizer: Any, captions: Sequence[str], template: str = CHAT_TEMPLATE,
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
    """A ``Qwen3Model`` builder for ``config``."""
    from transformers import Qwen3Config, Qwen3Model

    def make() -> nn.Module:
        cfg = Qwen3Config(**{k: v for k, v in dict(config).items()
                             if k not in ("architectures", "transformers_version", "torch_dtype", "dtype",
                                          "model_type")})  # fmt: skip
        cfg.use_cache = False
        return Qwen3Model(cfg)

    return make


def names(keys: Sequence[str]) -> dict[str, str]:
    """``Qwen3Model`` key -> file key: ``model.`` stripped (transformers' ``Qwen3ForCausalLM``, ComfyUI), ``lm_head``
    left out; {} without ``embed_tokens.weight``."""
    keys = list(keys)
    prefix = next((p for p in ("model.", "") if p + "embed_tokens.weight" in set(keys)), None)
    if prefix is None:
        return {}
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix) and k[len(prefix) :].startswith(PARTS)}


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


def load(path: str | Path, dtype: Any = torch.bfloat16, device: Any = "cpu", *, where: str = "--text_encoder",
         candidates: Sequence[tuple[dict, str]] | None = None) -> nn.Module:  # fmt: skip
    """The Qwen3 language model (``Qwen3Model``, eval mode, no gradients) of ``path`` (module docstring's layouts),
    built from the folder's config.json, else the first of ``candidates`` (default: Qwen3-4B, tiny) that fits, else
    the weights' shapes. Messages name ``where`` (the flag)."""
    state, _ = qwen25vl.read(path)
    found = names(list(state.keys()))
    if "layers.0.self_attn.q_proj.weight" not in found:
        raise ValueError(f"{where} {path}: no Qwen3 weights (expected keys such as "
                         "model.layers.0.self_attn.q_proj.weight); is this the Qwen3 text encoder?")  # fmt: skip
    options = list(candidates or [(RELEASED_4B, "Qwen3-4B"), (TINY, "the tiny test Qwen3")])
    folder = Path(path)
    for cfg_file in (folder / "text_encoder" / "config.json", folder / "config.json") if folder.is_dir() else ():
        if cfg_file.is_file():
            cfg = {k: v for k, v in json.loads(cfg_file.read_text()).items() if k in RELEASED_4B}
            options.insert(0, (dict(RELEASED_4B, **cfg), str(cfg_file)))
            break
    model = instantiate_fitting(options, factory, KeyView(state, found), "Qwen3", Path(path), dtype, device,
                                derive=config_from_shapes)  # fmt: skip
    return model.eval().requires_grad_(False)
