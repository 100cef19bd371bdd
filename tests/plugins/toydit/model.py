"""ToyDiT's own modules: a tiny flow-matching diffusion transformer, its byte-level text encoder and tokenizer.

The transformer patchifies (B, C, H, W) latents into 2×2 patches, adds a fixed 2-D sin-cos position table, and runs
``depth`` blocks (:class:`ToyDiTBlock`): adaLN modulation from the model time τ and the pooled text, self-attention
over the image tokens, cross-attention to the text tokens (padding masked), an MLP; a final adaLN layer projects
back to patches. Its time runs the other way round from σ: τ = 1 − σ (τ = 1 is clean), and it is trained to predict
x0 − ε (``objective.py``).

The text encoder reads bytes: ids 0 (pad), 1 (begin), 2 (end), 3 + byte; two pre-norm transformer layers; its pooled
output is the mean over the caption's tokens. Nothing is downloaded: the tokenizer is this file's twenty lines.

Both take ``--gradient_checkpointing`` the way the run layer asks diffusers / transformers models for it
(``enable_gradient_checkpointing(gradient_checkpointing_func=None)`` on the denoiser, with
``_supports_gradient_checkpointing`` for ``--cpu_offload_checkpointing``; ``gradient_checkpointing_enable(
gradient_checkpointing_kwargs=None)`` on a trained text encoder). No module reads a Linear's ``.weight`` outside that
Linear's own forward: adapters (``AdapterLayer``) and ``--fp8_base`` (float8 storage swapped for a compute copy
during the layer's forward) replace or wrap it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from library.objectives.base import FLOW_MATCHING

PAD, BOS, EOS, BYTE0 = 0, 1, 2, 3
VOCAB = BYTE0 + 256

DIT_CONFIG = dict(in_channels=4, patch_size=2, width=32, depth=2, heads=2, mlp_ratio=2, text_width=16, freq_dim=32)
TEXT_CONFIG = dict(vocab_size=VOCAB, width=16, depth=2, heads=2, max_positions=64)
# the VAE: a tiny diffusers AutoencoderKL, 8x down to 4 channels; the sampling schedule's static shift
VAE_CONFIG = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 8, 8, 8], layers_per_block=1,
                  latent_channels=4, norm_num_groups=4, sample_size=64, scaling_factor=0.5)  # fmt: skip
SCHEDULER = {"prediction_type": FLOW_MATCHING, "num_train_timesteps": 1000, "shift": 2.0}


class ByteTokenizer:
    """Captions -> (ids (B, L) long, mask (B, L) bool): begin, the caption's UTF-8 bytes (cut to fit), end, padding."""

    pad_token_id = PAD

    def __call__(self, captions: list[str], length: int) -> tuple[Tensor, Tensor]:
        if length < 3:
            raise ValueError(f"ToyDiT: {length} tokens per caption cannot hold a caption (begin, a byte, end)")
        ids = torch.full((len(captions), length), PAD, dtype=torch.long)
        for row, caption in enumerate(captions):
            body = [BYTE0 + b for b in caption.encode("utf-8")[: length - 2]]
            tokens = [BOS, *body, EOS]
            ids[row, : len(tokens)] = torch.tensor(tokens)
        return ids, ids != PAD


def _heads(x: Tensor, heads: int) -> Tensor:
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)


def _attend(q: Tensor, k: Tensor, v: Tensor, heads: int, mask: Tensor | None) -> Tensor:
    """Multi-head SDPA; ``mask`` (B, Lk) bool: the keys attended."""
    attn_mask = None if mask is None else mask[:, None, None, :].to(q.device)
    out = F.scaled_dot_product_attention(_heads(q, heads), _heads(k, heads), _heads(v, heads), attn_mask=attn_mask)
    b, _, n, _ = out.shape
    return out.transpose(1, 2).reshape(b, n, -1)


# ------------------------------------------------------------------------------------------------ the text encoder
class ToyTextAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(_attend(q, k, v, self.heads, mask))


class ToyTextLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = ToyTextAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ToyTextEncoder(nn.Module):
    """Byte ids (B, L) -> (hidden states (B, L, width), pooled (B, width): the mean over the unmasked tokens)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        c = self.config
        self.token_embedding = nn.Embedding(c["vocab_size"], c["width"])
        self.position_embedding = nn.Embedding(c["max_positions"], c["width"])
        self.layers = nn.ModuleList(ToyTextLayer(c["width"], c["heads"]) for _ in range(c["depth"]))
        self.final_norm = nn.LayerNorm(c["width"])
        self._checkpoint: Callable | None = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None) -> None:
        """transformers' method (``library.run.setup.enable_checkpointing`` calls it for a trained encoder)."""
        kwargs = dict(gradient_checkpointing_kwargs or {"use_reentrant": False})
        self._checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if ids.shape[1] > self.config["max_positions"]:
            raise ValueError(f"ToyDiT's text encoder reads at most {self.config['max_positions']} tokens, got "
                             f"{ids.shape[1]}")  # fmt: skip
        device = next(self.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        x = self.token_embedding(ids) + self.position_embedding(torch.arange(ids.shape[1], device=device))
        for layer in self.layers:
            x = self._checkpoint(layer, x, mask) if self._checkpoint and torch.is_grad_enabled() else layer(x, mask)
        x = self.final_norm(x)
        weights = mask.to(x.dtype).unsqueeze(-1)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1)
        return x, pooled


# ------------------------------------------------------------------------------------------------ the transformer
def time_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features (B, dim) of the model time τ (B,) in [0, 1], scaled by 1000 (DiT's ``TimestepEmbedder``)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def position_table(rows: int, cols: int, width: int, device: torch.device) -> Tensor:
    """The fixed 2-D sin-cos table (rows·cols, width): half the features for the row, half for the column."""
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    parts = []
    for pos in (r.flatten().float(), c.flatten().float()):
        angles = pos[:, None] * omega[None]
        parts += [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class ToySelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(_attend(q, k, v, self.heads, None))


class ToyCrossAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(width, width)
        self.to_v = nn.Linear(width, width)
        self.to_out = nn.Linear(width, width)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        out = _attend(self.to_q(x), self.to_k(context), self.to_v(context), self.heads, mask)
        return self.to_out(out)


class ToyMLP(nn.Module):
    def __init__(self, width: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, ratio * width)
        self.fc2 = nn.Linear(ratio * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ToyDiTBlock(nn.Module):
    """adaLN (shift, scale, gate for each of self-attention, cross-attention, MLP) from the conditioning vector."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(width, 9 * width)
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = ToySelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.cross = ToyCrossAttention(width, heads)
        self.norm3 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = ToyMLP(width, mlp_ratio)

    def forward(self, x: Tensor, c: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        s1, c1, g1, s2, c2, g2, s3, c3, g3 = self.modulation(F.silu(c)).chunk(9, dim=-1)
        x = x + g1[:, None] * self.attn(modulate(self.norm1(x), s1, c1))
        x = x + g2[:, None] * self.cross(modulate(self.norm2(x), s2, c2), context, mask)
        return x + g3[:, None] * self.mlp(modulate(self.norm3(x), s3, c3))


class ToyFinalLayer(nn.Module):
    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.modulation(F.silu(c)).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


class ToyTimeEmbedder(nn.Module):
    def __init__(self, freq_dim: int, width: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, width)
        self.linear_2 = nn.Linear(width, width)

    def forward(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        features = time_embedding(t, self.freq_dim).to(dtype)
        return self.linear_2(F.silu(self.linear_1(features)))


class ToyDiT(nn.Module):
    """``forward(x (B, C, H, W), t (B,) model time τ in [0, 1], context (B, L, text_width), pooled (B, text_width),
    mask (B, L) bool or None) -> (B, C, H, W)``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        c = self.config
        w, p = c["width"], c["patch_size"]
        self.x_embedder = nn.Linear(c["in_channels"] * p * p, w)
        self.t_embedder = ToyTimeEmbedder(c["freq_dim"], w)
        self.y_embedder = nn.Linear(c["text_width"], w)
        self.context_embedder = nn.Linear(c["text_width"], w)
        self.layers = nn.ModuleList(ToyDiTBlock(w, c["heads"], c["mlp_ratio"]) for _ in range(c["depth"]))
        self.final_layer = ToyFinalLayer(w, c["in_channels"] * p * p)
        self._checkpoint: Callable | None = None

    _supports_gradient_checkpointing = True

    def enable_gradient_checkpointing(self, gradient_checkpointing_func: Callable | None = None) -> None:
        """diffusers' method: each block runs under ``gradient_checkpointing_func(block, *inputs)`` (default torch's
        non-reentrant checkpoint) while gradients are on."""
        self._checkpoint = gradient_checkpointing_func or functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )

    def forward(self, x: Tensor, t: Tensor, context: Tensor, pooled: Tensor, mask: Tensor | None = None) -> Tensor:
        b, ch, h, w = x.shape
        p = self.config["patch_size"]
        if h % p or w % p:
            raise ValueError(f"ToyDiT: latents {h}x{w} are not multiples of the patch size {p}")
        tokens = x.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)
        table = position_table(h // p, w // p, self.config["width"], x.device).to(x.dtype)
        hidden = self.x_embedder(tokens) + table
        cond = self.t_embedder(t.to(x.device), x.dtype) + self.y_embedder(pooled)
        context = self.context_embedder(context)
        for block in self.layers:
            if self._checkpoint is not None and torch.is_grad_enabled():
                hidden = self._checkpoint(block, hidden, cond, context, mask)
            else:
                hidden = block(hidden, cond, context, mask)
        out = self.final_layer(hidden, cond)
        return out.reshape(b, h // p, w // p, ch, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, ch, h, w)
