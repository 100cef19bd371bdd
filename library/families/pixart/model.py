"""PixArt-α / PixArt-Σ: the released configs, the transformer factory, the T5 prompt rule and the micro-conditions.

Both are PixArt-XL/2 (28 blocks, width 1152, 16 heads of 72, caption width 4096, 8 output channels: ε and the learned
variance) on a linear-β DDPM schedule (β 0.0001 .. 0.02, 1000 steps: the IDDPM schedule of the original trainer).
PixArt-α reads 120 T5 tokens over the SD VAE (× 0.18215) and, at 1024, takes the resolution and aspect ratio of the
image (``use_additional_conditions``); PixArt-Σ reads 300 T5 tokens over the SDXL VAE (× 0.13025) and takes no
micro-conditions (diffusers' Σ pipeline passes none; its released config sets ``use_additional_conditions`` false).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..loading import shipped_configs

ALPHA, SIGMA = "pixart_alpha", "pixart_sigma"
TOKENS = {ALPHA: 120, SIGMA: 300}
VAE_SCALE = {ALPHA: 0.18215, SIGMA: 0.13025}
TIED_T5 = "encoder.embed_tokens.weight"  # T5EncoderModel ties it to shared.weight: written once
PIPELINES = {ALPHA: "PixArtAlphaPipeline", SIGMA: "PixArtSigmaPipeline"}

XL_2 = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28, dropout=0.0,
    norm_num_groups=32, cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, upcast_attention=False, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, caption_channels=4096,
)  # fmt: skip
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                 prediction_type="epsilon", clip_sample=False, steps_offset=0, timestep_spacing="linspace")  # fmt: skip


def released(variant: str) -> dict[str, Any]:
    """The released transformer, VAE and T5 configs of ``variant`` (a fresh copy)."""
    from ..encoders import t5

    transformer = dict(XL_2, use_additional_conditions=variant == ALPHA)
    vae = shipped_configs("sd15" if variant == ALPHA else "sdxl-base")["vae"]
    return {"transformer": transformer, "vae": vae, "text_encoder": t5.released_config(),
            "scheduler": dict(SCHEDULER)}  # fmt: skip


def transformer_factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    from diffusers import PixArtTransformer2DModel

    return lambda: PixArtTransformer2DModel(**dict(config))


def config_from_weights(state: Mapping[str, Any], shape: Callable[[str], tuple[int, ...]], base: Mapping[str, Any],
                        depth: int) -> dict[str, Any]:  # fmt: skip
    """A transformer config read from diffusers-named weights: width, caption width, channels, patch, depth, the
    micro-conditions; the head width 72 (every release) or ``base``'s when the width is no multiple of it."""
    width, in_channels, patch, _ = shape("pos_embed.proj.weight")
    caption = shape("caption_projection.linear_1.weight")[1]
    out_channels = shape("proj_out.weight")[0] // (patch * patch)
    head = 72 if width % 72 == 0 else int(base["attention_head_dim"])
    micro = "adaln_single.emb.resolution_embedder.linear_1.weight" in state
    return dict(base, num_attention_heads=width // head, attention_head_dim=head, in_channels=in_channels,
                out_channels=out_channels, num_layers=depth, cross_attention_dim=width, patch_size=patch,
                caption_channels=caption, use_additional_conditions=micro)  # fmt: skip


def micro_conditions(denoiser: nn.Module, latents: Tensor) -> dict[str, Tensor | None]:
    """``added_cond_kwargs``: the image's (height, width) in pixels and height / width per sample when the transformer
    takes them (PixArt-α 1024; diffusers' pipeline and OneTrainer use the generated / trained size, 8 × the latent's),
    else None for both."""
    if not takes_micro_conditions(denoiser.config):  # the config: a trainer may hand a wrapper of the transformer
        return {"resolution": None, "aspect_ratio": None}
    b, _, h, w = latents.shape
    dtype = latents.dtype
    resolution = torch.tensor([h * 8, w * 8], device=latents.device, dtype=dtype).repeat(b, 1)
    aspect = torch.tensor([float(h * 8 / (w * 8))], device=latents.device, dtype=dtype).repeat(b, 1)
    return {"resolution": resolution, "aspect_ratio": aspect}


def takes_micro_conditions(config: Any) -> bool:
    """diffusers' rule: ``use_additional_conditions``, or when unset, whether ``sample_size`` is 128."""
    given = getattr(config, "use_additional_conditions", None)
    return bool(given) if given is not None else int(config.sample_size) == 128


def eps_half(output: Tensor, latent_channels: int) -> Tensor:
    """The ε half of the transformer's output when it also predicts the variance (8 = 2 × 4 channels), as diffusers'
    pipelines and OneTrainer split it; the output itself otherwise."""
    return output[:, :latent_channels] if output.shape[1] == 2 * latent_channels else output
