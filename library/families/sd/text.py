"""Prompt tokenization and text-encoder outputs, exactly as sd-scripts computes them.

sd-scripts (``library/strategy_base.py::_get_input_ids``, ``strategy_sd.py``, ``strategy_sdxl.py``):

* ``--max_token_length`` unset (= 75): one 77-token sequence, ``<BOS> tokens <EOS> <PAD>...`` (truncated).
* 150 / 225: the caption is tokenized to 152 / 227 tokens, then cut into 2 / 3 chunks of 77, each
  ``<BOS> + 75 tokens + <last token of the whole sequence>``; for OpenCLIP tokenizers (pad "!" != EOS) a chunk
  whose 75 tokens are all text ends with ``<EOS>`` and an empty chunk starts ``<BOS> <EOS>``. (With CLIP-L's pad =
  EOS both rules change nothing.) The encoder runs on every chunk; the outputs are joined as
  ``h[chunk 0][BOS]``, each chunk's 75 middle states, ``h[last chunk][last]`` -> 75·k + 2 states.
* ``--no_token_padding`` (train_db.py; sd-scripts up to v0.9, ``padding=True``; v0.10 ignores the flag): one sequence
  ``<BOS> tokens <EOS>``, truncated to 77, padded only to the longest caption of the batch (so the UNet attends to
  no padding). The encoder's causal mask makes it the padded output cut after the batch's longest caption. No
  chunking: sd-scripts then truncates to 75 tokens whatever ``--max_token_length`` says, so that pair is refused.
* SDXL pooled output: TE2's final hidden state at the first ``<EOS>`` of the first chunk, through
  ``text_projection`` (sd-scripts' ``_pool_workaround``; equals HF's own pooling unless added token ids exceed EOS,
  as textual-inversion tokens do).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

CHUNK = 75
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # --fp8_base storage (library.device.fp8)
SEQ = CHUNK + 2


def num_chunks(max_token_length: int | None) -> int:
    """1 for ``--max_token_length`` None/75, 2 for 150, 3 for 225; a ``ValueError`` otherwise."""
    if max_token_length in (None, 75):
        return 1
    if max_token_length in (150, 225):
        return max_token_length // CHUNK
    raise ValueError(f"--max_token_length {max_token_length}: expected 75, 150 or 225 (unset means 75)")


def tokenize(tokenizer, captions: list[str], max_token_length: int | None = None, *, pad: bool = True) -> Tensor:
    """Token ids (B, 77·k) for ``captions``: k chunks of 77 laid out as sd-scripts does (module docstring).

    ``pad=False`` (``--no_token_padding``): (B, L) ids, L = 2 + the longest caption's tokens (at most 77)."""
    n = num_chunks(max_token_length)
    if not pad:
        if n > 1:
            raise ValueError(
                f"--no_token_padding with --max_token_length {max_token_length} is not supported yet (unpadded "
                "captions are one sequence of at most 75 tokens); drop one of the two"
            )
        return tokenizer(
            list(captions), padding="longest", truncation=True, max_length=SEQ, return_tensors="pt"
        ).input_ids
    length = SEQ if n == 1 else CHUNK * n + 2
    ids = tokenizer(list(captions), padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    ids = ids.input_ids
    if n == 1:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = []
    for i in range(n):
        chunk = torch.cat([ids[:, :1], ids[:, 1 + CHUNK * i : 1 + CHUNK * (i + 1)], ids[:, -1:]], dim=1)
        full = (chunk[:, -2] != eos) & (chunk[:, -2] != pad)
        chunk[full, -1] = eos
        chunk[chunk[:, 1] == pad, 1] = eos
        chunks.append(chunk)
    return torch.cat(chunks, dim=1)


def split_chunks(tokens: Tensor) -> tuple[Tensor, int, int]:
    """(B, 77·k) ids -> ((B·k, 77) ids, B, k); unpadded (B, L <= 77) ids are one chunk, returned as they are."""
    if tokens.ndim == 2 and tokens.shape[1] <= SEQ:
        return tokens, tokens.shape[0], 1
    if tokens.ndim != 2 or tokens.shape[1] % SEQ:
        raise ValueError(f"token ids must have shape (batch, 77·k) or (batch, <= 77), got {tuple(tokens.shape)}")
    batch, n = tokens.shape[0], tokens.shape[1] // SEQ
    return tokens.reshape(batch * n, SEQ), batch, n


def merge_chunks(hidden: Tensor, batch: int, n: int) -> Tensor:
    """(B·k, 77, D) per-chunk states -> (B, 77, D) for k = 1, else (B, 75·k + 2, D) (module docstring)."""
    if n == 1:
        return hidden  # (B, 77 or L unpadded, D)
    h = hidden.reshape(batch, n * SEQ, hidden.shape[-1])
    middles = [h[:, SEQ * i + 1 : SEQ * i + 1 + CHUNK] for i in range(n)]
    return torch.cat([h[:, :1], *middles, h[:, -1:]], dim=1)


def final_layer_norm(text_encoder: nn.Module) -> nn.Module:
    """The encoder's final LayerNorm (under ``text_model`` in transformers < 5.6, at the top level after)."""
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm


def clip_skip_states(text_encoder: nn.Module, ids: Tensor, clip_skip: int | None) -> Tensor:
    """(N, 77, D): the last hidden state (clip_skip None/1) or ``hidden_states[-clip_skip]`` + final LayerNorm."""
    layers = text_encoder.config.num_hidden_layers
    if clip_skip is not None and not 1 <= clip_skip <= layers:
        raise ValueError(f"--clip_skip {clip_skip}: the text encoder has {layers} layers; use 1 to {layers}")
    if clip_skip is None or clip_skip == 1:
        return text_encoder(ids)[0]
    out = text_encoder(ids, output_hidden_states=True, return_dict=True)
    return final_layer_norm(text_encoder)(out.hidden_states[-clip_skip])


def eos_pooled(text_encoder: nn.Module, last_hidden: Tensor, ids: Tensor, eos_token_id: int) -> Tensor:
    """(N, P): ``text_projection`` of the final hidden state at each row's first EOS token."""
    index = (ids == eos_token_id).int().argmax(dim=1).to(last_hidden.device)
    pooled = last_hidden[torch.arange(last_hidden.shape[0], device=last_hidden.device), index]
    projection = text_encoder.text_projection
    weight = projection.weight  # float8 storage (--fp8_base) computes in the hidden states' dtype
    dtype = last_hidden.dtype if weight.dtype in FP8_DTYPES else weight.dtype
    return projection(pooled.to(dtype)).to(last_hidden.dtype)
