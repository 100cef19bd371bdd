"""What the two sides of benchmarks/real_step.py share: each family's blocks kept, text lengths and inputs; the sides
themselves are real_step_references.py and real_step_ours.py. Each builds the family's denoiser at its released width
with fewer blocks, random weights, a LoRA of dim 4 / alpha 2 on the side's default targets, and runs the call its
trainer makes on cached text.

``ref_<family>(blocks, res)`` (real_step_references.py) runs in the reference's venv (sd-scripts: cwd = the checkout;
musubi-tuner: its ``src`` on PYTHONPATH) and builds the reference's own model class with the reference's own network
module; ``ours_<family>(blocks, res)`` (real_step_ours.py) runs in this checkout's venv and builds the model our family
builds (``model.py``) with our network module (``networks.lora_<family>`` through ``networks.prepare_network``),
calling ``family.predict`` as our training step does. Both return ``(forward, params, names)``: ``forward()`` the
prediction on fixed random inputs of the shapes below, ``params`` the adapter parameters to train, ``names`` the
adapted modules' kohya names (``lora_unet_...``). Only ``blocks`` changes the released architecture (:data:`DEPTHS`);
everything is float32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the blocks kept of the released model (the rest of it as released): double / single, main / refiner, ...
DEPTHS = {
    "anima": "4 of 28 blocks (width 2048, 16 heads, MLP 4x); LLM adapter 6 layers as released",
    "lumina": "2 of 26 main layers (width 2304, 24 heads / 8 KV heads); 2 + 2 refiner layers as released",
    "hunyuan_image": "1 of 20 double + 1 of 40 single blocks (width 3584, 28 heads, MLP 4x); 2 refiner layers",
    "qwen_image": "2 of 60 dual-stream blocks (width 3072, 24 heads, MLP 4x)",
    "zimage": "2 of 30 main layers (width 3840, 30 heads); 2 + 2 refiner layers as released",
    "flux": "FLUX.1-dev: 1 of 19 double + 2 of 38 single blocks (width 3072, 24 heads, MLP 4x)",
    "flux2": "FLUX.2 klein 4B: 1 of 5 double + 2 of 20 single blocks (width 3072, 24 heads, MLP 3x)",
    "stable_cascade": "stage C 3.6B: 1 of 8 + 2 of 24 down, 2 of 24 + 1 of 8 up CTA blocks (width 2048, 32 heads)",
    "wuerstchen": "Würstchen 2 prior, full fine-tune: 2 of 32 blocks (width 1536, 24 heads, CLIP-bigG 1280)",
    "chroma": "Chroma: 1 of 19 double + 2 of 38 single blocks (width 3072, 24 heads, MLP 4x); approximator as released",
    "flux2_dev": "FLUX.2 dev: 1 of 8 double + 1 of 48 single blocks (width 6144, 48 heads, MLP 3x)",
    "qwen_image_edit": "Qwen-Image Edit: 2 of 60 dual-stream blocks (width 3072, 24 heads, MLP 4x), one control image",
    "sdxl": "SDXL: the whole released UNet (2.6 B parameters; no blocks removed)",
    "sd1": "SD1.5: the whole released UNet (0.86 B parameters)",
    "sd2": "SD2.x 768-v: the whole released UNet (0.87 B parameters, linear projections)",
    "pixart_sigma": "PixArt-Σ XL/2 1024: 4 of 28 blocks (width 1152, 16 heads, MLP 4x, T5 width 4096)",
    "pixart_alpha": "PixArt-α XL/2 1024: 4 of 28 blocks (as Σ, with the size and aspect-ratio micro-conditions)",
}
DEFAULT_BLOCKS = {"anima": (4,), "lumina": (2,), "hunyuan_image": (1, 1), "qwen_image": (2,), "zimage": (2,), "flux": (1, 2),
                  "flux2": (1, 2), "stable_cascade": (1, 2), "wuerstchen": (2,),
                  "chroma": (1, 2), "flux2_dev": (1, 1), "qwen_image_edit": (2,), "sdxl": (),
                  "sd1": (), "sd2": (), "pixart_sigma": (4,), "pixart_alpha": (4,)}  # fmt: skip
# text tokens (all real, batch 1): the trainers' padded lengths where they pad (Anima: Qwen3 and T5 512; Lumina 2:
# Gemma 256; FLUX.1-dev: T5 512; FLUX.2: 512; SDXL and Stable Cascade: CLIP's 77), a 77-token caption where they cut
# the text to the caption (HunyuanImage 2.1: Qwen plus 16 of byT5's 128 rows, Qwen-Image, Z-Image; Chroma: T5's 512
# rows of which 77 are the caption, cut to 78 by both); Qwen-Image Edit: the 196 image tokens of a 384 x 384 control
# image plus 77; PixArt-α / Σ: OneTrainer's 120 T5 rows (its PixArt constant; ours with --t5xxl_max_token_length 120) with
# a 77-token caption in the mask both pass
TEXT = {"anima": 512, "lumina": 256, "hunyuan_image": 77, "qwen_image": 77, "zimage": 77, "flux": 512, "flux2": 512,
        "stable_cascade": 77, "wuerstchen": 77, "chroma": 512, "flux2_dev": 512, "qwen_image_edit": 273, "sdxl": 77,
        "sd1": 77, "sd2": 77, "pixart_sigma": 120, "pixart_alpha": 120}  # fmt: skip
CHROMA_CAPTION = 77
# warp-ai/wuerstchen-prior's prior/config.json (the wuerstchen branch reads it from the folder; no literal of its own)
WUERSTCHEN_PRIOR = dict(c_in=16, c=1536, c_cond=1280, c_r=64, depth=32, nhead=24, dropout=0.1)
BYT5_ROWS, BYT5_REAL = 128, 16
PIXART_CAPTION = 77
# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS's and PixArt-alpha/PixArt-XL-2-1024-MS's transformer/config.json (OneTrainer
# reads them from the folder; no literal of its own): α's has no interpolation_scale (diffusers' default: 2 at
# sample_size 128) and takes the micro-conditions
PIXART_SIGMA = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28, dropout=0.0,
    norm_num_groups=32, cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, upcast_attention=False, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2, caption_channels=4096,
    use_additional_conditions=False,
)  # fmt: skip
PIXART = {"pixart_sigma": PIXART_SIGMA,
          "pixart_alpha": dict(PIXART_SIGMA, interpolation_scale=None, use_additional_conditions=True)}  # fmt: skip


def _randn(*shape: int):
    import torch

    return torch.randn(*shape, generator=_GEN)


_GEN = None


def _gen():
    """The generator of this build (reset by :func:`build`)."""
    return _GEN


def _seed() -> None:
    global _GEN
    import torch

    _GEN = torch.Generator().manual_seed(0)


def _no_empty_weights(module) -> None:
    """Build on the CPU where the reference's constructor builds under ``init_empty_weights`` (no file loads here)."""
    module.init_empty_weights = contextlib.nullcontext


_MODELS: list = []


def _frozen(model):
    model.requires_grad_(False)
    _MODELS.append(model)
    return model


def last_model_params() -> list:
    """The parameters of the denoiser built last (before its adapters; all of them in a full fine-tune)."""
    return [p for p in _MODELS[-1].parameters() if not p.requires_grad] or list(_MODELS[-1].parameters())


def _whole(model):
    """A full fine-tune's denoiser: in train mode (both trainers), every parameter trained, named by its state-dict
    key (``names``)."""
    _MODELS.append(model.train().requires_grad_(True))
    return list(model.parameters()), sorted(name for name, _ in model.named_parameters())


def build(family: str, side: str, blocks: tuple[int, ...], res: int):
    """``(forward, params, names)`` of ``side`` ("reference" / "ours") for ``family``: ``ref_<family>`` of
    real_step_references.py (run in the reference's venv) or ``ours_<family>`` of real_step_ours.py."""
    import importlib

    _seed()
    module = importlib.import_module("real_step_references" if side == "reference" else "real_step_ours")
    return getattr(module, f"{'ref' if side == 'reference' else 'ours'}_{family}")(blocks, res)
