"""FLUX.1 / Chroma prompts: CLIP-L's pooled output and T5-XXL's last hidden state, as sd-scripts encodes them
(``library/strategy_flux.py``): CLIP-L ids padded to 77, T5 ids padded to ``--t5xxl_max_token_length`` (512 for
dev, 256 for schnell; sd-scripts' defaults), the T5 attention mask (1 for tokens and the closing ``</s>``, 0 for
padding). With ``--apply_t5_attn_mask`` the mask goes to T5 and to the transformer's attention; without it T5
sees the padding (sd-scripts' default) and the conditioning carries no mask. Chroma has no CLIP-L and always uses
the mask.

The T5 tokenizer ships with the package (``data/t5_tokenizer.json.gz``: sd-scripts' ``configs/t5_old/tokenizer.json``,
the T5 v1.1 vocabulary, Apache-2.0) and loads with the ``tokenizers`` backend: no sentencepiece, no network.
"""

from __future__ import annotations

import gzip
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from ..tokenizers import _cache_root

T5_TOKENIZER_FILE = Path(__file__).parent.parent / "data" / "t5_tokenizer.json.gz"
T5_TOKENIZER_ID = "google/t5-v1_1-xxl"  # what sd-scripts loads (``--tokenizer_cache_dir`` layout)
CLIP_L_LENGTH = 77

log = logging.getLogger(__name__)


def _bundled_tokenizer_file() -> Path:
    """The shipped tokenizer.json, unpacked once into the sdtrain cache (atomically)."""
    dest = _cache_root() / "t5_tokenizer" / "tokenizer.json"
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"tokenizer.json.tmp{os.getpid()}")
        tmp.write_bytes(gzip.decompress(T5_TOKENIZER_FILE.read_bytes()))
        os.replace(tmp, dest)
    return dest


@lru_cache(maxsize=4)
def _load(path: str):
    from transformers import T5TokenizerFast

    return T5TokenizerFast(tokenizer_file=path)


def load_t5_tokenizer(folder: str | Path | None = None, cache_dir: str | Path | None = None):
    """The T5 tokenizer: a diffusers folder's ``tokenizer_2/`` (or any folder with ``tokenizer.json``), else
    ``<cache_dir>/google_t5-v1_1-xxl`` (sd-scripts' ``--tokenizer_cache_dir``), else the bundled vocabulary."""
    candidates = [Path(folder)] if folder is not None else []
    if cache_dir:
        candidates.append(Path(cache_dir) / T5_TOKENIZER_ID.replace("/", "_"))
    for candidate in candidates:
        if (candidate / "tokenizer.json").is_file():
            log.debug("T5 tokenizer: %s", candidate)
            return _load(str(candidate / "tokenizer.json"))
    return _load(str(_bundled_tokenizer_file()))


def tokenize_t5(tokenizer, captions: list[str], max_length: int) -> tuple[Tensor, Tensor]:
    """(ids (B, max_length), attention mask (B, max_length) int64): padded to ``max_length``, truncated (``</s>``
    kept), as sd-scripts' ``FluxTokenizeStrategy``."""
    out = tokenizer(list(captions), max_length=max_length, padding="max_length", truncation=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


def tokenize_clip_l(tokenizer, captions: list[str]) -> Tensor:
    """CLIP-L ids (B, 77): ``<BOS> tokens <EOS> <pad>...``, truncated (sd-scripts ignores ``--max_token_length``)."""
    out = tokenizer(list(captions), max_length=CLIP_L_LENGTH, padding="max_length", truncation=True,
                    return_tensors="pt")  # fmt: skip
    return out.input_ids


def clip_l_pooled(clip_l: nn.Module, ids: Tensor) -> Tensor:
    """(B, 768) CLIP-L ``pooler_output`` (final-normed state at the EOS token; no projection), as sd-scripts."""
    device = next(clip_l.parameters()).device
    return clip_l(ids.to(device), return_dict=True).pooler_output


def t5_hidden(t5: nn.Module, ids: Tensor, mask: Tensor | None) -> Tensor:
    """(B, L, 4096) T5 encoder last hidden state; ``mask`` (B, L) is passed as its attention mask when given."""
    device = next(t5.parameters()).device
    attention = None if mask is None else mask.to(device)
    return t5(ids.to(device), attention_mask=attention, return_dict=True).last_hidden_state


def transformer_mask(mask: Tensor, image_tokens: int, extra_padding: int = 0) -> Tensor:
    """(B, L_txt + N_img) bool key mask for the joint sequence ``[text, image]``: the T5 mask, ``extra_padding``
    more padding tokens attended after each text (Chroma: 1, sd-scripts' ``attn_padding`` and ChromaPipeline's
    ``mask_indices <= seq_lengths``), then the image tokens, always attended."""
    mask = mask.bool()
    if extra_padding:
        length = mask.sum(dim=-1, keepdim=True) + extra_padding
        mask = torch.arange(mask.shape[1], device=mask.device)[None, :] < length
    ones = torch.ones(mask.shape[0], image_tokens, dtype=torch.bool, device=mask.device)
    return torch.cat([mask, ones], dim=1)
