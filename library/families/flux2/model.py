"""FLUX.2's transformer: diffusers' ``Flux2Transformer2DModel`` (musubi-tuner's ``flux2_models.Flux2`` under BFL names,
``keys.py``), its released configs, the config read from a file's shapes, and the call with FLUX.2's 4-axis position
ids (musubi-tuner's ``prc_img`` / ``prc_txt`` / ``pack_control_latent``).

Released: dev (8 double + 48 single blocks, width 6144, Mistral 3's 3 x 5120 text width, guidance embedding), klein 4B
(5 + 20, width 3072, Qwen3-4B's 3 x 2560), klein 9B (8 + 24, width 4096, Qwen3-8B's 3 x 4096); klein base 4B / 9B have
their klein's architecture (not guidance distilled: told apart by ``--model_version`` or the file name). All take
128 channels (the AE's 32 latent channels in 2 x 2 patches), heads of 128, RoPE axes 4 x 32 with θ = 2000.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

_BASE = dict(patch_size=1, in_channels=128, out_channels=None, attention_head_dim=128, timestep_guidance_channels=256,
             mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6)  # fmt: skip
DEV = dict(_BASE, num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
           guidance_embeds=True)  # fmt: skip
KLEIN_4B = dict(_BASE, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                guidance_embeds=False)  # fmt: skip
KLEIN_9B = dict(_BASE, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                guidance_embeds=False)  # fmt: skip
# the tiny test DiT: klein's layout at width 32 (2 heads of 16, RoPE 4 x 4), the tiny Qwen3's 3 x 16 text width
TINY = dict(_BASE, num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=16,
            joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)  # fmt: skip
RELEASED = {"dev": DEV, "klein-4b": KLEIN_4B, "klein-9b": KLEIN_9B}
REF_TIME_SCALE = 10  # reference image k's tokens sit at time coordinate 10 + 10 k (musubi-tuner, BFL)


def build(config: Mapping[str, Any]) -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    cfg = dict(config)
    cfg["axes_dims_rope"] = tuple(cfg["axes_dims_rope"])
    return Flux2Transformer2DModel(**cfg)


def factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    return lambda: build(config)


def config_from_shapes(state: Mapping[str, Any], shape, candidates: list[dict]) -> dict | None:
    """A diffusers config read from the (diffusers-named) weights: width and channels (``x_embedder``), text width
    (``context_embedder``), head width (the q norm), depths, MLP ratio, guidance; the RoPE axes are the head width in
    4 equal parts (as every released model)."""
    keys = list(state.keys())
    if not all(k in keys for k in ("x_embedder.weight", "context_embedder.weight", "proj_out.weight")):
        return None
    width, channels = shape("x_embedder.weight")
    norm = next((k for k in keys if k.endswith("attn.norm_q.weight")), None)
    head = shape(norm)[0] if norm else 128
    double = 1 + max((int(k.split(".")[1]) for k in keys if k.startswith("transformer_blocks.")), default=-1)
    single = 1 + max((int(k.split(".")[1]) for k in keys if k.startswith("single_transformer_blocks.")), default=-1)
    mlp = "transformer_blocks.0.ff.linear_in.weight"
    ratio = shape(mlp)[0] / 2 / width if mlp in keys else 3.0
    guidance = any(k.startswith("time_guidance_embed.guidance_embedder.") for k in keys)
    return dict(_BASE, in_channels=channels, num_layers=double, num_single_layers=single, attention_head_dim=head,
                num_attention_heads=width // head, joint_attention_dim=shape("context_embedder.weight")[1],
                mlp_ratio=ratio, guidance_embeds=guidance, axes_dims_rope=(head // 4,) * 4)  # fmt: skip


def variant_of(config: Mapping[str, Any]) -> str | None:
    """ "dev", "klein-4b", "klein-9b" when ``config`` has a released architecture, else None (tiny, pruned)."""
    keys = ("num_layers", "num_single_layers", "num_attention_heads", "joint_attention_dim", "guidance_embeds")
    return next((name for name, c in RELEASED.items() if all(config.get(k) == c[k] for k in keys)), None)


def image_ids(h: int, w: int, t: int = 0, device: Any = None) -> Tensor:
    """(h·w, 4) int64 position ids (t, row, column, 0) of an (h, w) latent grid, rows first (``prc_img``)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], dim=-1)
    return ids.reshape(-1, 4).to(device)


def text_ids(length: int, device: Any = None) -> Tensor:
    """(L, 4) int64 ids (0, 0, 0, l) of L text tokens (``prc_txt``)."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


def tokens(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h·w, C)."""
    return latents.flatten(2).transpose(1, 2)


def forward(denoiser: nn.Module, noisy: Tensor, t: Tensor, states: Tensor, guidance: Tensor | None = None,
            references: Sequence[Tensor] = ()) -> Tensor:  # fmt: skip
    """The velocity (B, C, h, w) of ``noisy`` (B, 128, h, w) at ``t`` (B,) in [0, 1] over the text ``states``
    (B, L, D), with ``guidance`` (B,) for a guidance-distilled model and the ``references`` (B, 128, h_k, w_k)
    appended as tokens at time 10 + 10 k (musubi-tuner's ``call_dit``; diffusers multiplies t and guidance by
    1000 as BFL's embedding does)."""
    b, c, h, w = noisy.shape
    x, ids = tokens(noisy), [image_ids(h, w, device=noisy.device)]
    for k, ref in enumerate(references):
        x = torch.cat([x, tokens(ref.to(noisy))], dim=1)
        ids.append(image_ids(ref.shape[-2], ref.shape[-1], REF_TIME_SCALE * (k + 1), noisy.device))
    if guidance is None and denoiser.config.guidance_embeds:
        guidance = torch.ones(b, device=noisy.device)
    out = denoiser(hidden_states=x, encoder_hidden_states=states.to(noisy.dtype), timestep=t.to(noisy.dtype),
                   img_ids=torch.cat(ids), txt_ids=text_ids(states.shape[1], noisy.device),
                   guidance=None if guidance is None or not denoiser.config.guidance_embeds else guidance.to(noisy.dtype),
                   return_dict=False)[0]  # fmt: skip
    return out[:, : h * w].transpose(1, 2).reshape(b, c, h, w)
