"""ToyDiT's tiny model (``ModelFamily.tiny``, ``library.families.base.TinyModel``): seeded random weights of the
released architecture, which for ToyDiT is the tiny one (``model.py``'s configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from library.families.base import Parts
from library.families.loading import META_CONFIGS
from library.files.weights import save_state_dict

from .model import DIT_CONFIG, SCHEDULER, TEXT_CONFIG, VAE_CONFIG, ByteTokenizer, ToyDiT, ToyTextEncoder
from .options import ToyDiTOptions

if TYPE_CHECKING:
    from .family import ToyDiTFamily


def add_tool_args(parser: Any) -> None:
    """``tools/make_tiny_model.py --toydit_blocks N``."""
    parser.add_argument("--toydit_blocks", type=int, default=None, metavar="N", help="ToyDiT blocks (default 2)")


class ToyTiny:
    """ToyDiT's tiny model (``library.families.base.TinyModel``); the tiny model is the released one."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ToyDiTFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Parts:
        from diffusers import AutoencoderKL

        torch.manual_seed(seed)
        config = dict(DIT_CONFIG, depth=blocks or DIT_CONFIG["depth"])
        modules = (ToyDiT(config), AutoencoderKL(**VAE_CONFIG), ToyTextEncoder(TEXT_CONFIG))
        for module in modules:
            module.eval().requires_grad_(False)
        denoiser, vae, encoder = modules
        return Parts(denoiser, vae, [encoder], [ByteTokenizer()], dict(SCHEDULER), self.family.name, "tiny-toydit",
                     ToyDiTOptions())  # fmt: skip

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """``<name>_dit.safetensors`` (transformer and VAE) and ``<name>_text_encoder.safetensors``
        (``--toy_text_encoder``: its bare keys, its config in the metadata)."""
        out = Path(out)
        dit = self.family.save(parts, out / f"{name}_dit.safetensors", text_encoder=False)
        encoder = parts.text_encoders[0]
        meta = {META_CONFIGS: json.dumps({"text_encoder": dict(encoder.config)})}
        te = save_state_dict(dict(encoder.state_dict()), out / f"{name}_text_encoder.safetensors", meta)
        return {"dit": Path(dit), "text_encoder": Path(te)}

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {"blocks": getattr(args, "toydit_blocks", None)}
