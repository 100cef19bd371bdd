"""FLUX.1 / Chroma prompts: CLIP-L's pooled output and T5-XXL's last hidden state, as sd-scripts encodes them
(``library/strategy_flux.py``): CLIP-L ids padded to 77, T5 ids padded to ``--t5xxl_max_token_length`` (512 for
dev, 256 for schnell; sd-scripts' defaults), the T5 attention mask (1 for tokens and the closing ``</s>``, 0 for
padding). With ``--apply_t5_attn_mask`` the mask goes to T5 and to the transformer's attention; without it T5
sees the padding (sd-scripts' default) and the conditioning carries no mask. Chroma has no CLIP-L and always uses
the mask.

The T5 tokenizer and encoder, and CLIP-L, are the shared encoders' (``encoders/t5.py``, ``encoders/clip.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..encoders import clip
from ..encoders.t5 import T5_TOKENIZER_ID, load_t5_tokenizer, t5_hidden, tokenize_t5  # noqa: F401  (FLUX's T5)

CLIP_L_LENGTH = clip.LENGTH


def tokenize_clip_l(tokenizer, captions: list[str]) -> Tensor:
    """CLIP-L ids (B, 77): ``<BOS> tokens <EOS> <pad>...``, truncated (sd-scripts ignores ``--max_token_length``)."""
    return clip.tokenize(tokenizer, captions)[0]


def clip_l_pooled(clip_l: nn.Module, ids: Tensor) -> Tensor:
    """(B, 768) CLIP-L ``pooler_output`` (final-normed state at the EOS token; no projection), as sd-scripts."""
    return clip.pooled(clip_l, ids)


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


def trim_padding(states: Tensor, mask: Tensor, extra_padding: int) -> tuple[Tensor, Tensor | None]:
    """``(states, mask)`` cut to the batch's longest text + ``extra_padding`` rows (right padding): the rows no token
    attends are dropped, as sd-scripts' Chroma forward cuts them (``max_txt_len``); the mask is None when every row
    left is attended by every sample. One host read (the lengths)."""
    lengths = mask.sum(dim=-1)
    shortest, longest = (int(v) for v in torch.stack([lengths.min(), lengths.max()]).tolist())
    keep = min(longest + extra_padding, mask.shape[1])
    return states[:, :keep], None if shortest + extra_padding >= keep else mask[:, :keep]
