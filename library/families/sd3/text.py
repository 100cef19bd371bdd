"""SD3 / SD3.5 prompts, as sd-scripts encodes them (``library/strategy_sd3.py``) and ``StableDiffusion3Pipeline``'s
``encode_prompt`` does:

* ids: CLIP-L and CLIP-G padded to 77 (CLIP-L pads with ``<|endoftext|>``, CLIP-G with "!", id 0: sd-scripts sets
  ``pad_token_id = 0``), T5 padded to ``--t5xxl_max_token_length`` (256), each truncated, with its attention mask;
* CLIP-L / CLIP-G: the penultimate hidden state (``hidden_states[-2]``, (B, 77, 768) / (B, 77, 1280)) and the
  projected pooled output (``text_embeds``); with ``--apply_lg_attn_mask`` the CLIP models get their masks;
* T5: the last hidden state (B, T, 4096); with ``--apply_t5_attn_mask`` T5 gets its mask;
* context = [CLIP-L ‖ CLIP-G along the features, zero-padded to T5's width (4096)] ‖ T5 along the sequence:
  (B, 77 + T, 4096); pooled = CLIP-L ‖ CLIP-G text_embeds (B, 2048). The transformer takes no text mask
  (sd-scripts: "TODO support attention mask"), so ``Cond.mask`` stays None.

Per-encoder dropout (``--clip_l_dropout_rate --clip_g_dropout_rate --t5_dropout_rate``): sd-scripts zeroes one
encoder's whole output for a sample (CLIP-L: context features [:768] of the 77 CLIP tokens and pooled [:768]; CLIP-G:
features [768:2048] and pooled [768:]; T5: the T5 tokens), drawing Python's ``random.random() < rate`` per sample
in the order (L, G) for every sample, then T5 for every sample (``Sd3TextEncodingStrategy.encode_tokens`` and
``drop_cached_text_encoder_outputs`` draw alike). :func:`drop_encoders` is that law on an encoded conditioning.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base import Cond
from ..encoders import clip
from ..encoders.t5 import load_t5_tokenizer, t5_hidden, tokenize_t5  # noqa: F401  (SD3's T5)

CLIP_LENGTH = clip.LENGTH
T5_DEFAULT_LENGTH = 256  # sd-scripts' --t5xxl_max_token_length default for SD3


def tokenize_clip(tokenizer, captions: list[str]) -> tuple[Tensor, Tensor]:
    """(ids (B, 77), attention mask (B, 77)): ``<BOS> tokens <EOS> <pad>...``, truncated."""
    return clip.tokenize(tokenizer, captions)


def clip_outputs(clip_model: nn.Module, ids: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(penultimate hidden state (B, 77, D), projected pooled ``text_embeds`` (B, P)) of a
    ``CLIPTextModelWithProjection``; ``mask`` is its attention mask when given (``--apply_lg_attn_mask``)."""
    return clip.penultimate_and_projected(clip_model, ids, mask)


def join(l_out: Tensor, g_out: Tensor, t5_out: Tensor, l_pooled: Tensor, g_pooled: Tensor) -> Cond:
    """Cond(context (B, 77 + T, D_t5), pooled (B, P_l + P_g)): CLIP-L ‖ CLIP-G features zero-padded to T5's width,
    then T5's tokens (sd-scripts' ``concat_encodings``, the pipeline's ``encode_prompt``)."""
    dtype = t5_out.dtype
    lg = torch.cat([l_out.to(dtype), g_out.to(dtype)], dim=-1)
    width = t5_out.shape[-1]
    if lg.shape[-1] > width:
        raise ValueError(f"CLIP-L + CLIP-G width {lg.shape[-1]} exceeds T5's width {width}; the encoders do not match")
    lg = nn.functional.pad(lg, (0, width - lg.shape[-1]))
    context = torch.cat([lg, t5_out.to(lg.device)], dim=-2)
    pooled = torch.cat([l_pooled, g_pooled], dim=-1).to(dtype)
    return Cond(context, pooled, None)


@dataclass(frozen=True)
class TextDropout:
    """sd-scripts' per-encoder dropout of one model: rates, and where each encoder's output sits in a conditioning
    (``l_width`` / ``g_width``: CLIP-L / CLIP-G hidden widths in the context, ``l_pooled``: CLIP-L's pooled width;
    the CLIP tokens are the first 77)."""

    clip_l_rate: float = 0.0
    clip_g_rate: float = 0.0
    t5_rate: float = 0.0
    l_width: int = 768
    g_width: int = 1280
    l_pooled: int = 768

    @property
    def active(self) -> bool:
        return self.clip_l_rate > 0 or self.clip_g_rate > 0 or self.t5_rate > 0

    def draws(self, batch: int, rng: random.Random | None = None) -> tuple[list[bool], list[bool], list[bool]]:
        """Which samples lose CLIP-L, CLIP-G, T5, drawn as sd-scripts does (``random.random()``; a rate of 0 draws
        nothing)."""
        draw = (rng or random).random
        drop_l, drop_g = [], []
        for _ in range(batch):
            drop_l.append(self.clip_l_rate > 0.0 and draw() < self.clip_l_rate)
            drop_g.append(self.clip_g_rate > 0.0 and draw() < self.clip_g_rate)
        drop_t5 = [self.t5_rate > 0.0 and draw() < self.t5_rate for _ in range(batch)]
        return drop_l, drop_g, drop_t5


def drop_encoders(cond: Cond, dropout: TextDropout, rng: random.Random | None = None) -> Cond:
    """``cond`` with the dropped encoders' outputs zeroed per sample (see the module docstring); a new Cond (the
    input, e.g. a cached entry, is not written)."""
    if not dropout.active:
        return cond
    drop_l, drop_g, drop_t5 = dropout.draws(cond.hidden_states.shape[0], rng)
    if not (any(drop_l) or any(drop_g) or any(drop_t5)):
        return cond
    hidden = cond.hidden_states.clone()
    pooled = cond.pooled.clone() if cond.pooled is not None else None
    lw, gw = dropout.l_width, dropout.g_width
    for i in range(hidden.shape[0]):
        if drop_l[i]:
            hidden[i, :CLIP_LENGTH, :lw] = 0
            if pooled is not None:
                pooled[i, : dropout.l_pooled] = 0
        if drop_g[i]:
            hidden[i, :CLIP_LENGTH, lw : lw + gw] = 0
            if pooled is not None:
                pooled[i, dropout.l_pooled :] = 0
        if drop_t5[i]:
            hidden[i, CLIP_LENGTH:] = 0
    return Cond(hidden, pooled, cond.mask)
