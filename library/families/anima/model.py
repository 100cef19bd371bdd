"""Anima's denoiser: diffusers' ``CosmosTransformer3DModel`` (NVIDIA Cosmos-Predict2's MiniTrainDIT) with the LLM
adapter (diffusers' ``AnimaTextConditioner``) as its ``llm_adapter`` submodule, as sd-scripts' ``anima_models.Anima``
holds it (``net.llm_adapter.*`` in the released file), so adapters and full fine-tuning reach the adapter as part of
the denoiser and the adapter runs inside the forward (cached text-encoder outputs still train it).

Why a subclass with its own :meth:`AnimaTransformer.forward`: the Cosmos forward resizes the padding mask with
torchvision when ``concat_padding_mask`` is set (Anima's setting), and torchvision is not a dependency. Anima's
padding mask is all zeros (sd-scripts and diffusers' Anima pipeline pass zeros), so the forward here concatenates a
zero channel itself and runs the Cosmos modules (patch embedding, 3D RoPE, time embedding, blocks, output norm) in
the Cosmos order; the modules, their names and the config are diffusers' own, so the state dict is diffusers'.

Config from the weights (:func:`config_from_state`): the released Anima has 28 blocks of width 2048 (16 heads of
128), AdaLN-LoRA 256, 1024-wide cross-attention, patch (1, 2, 2), RoPE extrapolation (t, h, w) = (1, 4, 4), no extra
learnable position embedding, and the adapter 6 layers of width 1024 over the 32128-token T5 vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "prediction_type": "flow_matching"}  # sampling: flow_shift 3
MAX_SIZE = (128, 512, 512)  # sd-scripts' Anima: max_frames 128, max_img_h / w 512 latent pixels (RoPE table bound)


def _cosmos_base() -> type:
    from diffusers import CosmosTransformer3DModel

    return CosmosTransformer3DModel


def transformer_class() -> type:
    """:class:`AnimaTransformer` (built on first use: diffusers is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_class()
    return _CLASS


_CLASS: type | None = None


def _build_class() -> type:
    from diffusers import AnimaTextConditioner

    base = _cosmos_base()

    class AnimaTransformer(base):
        """Cosmos-Predict2 DiT + Anima's LLM adapter (module docstring). ``forward(latents, t, qwen3 states, ...)``
        takes 4D latents (B, C, H, W) or 5D (B, C, 1, H, W) and returns the same rank."""

        def __init__(self, text_conditioner: Mapping[str, Any] | None = None, **cosmos: Any) -> None:
            super().__init__(**cosmos)
            self.register_to_config(text_conditioner=dict(text_conditioner) if text_conditioner is not None else None)
            self.llm_adapter = AnimaTextConditioner(**text_conditioner) if text_conditioner is not None else None

        def adapt_text(
            self, qwen3: Tensor, qwen3_mask: Tensor | None, t5_ids: Tensor, t5_mask: Tensor | None
        ) -> Tensor:
            """The cross-attention context (B, T, 1024): the adapter over the Qwen3 states, T5 padding rows zeroed
            (sd-scripts' ``Anima._preprocess_text_embeds``)."""
            if self.llm_adapter is None:
                raise ValueError("this Anima transformer has no LLM adapter; load it with --llm_adapter_path")
            return self.llm_adapter(qwen3, t5_ids, target_attention_mask=t5_mask, source_attention_mask=qwen3_mask)

        def forward(  # type: ignore[override]
            self,
            hidden_states: Tensor,
            timestep: Tensor,
            encoder_hidden_states: Tensor,
            *,
            source_attention_mask: Tensor | None = None,
            t5_input_ids: Tensor | None = None,
            t5_attention_mask: Tensor | None = None,
        ) -> Tensor:
            four_d = hidden_states.ndim == 4
            x = hidden_states.unsqueeze(2) if four_d else hidden_states
            context = encoder_hidden_states
            if t5_input_ids is not None:
                context = self.adapt_text(context, source_attention_mask, t5_input_ids, t5_attention_mask)
            b, _, frames, height, width = x.shape
            if self.config.concat_padding_mask:  # Anima's padding mask: zeros (no torchvision resize needed)
                x = torch.cat([x, x.new_zeros(b, 1, frames, height, width)], dim=1)
            rope = self.rope(x, fps=None)
            p_t, p_h, p_w = self.config.patch_size
            tokens = self.patch_embed(x).flatten(1, 3)
            t = timestep.reshape(-1)
            if t.numel() == 1 and b > 1:
                t = t.expand(b)
            temb, embedded = self.time_embed(tokens, t)
            for block in self.transformer_blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    tokens = self._gradient_checkpointing_func(block, tokens, context, embedded, temb, rope, None, None)
                else:
                    tokens = block(tokens, context, embedded, temb, rope, None, None)
            out = self.proj_out(self.norm_out(tokens, embedded, temb))
            out = out.unflatten(2, (p_h, p_w, p_t, -1)).unflatten(1, (frames // p_t, height // p_h, width // p_w))
            out = out.permute(0, 7, 1, 6, 2, 4, 3, 5).flatten(6, 7).flatten(4, 5).flatten(2, 3)
            return out.squeeze(2) if four_d else out

    return AnimaTransformer


def build(config: Mapping[str, Any]) -> torch.nn.Module:
    """An :class:`AnimaTransformer` of ``config`` (:func:`config_from_state`'s keys)."""
    return transformer_class()(**dict(config))


def _count(keys: list[str], prefix: str) -> int:
    found = {int(k[len(prefix) :].split(".")[0]) for k in keys if k.startswith(prefix)}
    return max(found) + 1 if found else 0


def config_from_state(shape: Any, keys: list[str], with_adapter: bool) -> dict[str, Any]:
    """The :class:`AnimaTransformer` config of sd-scripts-named DiT weights (``net.`` stripped): ``shape(key)``
    gives a tensor's shape. Raises ``KeyError`` for a file without ``x_embedder.proj.1.weight``."""
    patch = tuple(shape("x_embedder.proj.1.weight"))
    width = patch[0]
    head_dim = tuple(shape("blocks.0.self_attn.q_norm.weight"))[0]
    in_channels = patch[1] // 4 - 1  # concat_padding_mask adds one channel; patch (1, 2, 2)
    config: dict[str, Any] = dict(
        in_channels=in_channels,
        out_channels=tuple(shape("final_layer.linear.weight"))[0] // 4,
        num_attention_heads=width // head_dim,
        attention_head_dim=head_dim,
        num_layers=_count(keys, "blocks."),
        mlp_ratio=tuple(shape("blocks.0.mlp.layer1.weight"))[0] / width,
        text_embed_dim=tuple(shape("blocks.0.cross_attn.k_proj.weight"))[1],
        adaln_lora_dim=tuple(shape("blocks.0.adaln_modulation_self_attn.1.weight"))[0],
        max_size=MAX_SIZE,
        patch_size=(1, 2, 2),
        rope_scale=(1.0, 4.0, 4.0) if in_channels == 16 else (1.0, 3.0, 3.0),  # sd-scripts' get_dit_config
        concat_padding_mask=True,
        extra_pos_embed_type=None,
        text_conditioner=adapter_config(shape, keys) if with_adapter else None,
    )
    return config


def adapter_config(shape: Any, keys: list[str], prefix: str = "llm_adapter.") -> dict[str, Any]:
    """The ``AnimaTextConditioner`` config of adapter weights under ``prefix``; ``min_sequence_length`` 0: no
    padding beyond the T5 tokens (sd-scripts' LLMAdapter pads nothing; its tokens are padded to
    ``--t5_max_token_length`` already)."""
    embed = tuple(shape(prefix + "embed.weight"))
    out = tuple(shape(prefix + "out_proj.weight"))
    model_dim = out[1]
    head_dim = tuple(shape(prefix + "blocks.0.cross_attn.q_norm.weight"))[0]
    return dict(
        source_dim=tuple(shape(prefix + "blocks.0.cross_attn.k_proj.weight"))[1],
        target_dim=out[0],
        model_dim=model_dim,
        num_layers=_count(keys, prefix + "blocks."),
        num_attention_heads=model_dim // head_dim,
        mlp_ratio=tuple(shape(prefix + "blocks.0.mlp.0.weight"))[0] / model_dim,
        target_vocab_size=embed[0],
        use_self_attention=any(k.startswith(prefix + "blocks.0.self_attn.") for k in keys),
        min_sequence_length=0,
    )


def released_config() -> dict[str, Any]:
    """Anima (Preview / base v1.0): the sd-scripts ``load_anima_model`` config in diffusers' terms."""
    return dict(
        in_channels=16, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=28, mlp_ratio=4.0,
        text_embed_dim=1024, adaln_lora_dim=256, max_size=MAX_SIZE, patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
        concat_padding_mask=True, extra_pos_embed_type=None,
        text_conditioner=dict(source_dim=1024, target_dim=1024, model_dim=1024, num_layers=6, num_attention_heads=16,
                         mlp_ratio=4.0, target_vocab_size=32128, use_self_attention=True, min_sequence_length=0),
    )  # fmt: skip
