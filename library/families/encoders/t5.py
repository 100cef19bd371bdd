"""The T5-XXL encoder as FLUX.1, Chroma and SD3 / SD3.5 use it: its tokenizer, hidden states, configs and single
files.

The T5 tokenizer ships with the package (``data/t5_tokenizer.json.gz``: sd-scripts' ``configs/t5_old/tokenizer.json``,
the T5 v1.1 vocabulary, Apache-2.0) and loads with the ``tokenizers`` backend: no sentencepiece, no network.
Single files hold transformers' T5 names (``shared.weight`` + ``encoder.*``, or ``encoder.*`` only; fp8 too), also
under ``text_encoders.t5xxl.transformer.`` (SD3's SAI files); :func:`load` reads them tensor by tensor.
"""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting, shipped_configs
from ..tokenizers import _cache_root

T5_TOKENIZER_FILE = Path(__file__).parent.parent / "data" / "t5_tokenizer.json.gz"
T5_TOKENIZER_ID = "google/t5-v1_1-xxl"  # what sd-scripts loads (``--tokenizer_cache_dir`` layout)
SAI_PREFIX = "text_encoders.t5xxl.transformer."  # its keys inside an SD3 SAI single file

# The tiny test encoder (the families' tiny models): 2 layers with T5's real vocabulary size, so the shipped
# tokenizer's ids fit; d_model 32 (the tiny FLUX transformer's context width).
TINY_T5 = dict(
    vocab_size=32128,
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    pad_token_id=0,
    eos_token_id=1,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ tokenizer
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
    """The T5 tokenizer: a diffusers folder's tokenizer subfolder (or any folder with ``tokenizer.json``), else
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
    kept), as sd-scripts' FLUX and SD3 tokenize strategies."""
    out = tokenizer(list(captions), max_length=max_length, padding="max_length", truncation=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


# ------------------------------------------------------------------------------------------------ the encoder
def t5_hidden(t5: nn.Module, ids: Tensor, mask: Tensor | None) -> Tensor:
    """(B, L, D) T5 encoder last hidden state (D = 4096 for T5-XXL); ``mask`` (B, L) is passed as its attention mask
    when given."""
    device = next(t5.parameters()).device
    attention = None if mask is None else mask.to(device)
    return t5(ids.to(device), attention_mask=attention, return_dict=True).last_hidden_state


def released_config() -> dict:
    """The released T5-XXL encoder's config (as FLUX.1's shipped configs hold it), a fresh copy."""
    return shipped_configs("flux-dev")["text_encoders"][1]


def factory(config: Mapping) -> Callable[[], nn.Module]:
    from transformers import T5Config, T5EncoderModel

    return lambda: T5EncoderModel(T5Config.from_dict(dict(config)))


# ------------------------------------------------------------------------------------------------ single files
def t5_names(keys: list[str]) -> dict[str, str]:
    """transformers ``T5EncoderModel`` key -> key in a T5 file: ``shared.weight`` + ``encoder.*`` (the embedding taken
    from ``encoder.embed_tokens.weight`` when ``shared.weight`` is absent, as in encoder-only files; keys under
    ``text_encoders.t5xxl.transformer.`` too); a full T5's decoder and ``lm_head`` are left out."""
    prefix = next((p for p in (SAI_PREFIX,) if any(k.startswith(p) for k in keys)), "")
    names = {k[len(prefix) :]: k for k in keys if k.startswith(prefix)}
    names = {k: v for k, v in names.items() if k.startswith("encoder.") or k == "shared.weight"}
    if "shared.weight" not in names and "encoder.embed_tokens.weight" in names:
        names["shared.weight"] = names["encoder.embed_tokens.weight"]
    if "encoder.embed_tokens.weight" not in names and "shared.weight" in names:
        names["encoder.embed_tokens.weight"] = names["shared.weight"]
    return names


def config_from_shapes(state: Mapping[str, Any], shape: Callable[[str], tuple[int, ...]],
                       candidates: list[dict]) -> dict | None:  # fmt: skip
    """A T5 encoder config read from its weights (``loading.Derive``): vocabulary and width from the embedding, heads
    and buckets from the relative-attention bias, the head width from the query, depth, MLP width and gating (v1.1's
    gated GELU or v1.0's ReLU); the rest from the first candidate. None when a tensor it reads is absent."""
    block = "encoder.block.0.layer."
    bias, query = block + "0.SelfAttention.relative_attention_bias.weight", block + "0.SelfAttention.q.weight"
    keys = list(state.keys())
    if not candidates or not all(k in keys for k in ("shared.weight", bias, query)):
        return None
    buckets, heads = shape(bias)
    gated = block + "1.DenseReluDense.wi_0.weight" in keys
    ff = shape(block + ("1.DenseReluDense.wi_0.weight" if gated else "1.DenseReluDense.wi.weight"))[0]
    vocab, width = shape("shared.weight")
    depth = 1 + max(int(k.split(".")[2]) for k in keys if k.startswith("encoder.block."))
    return dict(candidates[0], vocab_size=vocab, d_model=width, num_heads=heads, d_kv=shape(query)[0] // heads,
                d_ff=ff, num_layers=depth, relative_attention_num_buckets=buckets,
                feed_forward_proj="gated-gelu" if gated else "relu")  # fmt: skip


def load(
    path: Path, source: Mapping[str, Any], candidates: list[tuple[dict, str]], dtype: Any, device: Any, *, where: str,
    what: str,
) -> nn.Module:  # fmt: skip
    """The T5 encoder of ``source`` (the weights of ``path``: a whole file or a lazy reader, read tensor by tensor
    and cast to ``dtype``, fp8 files too), built from the first of ``candidates`` that fits. Messages name it as
    ``where`` (the flag, or "model file") ``path``; ``what``: the part ("T5 (--t5xxl)")."""
    state = KeyView(source, t5_names(list(source.keys())))
    if "encoder.block.0.layer.0.SelfAttention.q.weight" not in state:
        raise ValueError(f"{where} {path}: no T5 encoder weights (expected transformers T5 keys such as "
                         "encoder.block.0.layer.0.SelfAttention.q.weight)")  # fmt: skip
    return instantiate_fitting(candidates, factory, state, what, path, dtype, device, derive=config_from_shapes)
