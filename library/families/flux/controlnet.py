"""FLUX.1 ControlNet (XLabs-style, sd-scripts' ``flux_models.ControlNetFlux``): the module, its file keys and forward.

The module is diffusers' ``FluxControlNetModel`` with ``conditioning_embedding_channels=16`` (the pixel hint
block), ``num_layers`` double blocks (sd-scripts: 2) and no single blocks: it holds exactly the tensors of
sd-scripts' ``ControlNetFlux(params, controlnet_depth=2, controlnet_single_depth=0)``, under other names:

=====================================  =======================================================================
sd-scripts (the file)                  diffusers (the module)
=====================================  =======================================================================
``img_in`` ``txt_in`` ``time_in.*``    ``x_embedder`` ``context_embedder`` ``time_text_embed.*`` (the
``vector_in.*`` ``guidance_in.*``      transformer's table, library/families/flux/keys.py; ``guidance_in``: dev)
``double_blocks.N.*``                  ``transformer_blocks.N.*`` (fused qkv rows split, as the transformer's)
``controlnet_blocks.N``                ``controlnet_blocks.N`` (zero-initialised Linear D -> D)
``pos_embed_input``                    ``controlnet_x_embedder`` (Linear 64 -> D over the hint's 2x2 patches)
``input_hint_block.{0,2,...,12}``      ``input_hint_block.{conv_in, blocks.0..5}`` (3x3 convs, SiLU between)
``input_hint_block.14``                ``input_hint_block.conv_out`` (zero-initialised)
=====================================  =======================================================================

The control image is pixels in [-1, 1] (B, 3, H, W) at the training image's size (sd-scripts feeds
``batch["conditioning_images"]``, not VAE latents): the hint block's three stride-2 convs bring it to the latent
grid (H/8), and its 2x2 patches (16·4 = 64 channels) line up with the packed latent tokens. The residual of
ControlNet double block i, projected by its zero-initialised ``controlnet_blocks.i``, is added to the image stream
after every transformer double block j with j mod depth = i (sd-scripts' ``Flux.forward`` with
``block_controlnet_hidden_states``; diffusers' ``controlnet_blocks_repeat=True``); single blocks get nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from . import keys as K

HINT_CHANNELS = 16  # the hint block's output channels: 16 x 2 x 2 = the transformer's 64 input channels
_HINT = {0: "conv_in", **{2 * (i + 1): f"blocks.{i}" for i in range(6)}, 14: "conv_out"}  # sd-scripts index -> ours


def build_controlnet(transformer: nn.Module, depth: int = 2, copy_weights: bool = True) -> nn.Module:
    """A ControlNet for ``transformer`` (a diffusers ``FluxTransformer2DModel``: its width, heads, rope axes,
    guidance input): ``depth`` double blocks, the pixel hint block, zero-initialised output projections.
    ``copy_weights``: the embedders and the first ``depth`` double blocks start as the transformer's (ControlNet's
    trainable copy, as XLabs and diffusers' ``from_transformer`` do; sd-scripts starts them random)."""
    from diffusers import FluxControlNetModel

    config = dict(transformer.config)
    if "guidance_embeds" not in config or "pooled_projection_dim" not in config:
        raise ValueError("the FLUX ControlNet needs a FLUX.1 (dev / schnell) transformer; Chroma has no CLIP input")
    if config["in_channels"] != 4 * HINT_CHANNELS:
        raise ValueError(f"the FLUX ControlNet's hint block makes 64-channel patches; this transformer takes "
                         f"{config['in_channels']}")  # fmt: skip
    if not 1 <= depth <= config["num_layers"]:
        raise ValueError(f"ControlNet depth {depth}: must be 1..{config['num_layers']} (the transformer's blocks)")
    keep = ("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
            "pooled_projection_dim", "guidance_embeds", "axes_dims_rope")  # fmt: skip
    # patch_size 2: diffusers reads it only to cut the hint into the 2x2 patches of the packed latent tokens
    with torch.device(transformer.device):  # built where the transformer is (meta: --plan_memory, no memory)
        cn = FluxControlNetModel(**{k: config[k] for k in keep}, patch_size=2, num_layers=depth, num_single_layers=0,
                                 conditioning_embedding_channels=HINT_CHANNELS)  # fmt: skip
    if copy_weights and transformer.device.type != "meta":
        own = cn.state_dict()
        base = {k: v for k, v in transformer.state_dict().items() if k in own and not k.startswith("controlnet")}
        cn.load_state_dict(base, strict=False)
    dtype = transformer.dtype
    if dtype == cn.dtype or dtype.itemsize == 1:  # fp8 storage (--fp8_base): the caller picks the compute dtype
        return cn
    return cn.to(dtype)


# ----------------------------------------------------------------------------------------------------- file keys
def _entries(depth: int, guidance: bool) -> list[K.Entry]:
    """The transformer's table for the ControlNet's modules, plus the ControlNet's own (one tensor each)."""
    table = [e for e in K.module_table(K.FLUX, depth, 0, guidance) if not e.bfl.startswith("final_layer")]
    table += [K.Entry(f"controlnet_blocks.{i}", (f"controlnet_blocks.{i}",)) for i in range(depth)]
    table.append(K.Entry("pos_embed_input", ("controlnet_x_embedder",)))
    table += [K.Entry(f"input_hint_block.{i}", (f"input_hint_block.{name}",)) for i, name in _HINT.items()]
    return table


def _layout(state: Mapping[str, Any], prefix: str) -> tuple[int, bool]:
    import re

    found = [int(m.group(1)) for k in state if (m := re.match(rf"{prefix}\.(\d+)\.", k))]
    return (max(found) + 1 if found else 0), any("guidance" in k for k in state)


def to_file(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The module's state dict -> sd-scripts' ``ControlNetFlux`` keys (what ``flux_train_control_net.py`` writes)."""
    depth, guidance = _layout(state, "transformer_blocks")
    out = {}
    for e in _entries(depth, guidance):
        for bfl, ours in e.params:
            parts = [state[f"{m}.{ours}"] for m in e.diffusers]
            out[f"{e.bfl}.{bfl}"] = torch.cat(parts, dim=0) if e.kind == "rows" else parts[0]
    unused = set(state) - {f"{m}.{p}" for e in _entries(depth, guidance) for _, p in e.params for m in e.diffusers}
    if unused:
        raise KeyError(f"ControlNet tensors with no sd-scripts name: {sorted(unused)[:4]}")
    return out


def from_file(tensors: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
    """sd-scripts' ``ControlNetFlux`` tensors -> the module's names; every key must be one of the layout's (a file
    with single blocks, another width's hint block or a LoRA is refused with what differs)."""
    depth, guidance = _layout(tensors, "double_blocks")
    if depth == 0 or "pos_embed_input.weight" not in tensors:
        raise ValueError(f"{source}: not a FLUX ControlNet file (sd-scripts' ControlNetFlux: double_blocks.N.*, "
                         "pos_embed_input, input_hint_block); it has e.g. " + ", ".join(list(tensors)[:3]))  # fmt: skip
    entries = _entries(depth, guidance)
    wanted = {f"{e.bfl}.{p}" for e in entries for p, _ in e.params}
    extra, missing = sorted(set(tensors) - wanted), sorted(wanted - set(tensors))
    if extra or missing:
        raise ValueError(f"{source}: not the ControlNetFlux layout this reads ({len(missing)} keys missing, e.g. "
                         f"{missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}; single blocks are not read)")  # fmt: skip
    out = {}
    for e in entries:
        for bfl, ours in e.params:
            t = tensors[f"{e.bfl}.{bfl}"]
            parts = list(t.chunk(3, dim=0)) if e.kind == "rows" else [t]
            out.update({f"{m}.{ours}": p for m, p in zip(e.diffusers, parts)})
    return out


def depth_of_file(tensors: Mapping[str, Tensor]) -> int:
    return _layout(tensors, "double_blocks")[0]


# ------------------------------------------------------------------------------------------------------- forward
def guide_image(path: str | os.PathLike, width: int, height: int) -> Tensor:
    """A control image file as (1, 3, height, width) float32 in [-1, 1], resized (Lanczos) to the generated size,
    as training's conditioning images are scaled."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        img = im.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
    return (torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0).unsqueeze(0)


def residuals(cn: nn.Module, image: Tensor, kwargs: Mapping[str, Any], checkpointing: bool = False) -> list[Tensor]:
    """The ControlNet's per-double-block residuals (depth tensors of (B, L, D), before any multiplier) for the
    transformer call ``kwargs`` (what ``FluxFamily.predict`` passes: packed tokens, text, timestep / 1000, ids,
    pooled, guidance, the T5 mask in ``joint_attention_kwargs``) and the control ``image`` (b, 3, H, W) in [-1, 1]
    (b divides B: classifier-free guidance's halves share it). The mask reaches the ControlNet's blocks too, as
    sd-scripts passes ``txt_attention_mask`` to both. The ControlNet computes in its own dtype (fp32 trained
    weights beside a bf16 transformer under ``--mixed_precision bf16``); the residuals come back in the tokens'."""
    x = kwargs["hidden_states"]
    dtype = next(cn.parameters()).dtype
    if x.shape[0] != image.shape[0]:
        if x.shape[0] % image.shape[0]:
            raise ValueError(f"{image.shape[0]} control image(s) for a batch of {x.shape[0]}")
        image = image.repeat(x.shape[0] // image.shape[0], 1, 1, 1)
    hint = cn.input_hint_block(image.to(dtype))
    b, c, h, w = hint.shape
    if h * w // 4 != x.shape[1]:
        raise ValueError(f"the control image ({image.shape[-2]}x{image.shape[-1]}) is not the generated image's "
                         f"size ({x.shape[1]} latent patches); resize it to that size")  # fmt: skip
    hint = hint.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
    hidden = cn.x_embedder(x.to(dtype)) + cn.controlnet_x_embedder(hint)
    t = kwargs["timestep"].to(dtype) * 1000
    guidance = kwargs.get("guidance")
    pooled = kwargs["pooled_projections"].to(dtype)
    if cn.config.guidance_embeds:
        temb = cn.time_text_embed(t, guidance.to(dtype) * 1000, pooled)
    else:
        temb = cn.time_text_embed(t, pooled)
    txt = cn.context_embedder(kwargs["encoder_hidden_states"].to(dtype))
    rope = cn.pos_embed(torch.cat((kwargs["txt_ids"], kwargs["img_ids"]), dim=0))
    extra = kwargs.get("joint_attention_kwargs")
    out = []
    for block, proj in zip(cn.transformer_blocks, cn.controlnet_blocks):
        if checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            txt, hidden = checkpoint(block, hidden, txt, temb, rope, extra, use_reentrant=False)
        else:
            txt, hidden = block(hidden_states=hidden, encoder_hidden_states=txt, temb=temb, image_rotary_emb=rope,
                                joint_attention_kwargs=extra)  # fmt: skip
        out.append(proj(hidden).to(x.dtype))
    return out
