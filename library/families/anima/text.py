"""Anima's prompts: Qwen3-0.6B's last hidden states (padding rows zeroed) plus the T5 token ids the LLM adapter
embeds, as sd-scripts' ``strategy_anima`` (``AnimaTokenizeStrategy`` / ``AnimaTextEncodingStrategy``).

Tokenizers ship with the package and load offline: Qwen3's (the shared ``encoders/qwen3.py``:
``families/data/qwen3_tokenizer.json.gz`` + ``qwen3_tokenizer_config.json``, sd-scripts' ``configs/qwen3_06b``
vocab.json + merges.txt, Apache-2.0, as one tokenizers file) and T5's, which is the shared one (``encoders/t5.py``: byte-identical to sd-scripts'
``configs/t5_old/tokenizer.json``, 32128 ids with the 100 extra ids). A Qwen3 folder's own tokenizer is used when it
has one (sd-scripts does the same); ``--t5_tokenizer_path`` a folder with ``tokenizer.json``.

:class:`~library.families.base.Cond` carries three tensors, Anima needs four: ``hidden_states`` are the Qwen3
states (B, Lq, 1024) and ``mask`` packs the three integer rows side by side, ``[qwen3 mask (Lq) | T5 ids (Lt) | T5
mask (Lt)]`` (B, Lq + 2 Lt) int64 (:func:`pack` / :func:`unpack`), so the text-encoder-output cache, batching and
device moves (which keep the mask's dtype) carry the T5 ids exactly (the text cache stores them as float32, exact for
integers below 2^24: the T5 vocabulary has 32128). The family's ``predict`` unpacks them.

Caption dropout over cached outputs: the shared cache encodes "" for captions that may be dropped; "" gives Qwen3
ids of padding only (mask 0, so zero states) and T5 ids ``[</s>, pad...]`` with mask ``[1, 0...]``: what sd-scripts'
``drop_cached_text_encoder_outputs`` writes for a dropped caption.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..encoders import qwen3 as qwen3_encoder
from ..encoders import t5 as t5_encoder

log = logging.getLogger(__name__)

DATA = Path(__file__).parent / "data"
QWEN3_CONFIG = DATA / "qwen3_06b_config.json"  # sd-scripts' configs/qwen3_06b/config.json (Qwen3-0.6B)
# the tiny test Qwen3 (tiny.py): Qwen3's real vocabulary (the shipped tokenizer's ids fit) at width 16
TINY_QWEN3 = dict(
    vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000,
    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, model_type="qwen3",
)  # fmt: skip
DEFAULT_LENGTH = 512  # --qwen3_max_token_length and --t5_max_token_length defaults (sd-scripts)


def load_qwen3_tokenizer(qwen3_path: str | Path | None = None) -> Any:
    """A Qwen3 folder's tokenizer when it has one, else the shipped one (sd-scripts: the folder's, else
    ``configs/qwen3_06b``): the shared Qwen3 encoder's (``encoders/qwen3.py``)."""
    return qwen3_encoder.load_tokenizer(qwen3_path)


def check_t5_tokenizer_path(path: str | Path | None) -> None:
    """``ValueError`` when ``--t5_tokenizer_path`` is given and has no tokenizer.json."""
    if path is not None and not (Path(path) / "tokenizer.json").is_file():
        raise ValueError(f"--t5_tokenizer_path {path}: no tokenizer.json in it (give a T5 tokenizer folder)")


def load_t5_tokenizer(path: str | Path | None = None) -> Any:
    """``--t5_tokenizer_path`` (a folder with tokenizer.json), else the shipped T5 vocabulary."""
    check_t5_tokenizer_path(path)
    return t5_encoder.load_t5_tokenizer(path)


def tokenize(tokenizers: list[Any], captions: list[str], qwen3_length: int, t5_length: int) -> list[Tensor]:
    """``[qwen3 ids, qwen3 mask (B, qwen3_length), t5 ids, t5 mask (B, t5_length)]`` int64, each padded to its
    length and truncated (sd-scripts' ``AnimaTokenizeStrategy.tokenize``)."""
    qwen3, t5 = tokenizers
    q = qwen3(list(captions), return_tensors="pt", truncation=True, padding="max_length", max_length=qwen3_length)
    t = t5(list(captions), return_tensors="pt", truncation=True, padding="max_length", max_length=t5_length)
    return [q["input_ids"], q["attention_mask"], t["input_ids"], t["attention_mask"]]


def encode(qwen3: nn.Module, tokens: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(states (B, Lq, D) with padding rows zeroed, qwen3 mask, t5 ids, t5 mask): sd-scripts'
    ``AnimaTextEncodingStrategy.encode_tokens``."""
    ids, mask, t5_ids, t5_mask = tokens
    device = next(qwen3.parameters()).device
    states = qwen3(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    states = states * mask.to(device).unsqueeze(-1).to(states.dtype)
    return states, mask, t5_ids, t5_mask


def pack(qwen3_mask: Tensor, t5_ids: Tensor, t5_mask: Tensor) -> Tensor:
    """``Cond.mask`` of Anima: the three integer rows side by side (module docstring), int64."""
    return torch.cat([qwen3_mask.long(), t5_ids.long(), t5_mask.long().to(qwen3_mask.device)], dim=1)


def unpack(packed: Tensor, qwen3_length: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pack`'s inverse: (qwen3 mask (B, Lq), t5 ids (B, Lt), t5 mask (B, Lt)) given Lq (the states' length).
    ``ValueError`` for a mask that is no Anima pack."""
    rest = packed.shape[1] - qwen3_length
    if packed.ndim != 2 or rest <= 0 or rest % 2:
        raise ValueError(f"Anima's conditioning mask must be [qwen3 mask | t5 ids | t5 mask] (B, Lq + 2 Lt); got "
                         f"shape {tuple(packed.shape)} for {qwen3_length} Qwen3 tokens")  # fmt: skip
    t5_length = rest // 2
    packed = packed if not packed.is_floating_point() else packed.round()  # the text cache stores it as float32
    packed = packed.long()
    return packed[:, :qwen3_length], packed[:, qwen3_length : qwen3_length + t5_length], packed[:, -t5_length:]


# ------------------------------------------------------------------------------------------------ the encoder
def qwen3_config(folder: Path | None = None) -> dict:
    """A Qwen3 folder's config.json, else the shipped Qwen3-0.6B config."""
    path = folder / "config.json" if folder is not None and (folder / "config.json").is_file() else QWEN3_CONFIG
    return json.loads(path.read_text())


qwen3_factory = qwen3_encoder.factory
qwen3_names = qwen3_encoder.names
