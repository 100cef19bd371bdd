"""Prompt weighting ``(word:1.2)`` and long prompts, as A1111 users write them and sd-scripts' samplers encode them.

Syntax (A1111 ``prompt_parser.parse_prompt_attention``): ``(text)`` multiplies the weight of ``text`` by 1.1,
``[text]`` divides it by 1.1, ``(text:1.3)`` multiplies it by 1.3; brackets nest and multiply (``((a))`` = 1.21);
``\\(``, ``\\)``, ``\\[``, ``\\]``, ``\\\\`` are literal characters; a ``:`` outside ``(...:w)`` and unmatched closing
brackets are plain text; brackets still open at the end apply their 1.1 / 1/1.1; ``BREAK`` (upper case, a word of
its own) pads the current 75-token chunk so the following text starts a new one.

Encoding (sd-scripts ``lpw_stable_diffusion.get_weighted_text_embeddings``):

1. Every weighted span is tokenized on its own (no BOS/EOS); textual-inversion tokens are expanded to all their
   vectors (:mod:`library.text.textual_inversion`). Tokens beyond ``75 * max_embeddings_multiples`` are dropped.
2. k = the number of 75-token chunks the longest prompt of the batch (negative prompts included) needs, at least 1,
   at most ``max_embeddings_multiples``. Ids are laid out as ``family.tokenize`` does for ``max_token_length`` = 75k
   (BOS, tokens, EOS, padding; cut into k chunks of 77), so an unweighted prompt gives exactly the ids and the
   conditioning of ``family.encode_prompt`` (tested).
3. ``family.encode_tokens`` encodes them (clip_skip, SDXL's two encoders and pooled output: the family's rules) into
   hidden states H (B, 75k + 2, D) with weights w (B, 75k + 2) (1.0 for BOS, the end token and padding).
4. ``normalize="original"``: ``H' = H * w * mean(H) / mean(H * w)``, the means over tokens and features of each
   prompt (computed in float32; skipped when mean(H * w) is 0). ``"abs"`` uses mean(|.|), ``"none"`` only multiplies. The SDXL pooled embedding is
   not weighted. A prompt whose weights are all 1 is left untouched. A1111 restores the mean per 77-token chunk
   instead of over the whole prompt; for prompts of up to 75 tokens both rules are the same.

Not done (A1111 only): moving the words after the last comma to the next chunk when a chunk fills up, and
scheduling / alternation syntax (``[a:b:10]``, ``[a|b]``), which is kept as literal text.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from library.families.base import Parts
from library.families.protocol import ModelFamily

log = logging.getLogger(__name__)

CHUNK = 75
ROUND, SQUARE = 1.1, 1 / 1.1
BREAK = "BREAK"
NORMALIZE_MODES = ("original", "abs", "none")
_WEIGHT = re.compile(r":\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*\)")  # ":1.3)" closing a "(text:1.3)"
_BREAK = re.compile(r"\s*\bBREAK\b\s*")
_ESCAPES = {"\\(": "(", "\\)": ")", "\\[": "[", "\\]": "]", "\\\\": "\\"}


# ----------------------------------------------------------------------------------------------------------------------
# Parsing


def parse_weighted(text: str) -> list[tuple[str, float]]:
    """``"a (b:1.5) [c]"`` -> ``[("a ", 1.0), ("b", 1.5), ("c", 0.909...)]`` (whitespace-only spans are dropped).

    Adjacent spans of equal weight are merged; ``BREAK`` comes back as the span ``("BREAK", -1.0)``. Round and square
    brackets are matched separately (as A1111 does), each by the nearest open bracket of its kind.
    """
    spans: list[list[Any]] = []  # [text, weight]
    opened: dict[str, list[int]] = {"(": [], "[": []}  # index of the first span inside each open bracket
    i = 0
    while i < len(text):
        two, ch = text[i : i + 2], text[i]
        if two in _ESCAPES:
            spans.append([_ESCAPES[two], 1.0])
            i += 2
        elif ch in "([":
            opened[ch].append(len(spans))
            i += 1
        elif ch == ":" and opened["("] and (match := _WEIGHT.match(text, i)):
            _multiply(spans, opened["("].pop(), float(match.group(1)))
            i = match.end()
        elif ch == ")" and opened["("]:
            _multiply(spans, opened["("].pop(), ROUND)
            i += 1
        elif ch == "]" and opened["["]:
            _multiply(spans, opened["["].pop(), SQUARE)
            i += 1
        else:
            end = _plain_end(text, i + 1)
            spans.extend(_split_break(text[i:end]))
            i = end
    for bracket, factor in (("(", ROUND), ("[", SQUARE)):
        for start in opened[bracket]:
            _multiply(spans, start, factor)
    return _merge(spans)


def _plain_end(text: str, i: int) -> int:
    while i < len(text) and text[i] not in "()[]:\\":
        i += 1
    return i


def _split_break(chunk: str) -> list[list[Any]]:
    out: list[list[Any]] = []
    for n, part in enumerate(_BREAK.split(chunk)):
        if n:
            out.append([BREAK, -1.0])
        if part:
            out.append([part, 1.0])
    return out


def _multiply(spans: list[list[Any]], start: int, factor: float) -> None:
    for span in spans[start:]:
        if span[1] >= 0:
            span[1] *= factor


def _merge(spans: list[list[Any]]) -> list[tuple[str, float]]:
    out: list[list[Any]] = []
    for text, weight in spans:
        if out and out[-1][1] == weight and weight >= 0:
            out[-1][0] += text
        else:
            out.append([text, weight])
    return [(t, w) for t, w in out if t.strip() or w < 0] or [("", 1.0)]


# ----------------------------------------------------------------------------------------------------------------------
# Tokens


def weighted_token_ids(
    tokenizer: Any, prompt: str, expansions: dict[int, list[int]] | None = None
) -> tuple[list[int], list[float]]:
    """Token ids of ``prompt`` without BOS/EOS and one weight per id; ``expansions`` maps a textual-inversion token id
    to all its vector ids (ComfyUI's ``embedding:<name>`` is accepted for ``<name>`` then)."""
    if expansions:
        from library.text.textual_inversion import strip_embedding_prefix

        prompt = strip_embedding_prefix(prompt)
    spans = parse_weighted(prompt)
    texts = [t for t, w in spans if w >= 0]
    encoded = iter(tokenizer(texts).input_ids if texts else [])
    ids: list[int] = []
    weights: list[float] = []
    for _text, weight in spans:
        if weight < 0:  # BREAK: pad to the end of the current chunk
            fill = (-len(ids)) % CHUNK
            ids += [tokenizer.pad_token_id] * fill
            weights += [1.0] * fill
            continue
        for token in next(encoded)[1:-1]:
            expanded = (expansions or {}).get(token, [token])
            ids += expanded
            weights += [weight] * len(expanded)
    return ids, weights


def num_chunks(lengths: Sequence[int], max_embeddings_multiples: int) -> int:
    """Chunks of 75 needed for the longest of ``lengths`` tokens, in ``[1, max_embeddings_multiples]``."""
    if max_embeddings_multiples < 1:
        raise ValueError(f"--max_embeddings_multiples must be >= 1, got {max_embeddings_multiples}")
    need = max([math.ceil(n / CHUNK) for n in lengths] + [1])
    if need > max_embeddings_multiples:
        log.warning(
            "a prompt has %d tokens; only the first %d are used (raise --max_embeddings_multiples to use more)",
            max(lengths),
            CHUNK * max_embeddings_multiples,
        )
    return min(need, max_embeddings_multiples)


def chunk_ids(ids: list[int], k: int, tokenizer: Any) -> Tensor:
    """(77k,) long: ``ids`` laid out in k chunks exactly as ``library.families.text.tokenize`` lays out a caption."""
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    body = ids[: CHUNK * k]
    full = torch.tensor([bos, *body, eos] + [pad] * (CHUNK * k - len(body)), dtype=torch.long)
    if k == 1:
        return full
    chunks = []
    for i in range(k):
        chunk = torch.cat([full[:1], full[1 + CHUNK * i : 1 + CHUNK * (i + 1)], full[-1:]])
        if chunk[-2] != eos and chunk[-2] != pad:
            chunk[-1] = eos
        if chunk[1] == pad:
            chunk[1] = eos
        chunks.append(chunk)
    return torch.cat(chunks)


def merged_weights(weights: list[float], k: int) -> Tensor:
    """(75k + 2,) float32 weights aligned with the family's merged hidden states (1.0 at BOS, end, padding)."""
    body = weights[: CHUNK * k]
    return torch.tensor([1.0, *body] + [1.0] * (CHUNK * k + 1 - len(body)), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Encoding


def apply_weights(hidden: Tensor, weights: Tensor, normalize: str = "original") -> Tensor:
    """(B, L, D) hidden states times (B, L) weights, with each prompt's mean restored (module docstring, step 4)."""
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"--emb_normalize_mode {normalize!r}: use one of {', '.join(NORMALIZE_MODES)}")
    if hidden.shape[:2] != weights.shape:
        raise ValueError(f"weights {tuple(weights.shape)} do not match hidden states {tuple(hidden.shape)}")
    h = hidden.float()
    w = weights.to(h.device, torch.float32)
    out = h * w.unsqueeze(-1)
    if normalize != "none":
        measure = (lambda x: x.abs()) if normalize == "abs" else (lambda x: x)
        before = measure(h).mean(dim=(-2, -1))
        after = measure(out).mean(dim=(-2, -1))
        nonzero = after.abs() > 1e-12  # a zero mean: no rescale (and no 0/0 in the gradient of the unused branch)
        ratio = torch.where(
            nonzero, before / torch.where(nonzero, after, torch.ones_like(after)), torch.ones_like(after)
        )
        out = out * ratio[:, None, None]
    untouched = (w == 1.0).all(dim=1)
    out = torch.where(untouched[:, None, None], h, out)
    return out.to(hidden.dtype)


def encode_weighted(
    family: ModelFamily,
    parts: Parts,
    prompts: Sequence[str],
    *,
    clip_skip: int | None = None,
    max_embeddings_multiples: int = 3,
    normalize: str = "original",
    min_chunks: int = 1,
) -> Any:
    """``Cond`` for ``prompts`` with weighting and long-prompt chunking (module docstring).

    All prompts of the call share one chunk count, so encode a prompt and its negative in one call (or pass
    ``min_chunks``). Hidden states (B, 75k + 2, D); pooled (B, P) or None as the family gives it.
    """
    from library.families.base import Cond
    from library.text.textual_inversion import token_expansions

    expansions = token_expansions(parts)
    per_tokenizer = [
        [weighted_token_ids(tok, p, expansions[i]) for p in prompts] for i, tok in enumerate(parts.tokenizers)
    ]
    lengths = [len(ids) for ids, _ in per_tokenizer[0]]
    for other in per_tokenizer[1:]:
        if [len(ids) for ids, _ in other] != lengths:
            raise RuntimeError("the text encoders' tokenizers split the prompt differently; cannot align weights")
    k = max(min_chunks, num_chunks(lengths, max_embeddings_multiples))
    tokens = [
        torch.stack([chunk_ids(ids, k, tok) for ids, _ in rows]) for tok, rows in zip(parts.tokenizers, per_tokenizer)
    ]
    weights = torch.stack([merged_weights(w, k) for _, w in per_tokenizer[0]])
    cond = family.encode_tokens(parts, tokens, clip_skip=clip_skip)
    blocks = cond.hidden_states.chunk(getattr(family, "context_blocks", 1), dim=1)  # XTI: one per layer, each weighted
    return Cond(torch.cat([apply_weights(h, weights, normalize) for h in blocks], dim=1), cond.pooled)
