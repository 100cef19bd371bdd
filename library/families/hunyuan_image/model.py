"""HunyuanImage 2.1's parts and prompts: the transformer (diffusers ``HunyuanImageTransformer2DModel``), Qwen2.5-VL-7B
(the shared ``encoders/qwen25vl.py``), byT5-small Glyph (transformers ``T5EncoderModel`` with the Glyph colour /
font tokens) and the 32x VAE (diffusers ``AutoencoderKLHunyuanImage``).

Prompts (sd-scripts' ``hunyuan_image_text_encoder`` / ``strategy_hunyuan_image``):

* Qwen2.5-VL: the caption in :data:`TEMPLATE` (Qwen-Image's without the assistant turn), padded to the batch's
  longest, at most 1024 + 34 tokens; the condition is ``hidden_states[-3]`` with the first 34 (template) tokens
  dropped, and its mask. Here the tokens are padded to a fixed length (``max_length`` + 34; the batch collates and
  the cache stacks fixed shapes) and :func:`trim_text` cuts the batch to its longest caption again before the
  transformer runs, so the transformer sees what sd-scripts gives it.
* byT5 Glyph: the texts in double quotes, ‘…’ and “…” of the caption, each written ``Text "<text>". `` one after
  the other, tokenized by ``ByT5Tokenizer`` with the 1126 colour / font tokens added (``data/glyph_tokens.json``),
  padded to 128; a caption without quoted text gives zeros and an all-zero mask (sd-scripts' fallback).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from ..encoders import qwen25vl

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
DROP = 34  # template tokens dropped (sd-scripts' PROMPT_TEMPLATE_ENCODE_START_IDX)
QWEN_LAYER = -3  # hidden_states[-3]
QWEN_MAX_LENGTH = 1024  # caption tokens (sd-scripts' TOKENIZER_MAX_LENGTH)
BYT5_MAX_LENGTH = 128
BYT5_WIDTH = 1472
GLYPH_TOKENS = Path(__file__).parent / "data" / "glyph_tokens.json"
_QUOTES = (re.compile(r"\"(.*?)\""), re.compile(r"‘(.*?)’"), re.compile(r"“(.*?)”"))

TRANSFORMER = dict(
    in_channels=64,
    out_channels=64,
    num_attention_heads=28,
    attention_head_dim=128,
    num_layers=20,
    num_single_layers=40,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=(1, 1),
    qk_norm="rms_norm",
    guidance_embeds=False,
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    rope_theta=256.0,
    rope_axes_dim=(64, 64),
    use_meanflow=False,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=64,
    block_out_channels=(128, 256, 512, 512, 1024, 1024),
    layers_per_block=2,
    spatial_compression_ratio=32,
    sample_size=384,
    scaling_factor=0.75289,
    downsample_match_channel=True,
    upsample_match_channel=True,
)
# google/byt5-small's encoder (sd-scripts' BYT5_CONFIG_JSON) with the Glyph vocabulary (384 + 1126 tokens)
BYT5 = dict(vocab_size=1510, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
            relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
            dropout_rate=0.1, is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1)  # fmt: skip
# sampling: sd-scripts' --flow_shift 5.0 default of hunyuan_image_minimal_inference.py
SCHEDULER = dict(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False, prediction_type="flow_matching")


def released() -> dict:
    return copy.deepcopy({"transformer": TRANSFORMER, "vae": VAE, "byt5": BYT5, "text_encoder": qwen25vl.RELEASED_TEXT,
                          "scheduler": SCHEDULER})  # fmt: skip


class _WithKeywords:
    """A block called with fixed keyword arguments: what a checkpoint function that passes positional inputs only
    calls."""

    def __init__(self, module: nn.Module, kwargs: dict) -> None:
        self.module, self.kwargs = module, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.module(*args, **self.kwargs)


def _exact_time_embedding(embed: nn.Module) -> None:
    """The time embedding as sd-scripts' ``TimestepEmbedder`` computes it: the sinusoid of the float32 timesteps,
    cast to the MLP's weight dtype (diffusers casts it to the timesteps' dtype, so in bf16 it would need bf16
    timesteps, which round 900 to 896). ``embed``'s class becomes a subclass with that forward (copies keep it).
    HunyuanImage 2.1 has no guidance or meanflow embedder."""

    class ExactTimeEmbedding(type(embed)):
        def forward(self, timestep: Tensor, timestep_r: Tensor | None = None, guidance: Tensor | None = None) -> Tensor:
            if timestep_r is not None or guidance is not None:
                raise ValueError("HunyuanImage 2.1 takes no guidance or meanflow timestep")
            proj = self.time_proj(timestep.float())
            return self.timestep_embedder(proj.to(self.timestep_embedder.linear_1.weight.dtype))

    embed.__class__ = ExactTimeEmbedding


def transformer_class() -> type:
    """diffusers' ``HunyuanImageTransformer2DModel`` whose gradient checkpointing takes the blocks' keyword inputs:
    diffusers 0.42.1 calls ``_gradient_checkpointing_func(block, ..., attention_mask=..., image_rotary_emb=...)``,
    which its own default function (and ours for --cpu_offload_checkpointing) does not accept."""
    from diffusers import HunyuanImageTransformer2DModel

    class HunyuanImageTransformer(HunyuanImageTransformer2DModel):
        def enable_gradient_checkpointing(self, gradient_checkpointing_func: Callable | None = None) -> None:
            if gradient_checkpointing_func is None:

                def gradient_checkpointing_func(module: Any, *args: Any) -> Any:
                    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)

            inner = gradient_checkpointing_func

            def with_keywords(module: Any, *args: Any, **kwargs: Any) -> Any:
                return inner(_WithKeywords(module, kwargs) if kwargs else module, *args)

            super().enable_gradient_checkpointing(with_keywords)

    return HunyuanImageTransformer


def transformer_factory(config: Mapping) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = transformer_class().from_config(dict(config))
        _exact_time_embedding(model.time_guidance_embed)
        return model

    return build


def vae_factory(config: Mapping) -> Callable[[], nn.Module]:
    from diffusers import AutoencoderKLHunyuanImage

    return lambda: AutoencoderKLHunyuanImage.from_config(dict(config))


def byt5_factory(config: Mapping) -> Callable[[], nn.Module]:
    from transformers import T5Config, T5EncoderModel

    return lambda: T5EncoderModel(T5Config(**dict(config)))


# ------------------------------------------------------------------------------------------------ byT5 Glyph
@lru_cache(maxsize=1)
def glyph_tokens() -> tuple[str, ...]:
    data = json.loads(GLYPH_TOKENS.read_text(encoding="utf-8"))
    return tuple(data["colors"]) + tuple(data["fonts"])


def load_byt5_tokenizer() -> Any:
    """``ByT5Tokenizer`` (no files) with the Glyph colour / font tokens added (1510 ids, as the Glyph checkpoint)."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.add_tokens(list(glyph_tokens()), special_tokens=True)
    return tokenizer


def glyph_text(caption: str) -> str | None:
    """sd-scripts' glyph prompt of a caption: its quoted texts as ``Text "<t>". `` each, or None without any."""
    texts = [t for pattern in _QUOTES for t in pattern.findall(caption)]
    if not texts:
        return None
    return "".join(f'Text "{t}". ' for t in texts)


def tokenize_byt5(tokenizer: Any, captions: Sequence[str]) -> tuple[Tensor, Tensor]:
    """(ids, mask) (B, 128) int64; rows of captions without quoted text are zeros (their mask too)."""
    ids = torch.zeros(len(captions), BYT5_MAX_LENGTH, dtype=torch.long)
    mask = torch.zeros(len(captions), BYT5_MAX_LENGTH, dtype=torch.long)
    for i, caption in enumerate(captions):
        text = glyph_text(caption)
        if text is None:
            continue
        out = tokenizer(text, padding="max_length", max_length=BYT5_MAX_LENGTH, truncation=True,
                        add_special_tokens=True, return_tensors="pt")  # fmt: skip
        ids[i], mask[i] = out.input_ids[0], out.attention_mask[0]
    return ids, mask


def encode_byt5(byt5: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """(B, 128, 1472) byT5 states; zeros for rows without glyph text (sd-scripts' fallback)."""
    device = next(byt5.parameters()).device
    out = torch.zeros(ids.shape[0], ids.shape[1], byt5.config.d_model, device=device)
    has = mask.sum(dim=1) > 0
    if has.any():
        states = byt5(input_ids=ids[has].to(device), attention_mask=mask[has].to(device).float()).last_hidden_state
        out = out.to(states.dtype)
        out[has.to(device)] = states
    return out


# ------------------------------------------------------------------------------------------------ Qwen2.5-VL
def tokenize_qwen(tokenizer: Any, captions: Sequence[str], max_length: int = QWEN_MAX_LENGTH) -> tuple[Tensor, Tensor]:
    """(ids, mask) (B, max_length + 34) int64: the captions in :data:`TEMPLATE`, right-padded to the fixed length."""
    texts = [TEMPLATE.format(c) for c in captions]
    out = tokenizer(texts, max_length=max_length + DROP, padding="max_length", truncation=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


def encode_qwen(model: nn.Module, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(states (B, L - 34, 3584), mask (B, L - 34)): ``hidden_states[-3]`` without the template's 34 tokens."""
    states = qwen25vl.hidden(model, ids, mask, QWEN_LAYER)
    return states[:, DROP:], mask[:, DROP:].to(states.device)


def trim_text(states: Tensor, mask: Tensor, minimum: int = 1) -> tuple[Tensor, Tensor]:
    """The batch cut to its longest caption (right padding; at least ``minimum`` tokens), as sd-scripts' batch-longest
    padding gives it."""
    longest = max(int(mask.sum(dim=1).max().item()), minimum)
    return states[:, :longest], mask[:, :longest]


# ------------------------------------------------------------------------------------------------ Cond packing
def pack(qwen_states: Tensor, qwen_mask: Tensor, byt5_states: Tensor, byt5_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden (B, Lq + 128, 3584), mask (B, Lq + 128)): byT5's 128 rows after Qwen's, zero-padded to Qwen's width
    (one tensor for the text cache and the batch collation); :func:`unpack` is the inverse."""
    width = qwen_states.shape[-1]
    if byt5_states.shape[-1] > width:
        raise ValueError(f"byT5 width {byt5_states.shape[-1]} exceeds the Qwen width {width}")
    padded = torch.nn.functional.pad(byt5_states.to(qwen_states.dtype), (0, width - byt5_states.shape[-1]))
    hidden = torch.cat([qwen_states, padded.to(qwen_states.device)], dim=1)
    mask = torch.cat([qwen_mask.long().to(qwen_states.device), byt5_mask.long().to(qwen_states.device)], dim=1)
    return hidden, mask


def unpack(hidden: Tensor, mask: Tensor, byt5_width: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`pack`'s inverse: (qwen states, qwen mask, byt5 states (B, 128, byt5_width), byt5 mask)."""
    if hidden.ndim != 3 or mask is None or hidden.shape[1] <= BYT5_MAX_LENGTH or mask.shape != hidden.shape[:2]:
        raise ValueError("HunyuanImage's conditioning must be [Qwen states | byT5 states] (B, Lq + 128, D) with its "
                         f"mask (B, Lq + 128); got {tuple(hidden.shape)} and "
                         f"{None if mask is None else tuple(mask.shape)}")  # fmt: skip
    mask = (mask.round() if mask.is_floating_point() else mask).long()
    cut = hidden.shape[1] - BYT5_MAX_LENGTH
    return hidden[:, :cut], mask[:, :cut], hidden[:, cut:, :byt5_width], mask[:, cut:]
