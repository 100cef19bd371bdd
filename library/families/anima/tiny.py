"""Anima's tiny model (``ModelFamily.tiny``): the released module layout and names (Cosmos-Predict2 blocks with
AdaLN-LoRA, the LLM adapter over the real 32128-token T5 vocabulary, Qwen3 with its real 151936-token vocabulary, the
Qwen-Image VAE's four levels) at tiny widths, seeded random weights.

Files (:meth:`AnimaTiny.write_files`): ``<name>_dit.safetensors`` (sd-scripts' names under ``net.``, the adapter
inside, as the released file), ``<name>_qwen3.safetensors`` (``model.``-prefixed, as ComfyUI's
``qwen_3_06b_base.safetensors``), ``<name>_vae.safetensors`` (ComfyUI's Wan names, as ``qwen_image_vae.safetensors``);
:meth:`write_folder` the same three as one Anima folder (``family.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..autoencoders import qwen_image
from ..base import Parts
from . import model as M
from . import text
from .text import TINY_QWEN3

TINY_ADAPTER = dict(source_dim=16, target_dim=32, model_dim=32, num_layers=2, num_attention_heads=2, mlp_ratio=4.0,
                    target_vocab_size=32128, use_self_attention=True, min_sequence_length=0)  # fmt: skip
TINY_DIT = dict(M.released_config(), num_attention_heads=2, attention_head_dim=16, num_layers=2, text_embed_dim=32,
                adaln_lora_dim=8, text_conditioner=TINY_ADAPTER)  # fmt: skip


def add_tool_args(parser: Any) -> None:
    parser.add_argument("--anima_blocks", type=int, default=None, metavar="N", help="Anima DiT blocks (default 2)")


def build_qwen3(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return text.qwen3_factory(TINY_QWEN3)()


class AnimaTiny:
    """Anima's tiny model (``library.families.base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: Any) -> None:
        self.family = family

    def build(self, seed: int = 0, *, blocks: int | None = None) -> Parts:
        from .options import AnimaOptions

        torch.manual_seed(seed)
        denoiser = M.build(dict(TINY_DIT, num_layers=blocks or TINY_DIT["num_layers"]))
        _randomize_zero_inits(denoiser, seed)
        vae = qwen_image.factory(qwen_image.TINY)()
        encoder = build_qwen3(seed + 1)
        for module in (denoiser, vae, encoder):
            module.eval().requires_grad_(False)
        tokenizers = [text.load_qwen3_tokenizer(), text.load_t5_tokenizer()]
        options = AnimaOptions(qwen3_max_token_length=16, t5_max_token_length=16)
        return Parts(denoiser, vae, [encoder], tokenizers, dict(M.SCHEDULER), self.family.name, "tiny-anima", options)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """``<name>_dit.safetensors`` / ``_qwen3`` / ``_vae`` (module docstring)."""
        from . import saving

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "dit": saving.save_dit(parts, out / f"{name}_dit.safetensors", self.family),
            "qwen3": saving.save_qwen3(parts, out / f"{name}_qwen3.safetensors"),
            "vae": saving.save_vae(parts, out / f"{name}_vae.safetensors", comfy=True),
        }

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {"blocks": getattr(args, "anima_blocks", None)}


def _randomize_zero_inits(module: torch.nn.Module, seed: int) -> None:
    """diffusers zero-initialises nothing here, but a freshly built model's outputs should depend on every weight:
    the tiny weights are redrawn with a small normal spread (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
