"""Tiny HunyuanImage 2.1 models for tests and oracle checks: the released architecture at a few channels.

``TRANSFORMER``: diffusers ``HunyuanImageTransformer2DModel`` kwargs (2 heads of 8 = the (4, 4) RoPE axes, 2 double
and 2 single blocks, the released 2 refiner blocks; byT5's projection keeps diffusers' fixed 2048 hidden width, as
sd-scripts' ``ByT5Mapper(hidden_dim=2048, out_dim=2048)``). ``SDSCRIPTS_CONSTANTS``: the same sizes as the literals
of sd-scripts' ``HYImageDiffusionTransformer.__init__`` they replace (benchmarks/hunyuan_image_vs_sdscripts.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ..encoders.qwen25vl import TINY_TEXT as TINY_QWEN

QWEN_LENGTH = 32  # caption tokens of the tiny model's prompts (the released model: 1024)

TRANSFORMER = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=(1, 1),
    qk_norm="rms_norm",
    guidance_embeds=False,
    text_embed_dim=16,  # the tiny Qwen2.5-VL width (encoders/qwen25vl.TINY_TEXT)
    text_embed_2_dim=12,
    rope_theta=256.0,
    rope_axes_dim=(4, 4),
    use_meanflow=False,
)

# sd-scripts literal -> tiny value (each must occur once in HYImageDiffusionTransformer.__init__)
SDSCRIPTS_CONSTANTS = {
    "self.in_channels = 64": "self.in_channels = 4",
    "self.out_channels = 64": "self.out_channels = 4",
    "self.rope_dim_list = [64, 64]": "self.rope_dim_list = [4, 4]",
    "self.hidden_size = 3584": "self.hidden_size = 16",
    "self.heads_num = 28": "self.heads_num = 2",
    "mm_double_blocks_depth = 20": "mm_double_blocks_depth = 2",
    "mm_single_blocks_depth = 40": "mm_single_blocks_depth = 2",
    "text_states_dim = 3584": "text_states_dim = 16",
    "ByT5Mapper(in_dim=1472,": "ByT5Mapper(in_dim=12,",
}


def transformer_config() -> dict:
    return copy.deepcopy(TRANSFORMER)


VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 32, 32, 32, 32, 32),
    layers_per_block=1,
    spatial_compression_ratio=32,
    sample_size=64,
    scaling_factor=0.75289,
    downsample_match_channel=True,
    upsample_match_channel=True,
)
SDSCRIPTS_VAE_CONSTANTS = {
    "block_out_channels = (128, 256, 512, 512, 1024, 1024)": "block_out_channels = (32, 32, 32, 32, 32, 32)",
    "latent_channels = 64": "latent_channels = 4",
    "layers_per_block = 2": "layers_per_block = 1",
    "sample_size = 384": "sample_size = 64",
}

SDSCRIPTS_BYT5_CONSTANTS = {  # sd-scripts' load_byt5 config literals -> the tiny BYT5 below
    '"d_ff": 3584': '"d_ff": 16', '"d_kv": 64': '"d_kv": 4', '"d_model": 1472': '"d_model": 12',
    '"num_heads": 6': '"num_heads": 2', '"num_layers": 12': '"num_layers": 1',
    '"relative_attention_num_buckets": 32': '"relative_attention_num_buckets": 8',
}  # fmt: skip


def vae_config() -> dict:
    return copy.deepcopy(VAE)


# byT5 Glyph at tiny width, the real 1510-token vocabulary (the shipped tokenizer's ids fit)
BYT5 = dict(vocab_size=1510, d_model=12, d_kv=4, d_ff=16, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0, is_encoder_decoder=False,
            use_cache=False, pad_token_id=0, eos_token_id=1)  # fmt: skip


def add_tool_args(parser: Any) -> None:
    parser.add_argument("--hunyuan_blocks", type=int, default=None, metavar="N",
                        help="HunyuanImage double and single blocks each (default 2)")  # fmt: skip


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (diffusers zero-initialises some output layers; a tiny model's outputs should depend
    on every weight): matrices N(0, 1 / fan-in), biases small, norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:  # scaled by the fan-in, so the tiny model's activations stay of order 1
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


class HunyuanTiny:
    """HunyuanImage 2.1's tiny model (``library.families.base.TinyModel``): the released module layout and names at
    tiny widths, the real Qwen2.5-VL and byT5 Glyph vocabularies (the shipped tokenizers' ids fit)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: Any) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Any:
        from ..base import Parts
        from ..encoders import qwen25vl
        from . import model as M
        from .options import HunyuanOptions

        n = blocks or TRANSFORMER["num_layers"]
        denoiser = M.transformer_factory(dict(TRANSFORMER, num_layers=n, num_single_layers=n))()
        _randomize(denoiser, seed)
        vae = M.vae_factory(VAE)()
        _randomize(vae, seed + 1)
        torch.manual_seed(seed + 2)
        qwen = qwen25vl.factory(TINY_QWEN)()
        byt5 = M.byt5_factory(BYT5)()
        for module in (denoiser, vae, qwen, byt5):
            module.eval().requires_grad_(False)
        tokenizers = [qwen25vl.load_tokenizer(), M.load_byt5_tokenizer()]
        options = HunyuanOptions(qwen_max_length=QWEN_LENGTH)
        return Parts(denoiser, vae, [qwen, byt5], tokenizers, dict(M.SCHEDULER), self.family.name, "tiny-hunyuan",
                     options)  # fmt: skip

    def write_files(self, parts: Any, out: str | Path, name: str) -> dict[str, Path]:
        """``<name>_dit.safetensors`` (Tencent names), ``_qwen.safetensors`` (Comfy-Org's ``model.`` names),
        ``_byt5.safetensors`` (Comfy-Org's ``encoder.`` + ``shared.weight``), ``_vae.safetensors`` (Tencent names)."""
        from library.files.weights import save_state_dict

        from . import keys as K

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "dit": self.family.save(parts, out / f"{name}_dit.safetensors"),
            "text_encoder": save_state_dict({f"model.{k}": v for k, v in parts.text_encoders[0].state_dict().items()},
                                            out / f"{name}_qwen.safetensors", {}),
            "byt5": save_state_dict({k: v for k, v in parts.text_encoders[1].state_dict().items()
                                     if k != "encoder.embed_tokens.weight"}, out / f"{name}_byt5.safetensors", {}),
            "vae": save_state_dict(K.vae_diffusers_to_tencent(parts.vae.state_dict(), K.vae_layout_of(
                len(VAE["block_out_channels"]), VAE["layers_per_block"])), out / f"{name}_vae.safetensors", {}),
        }  # fmt: skip
        return paths

    def write_folder(self, parts: Any, folder: str | Path) -> Path:
        raise ValueError("HunyuanImage 2.1 has no model folder layout here: use write_files (four .safetensors)")

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {"blocks": getattr(args, "hunyuan_blocks", None)}
