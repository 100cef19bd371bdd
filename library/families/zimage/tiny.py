"""Z-Image's tiny model (``ModelFamily.tiny``): the released module layout and names (refiners, single-stream
``ZImageTransformerBlock`` s, Qwen3 with its real 151936-token vocabulary, the FLUX.1 AE's four levels) at tiny widths,
seeded random weights.

Files (:meth:`ZImageTiny.write_files`): ``<name>_dit.safetensors`` (the original / ComfyUI names with the fused
``qkv``, as ``z_image_turbo_bf16.safetensors``), ``<name>_te.safetensors`` (``model.``-prefixed, as ComfyUI's
``qwen_3_4b.safetensors``), ``<name>_vae.safetensors`` (BFL's names, as ``ae.safetensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..autoencoders import flux_ae
from ..base import Parts
from ..encoders import qwen3
from . import model as M

AE = dict(flux_ae.TINY_AE)


def add_tool_args(parser: Any) -> None:
    parser.add_argument("--zimage_blocks", type=int, default=None, metavar="N", help="Z-Image DiT blocks (default 2)")


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


class ZImageTiny:
    """Z-Image's tiny model (``library.families.base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: Any) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Parts:
        from .options import ZImageOptions

        torch.manual_seed(seed)
        denoiser = M.build(dict(M.TINY, n_layers=blocks or M.TINY["n_layers"]))
        randomize(denoiser, seed)
        vae = flux_ae.factory(AE)()
        encoder = qwen3.factory(qwen3.TINY)()
        randomize(encoder, seed + 1)
        for module in (denoiser, vae, encoder):
            module.eval().requires_grad_(False)
        return Parts(denoiser, vae, [encoder], [qwen3.load_tokenizer()], dict(M.SCHEDULER), self.family.name,
                     "tiny-zimage", ZImageOptions())  # fmt: skip

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        from . import saving

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "dit": saving.save_dit(parts, out / f"{name}_dit.safetensors", self.family, original=True),
            "text_encoder": saving.save_text_encoder(parts, out / f"{name}_te.safetensors"),
            "vae": saving.save_vae(parts, out / f"{name}_vae.safetensors", bfl=True),
        }

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {"blocks": getattr(args, "zimage_blocks", None)}
