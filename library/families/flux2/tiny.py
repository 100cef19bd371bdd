"""FLUX.2's tiny model (``ModelFamily.tiny``): klein's module layout and names (``Flux2Transformer2DModel`` with one
double and two single blocks, 128 latent channels), Qwen3 with the real vocabulary and 27 layers (the hidden states
9, 18, 27 that FLUX.2 reads) at width 16, FLUX.2's AE (4 levels, 32 latent channels) at tiny widths; seeded random
weights, random BatchNorm statistics.

Files (:meth:`Flux2Tiny.write_files`): ``<name>_dit.safetensors`` (BFL names, as ``flux2-klein-4b.safetensors``),
``<name>_te-00001-of-00002.safetensors`` + ``-00002-of-00002`` (``model.``-prefixed, split as the released Qwen3),
``<name>_ae.safetensors`` (BFL names, as ``ae.safetensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.files.weights import save_state_dict

from ..autoencoders import flux2 as ae
from ..base import Parts
from ..encoders import qwen3
from . import model as M
from .loading import SAMPLING, TINY_QWEN3


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn with a small normal spread (norm weights around 1), so outputs depend on all of them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


class Flux2Tiny:
    """FLUX.2's tiny model (``library.families.base.TinyModel``)."""

    by_default = False

    def __init__(self, family: Any) -> None:
        self.family = family

    @staticmethod
    def add_tool_args(parser: Any) -> None:
        return None

    def build(self, seed: int = 0) -> Parts:
        from .options import Flux2Options

        torch.manual_seed(seed)
        denoiser = M.build(M.TINY)
        randomize(denoiser, seed)
        vae = ae.factory(ae.TINY)()
        randomize(vae, seed + 2)
        g = torch.Generator().manual_seed(seed + 3)
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
        encoder = qwen3.factory(TINY_QWEN3)()
        randomize(encoder, seed + 1)
        for module in (denoiser, vae, encoder):
            module.eval().requires_grad_(False)
        steps, guidance = SAMPLING[False]
        scheduler = {"model_version": "klein-base-4b", "guidance_distilled": False, "default_steps": steps,
                     "default_guidance": guidance, "prediction_type": "flow_matching"}  # fmt: skip
        return Parts(denoiser, vae, [encoder], [qwen3.load_tokenizer()], scheduler, self.family.name, "tiny-flux2",
                     Flux2Options(model_version="klein-base-4b"))  # fmt: skip

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        """A diffusers-style folder: ``transformer/`` (config.json + diffusers names), ``text_encoder/``, ``vae/``."""
        from ..saving import atomic_dir

        folder = Path(folder)
        with atomic_dir(folder) as tmp:
            for sub in ("transformer", "text_encoder", "vae"):
                (tmp / sub).mkdir()
            parts.denoiser.save_config(tmp / "transformer")
            save_state_dict(dict(parts.denoiser.state_dict()), tmp / "transformer" / "diffusion_pytorch_model.safetensors",
                            {"format": "pt"})  # fmt: skip
            save_state_dict({"model." + k: v for k, v in parts.text_encoders[0].state_dict().items()},
                            tmp / "text_encoder" / "model.safetensors", {"format": "pt"})  # fmt: skip
            save_state_dict(dict(parts.vae.state_dict()), tmp / "vae" / "diffusion_pytorch_model.safetensors",
                            {"format": "pt"})  # fmt: skip
        return folder

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        from . import saving

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        te = {"model." + k: v for k, v in parts.text_encoders[0].state_dict().items()}
        names = sorted(te)
        half = len(names) // 2
        shards = [out / f"{name}_te-0000{i}-of-00002.safetensors" for i in (1, 2)]
        for shard, part in zip(shards, (names[:half], names[half:])):
            save_state_dict({k: te[k] for k in part}, shard, {"format": "pt"})
        return {
            "dit": saving.save_dit(parts, out / f"{name}-base_dit.safetensors", self.family),
            "text_encoder": shards[0],
            "vae": saving.save_vae(parts, out / f"{name}_ae.safetensors"),
        }

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {}
