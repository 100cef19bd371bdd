"""Qwen-Image's DiT: diffusers' ``QwenImageTransformer2DModel`` (musubi-tuner's ``qwen_image_model`` has the same
module names), its configs, and the 2x2 latent packing (musubi-tuner's ``pack_latents`` / ``unpack_latents``).

The released model (Qwen/Qwen-Image, -Edit, -Edit-2509): 60 dual-stream blocks, 24 heads of 128, text width 3584
(Qwen2.5-VL-7B), 16 latent channels packed 2x2 into 64. Edit-2511 adds ``zero_cond_t`` (its ComfyUI file carries the
``__index_timestep_zero__`` marker).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

RELEASED = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                axes_dims_rope=(16, 56, 56))  # fmt: skip
# the tiny test DiT: the released layout at width 32 (2 heads of 16, rope axes 2 + 7 + 7 = 16 / 2... of the head)
TINY = dict(RELEASED, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
            axes_dims_rope=(4, 6, 6))  # fmt: skip
# musubi-tuner's qwen_image_utils scheduler constants (the dynamic shift of sampling)
SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
             "shift": 1.0, "use_dynamic_shifting": True, "prediction_type": "flow_matching"}  # fmt: skip


def build(config: Mapping[str, Any]) -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    cfg = dict(config)
    cfg["axes_dims_rope"] = tuple(cfg["axes_dims_rope"])
    return QwenImageTransformer2DModel(**cfg)


def factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    return lambda: build(config)


def config_from_shapes(state: Mapping[str, Any], shape, candidates: list[dict]) -> dict | None:
    """The DiT's config read from its weights: depth (``transformer_blocks.N``), width, head width (the q norm's
    length) and head count, text width (``txt_in``), channels (``img_in`` / ``proj_out``); the RoPE axes of a candidate
    with that head width."""
    keys = list(state.keys())
    needed = ("img_in.weight", "txt_in.weight", "proj_out.weight")
    if not candidates or not all(k in keys for k in needed):
        return None
    base = candidates[0]
    width, in_channels = shape("img_in.weight")
    norm = "transformer_blocks.0.attn.norm_q.weight"
    head = shape(norm)[0] if norm in keys else int(base["attention_head_dim"])
    # RoPE axes are not in the weights: a candidate's of the same head width, else an even split (a guess)
    axes = next((tuple(c["axes_dims_rope"]) for c in candidates if sum(c["axes_dims_rope"]) == head), None)
    if axes is None:
        t = max(2, head // 8 // 2 * 2)
        a = (head - t) // 2 // 2 * 2
        axes = (t, a, head - t - a)
    depth = 1 + max((int(k.split(".")[1]) for k in keys if k.startswith("transformer_blocks.")), default=-1)
    out = shape("proj_out.weight")[0] // (base["patch_size"] ** 2)
    return dict(base, num_layers=depth, num_attention_heads=width // head, attention_head_dim=head,
                axes_dims_rope=axes, in_channels=in_channels,
                out_channels=out, joint_attention_dim=shape("txt_in.weight")[1])  # fmt: skip


def pack(latents: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): musubi-tuner's ``pack_latents`` (channels, then the 2x2 patch)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed: Tensor, h: int, w: int) -> Tensor:
    """:func:`pack`'s inverse for latents of (h, w)."""
    b, _, d = packed.shape
    c = d // 4
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def forward(denoiser: nn.Module, noisy: Tensor, sigma: Tensor, states: Tensor, mask: Tensor | None,
            references: Sequence[Tensor] = ()) -> Tensor:  # fmt: skip
    """The velocity (B, C, H, W) at ``sigma`` (B,) (the model's timestep, in [0, 1]) over the text ``states``
    (B, L, D) with ``mask`` (B, L) (None: every token real): musubi-tuner's ``call_dit``. ``references``: the edit
    models' control latents (each (B, C, h, w), any size), packed and appended to the image sequence after the noisy
    latents, their shapes appended to ``img_shapes`` (so an Edit-2511 DiT's ``zero_cond_t`` modulates them at t = 0),
    and the output cut back to the noisy latents' tokens (musubi-tuner's edit ``call_dit``, diffusers'
    ``QwenImageEditPlusPipeline``)."""
    b, _, h, w = noisy.shape
    packed = pack(noisy)
    shapes = [(1, h // 2, w // 2)] + [(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references]
    hidden = torch.cat([packed, *(pack(r.to(packed.dtype)) for r in references)], dim=1) if references else packed
    attn = None if mask is None else mask.to(noisy.device).bool()
    if attn is not None and bool(attn.all()):
        attn = None
    out = denoiser(hidden_states=hidden, encoder_hidden_states=states, encoder_hidden_states_mask=attn,
                   timestep=sigma.to(packed.dtype), img_shapes=[shapes] * b, return_dict=False)[0]  # fmt: skip
    return unpack(out[:, : packed.shape[1]], h, w)


def dynamic_shift(h: int, w: int) -> float:
    """μ of the resolution-dependent shift for latents (h, w): linear in the packed sequence length from (256, 0.5)
    to (8192, 0.9) (musubi-tuner's ``calculate_shift_qwen_image``; the shift is e^μ)."""
    seq = (h // 2) * (w // 2)
    s = SCHEDULER
    slope = (s["max_shift"] - s["base_shift"]) / (s["max_image_seq_len"] - s["base_image_seq_len"])
    return seq * slope + (s["base_shift"] - slope * s["base_image_seq_len"])
