"""Qwen-Image's tiny model (``ModelFamily.tiny``): the released module layout and names (dual-stream
``QwenImageTransformerBlock`` s, Qwen2.5-VL's language model with its real 152064-token vocabulary, the Qwen-Image VAE's
four levels) at tiny widths, seeded random weights.

Files (:meth:`QwenImageTiny.write_files`): ``<name>_dit.safetensors`` (diffusers names, as
``qwen_image_bf16.safetensors``), ``<name>_te.safetensors`` (``model.``-prefixed, as ComfyUI's
``qwen_2.5_vl_7b.safetensors``), ``<name>_vae.safetensors`` (ComfyUI's Wan names, as ``qwen_image_vae.safetensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..autoencoders import qwen_image
from ..base import Parts
from ..encoders import qwen25vl
from . import model as M


def add_tool_args(parser: Any) -> None:
    parser.add_argument("--qwen_image_blocks", type=int, default=None, metavar="N",
                        help="Qwen-Image DiT blocks (default 2)")  # fmt: skip


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn with a small normal spread (norm weights around 1), so outputs depend on all of them
    (diffusers zero-initialises some)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


class QwenImageTiny:
    """Qwen-Image's tiny model (``library.families.base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: Any) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Parts:
        from .options import QwenImageOptions

        torch.manual_seed(seed)
        denoiser = M.build(dict(M.TINY, num_layers=blocks or M.TINY["num_layers"]))
        randomize(denoiser, seed)
        vae = qwen_image.factory(qwen_image.TINY)()
        encoder = qwen25vl.factory(qwen25vl.TINY_TEXT)()
        randomize(encoder, seed + 1)
        for module in (denoiser, vae, encoder):
            module.eval().requires_grad_(False)
        tokenizers = [qwen25vl.load_tokenizer()]
        return Parts(denoiser, vae, [encoder], tokenizers, dict(M.SCHEDULER), self.family.name, "tiny-qwen-image",
                     QwenImageOptions())  # fmt: skip

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        from . import saving

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "dit": saving.save_dit(parts, out / f"{name}_dit.safetensors", self.family),
            "text_encoder": saving.save_text_encoder(parts, out / f"{name}_te.safetensors"),
            "vae": saving.save_vae(parts, out / f"{name}_vae.safetensors", comfy=True),
        }

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {"blocks": getattr(args, "qwen_image_blocks", None)}
