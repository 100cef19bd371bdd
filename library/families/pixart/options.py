"""PixArt's own flags, next to their one reader :class:`PixArtOptions` (``PixArtFamily.options``).

Load flags: ``--t5xxl`` (the T5-XXL encoder beside a single file, or a folder) and ``--t5xxl_max_token_length`` (T5
tokens per caption: the model's own by default, 120 for PixArt-α, 300 for PixArt-Σ, as the original trainers, diffusers'
pipelines and OneTrainer read them). The attention mask of the padding is always passed to T5 and to the transformer's
cross-attention (as the released models were trained). Training: ``--text_encoder_batch_size``; the CLIP-only flags
are marked as having no effect, and training T5 is refused (``problems``); ``--vb_loss_strength`` (OneTrainer's name
and default, 1): the weight of the variational bound that trains the learned-variance half of the output
(``vb_loss.py``; 0 trains ε only).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect

FAMILY_NAMES = ("pixart_alpha", "pixart_sigma")
T5_PARAMETERS = 4.762e9  # the T5-XXL v1.1 encoder
T5_BF16_GIB = round(T5_PARAMETERS * 2 / 2**30, 1)  # 8.9 GiB: its bf16 weights, or their gradients
SD_ONLY_FLAGS = {
    "--v2": "PixArt-α / Σ is told from the weights",
    "--v_parameterization": "PixArt predicts ε (and a variance); there is no v-prediction release",
    "--clip_skip": "PixArt reads T5-XXL's last hidden state",
    "--max_token_length": "the T5 length is --t5xxl_max_token_length (default: 120 for PixArt-α, 300 for PixArt-Σ)",
}


@dataclass(frozen=True)
class PixArtOptions:
    """The PixArt flags of a run or a load (``t5xxl_max_token_length`` None: the model's own)."""

    t5xxl: str | None = None
    t5xxl_max_token_length: int | None = None
    text_encoder_batch_size: int | None = None
    train_text_encoder: bool = False
    vb_loss_strength: float = 1.0

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        g = parser.add_argument_group("PixArt model", "PixArt-α / PixArt-Σ (pixart_train_network.py, pixart_train.py)")
        add_once(g, parser, "--t5xxl", type=str, default=None,
                 help="T5-XXL .safetensors (or folder) beside a PixArt single file")  # fmt: skip
        add_once(g, parser, "--t5xxl_max_token_length", type=int, default=None,
                 help="T5 tokens per caption (default: 120 for PixArt-α, 300 for PixArt-Σ)")  # fmt: skip
        if not training:
            return parser
        add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                 help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        add_once(g, parser, "--vb_loss_strength", type=float, default=1.0,
                 help="weight of the variational-bound loss that trains the learned variance (the second half of "
                 "the output), as the PixArt authors and OneTrainer (default 1; 0: the ε loss only)")  # fmt: skip
        mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> PixArtOptions:
        """The flags of :meth:`add_args`; ``ConfigError`` listing every problem (training T5 is refused)."""
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("t5xxl",), folders=True)
        problems += positive_count_problems(args, ("t5xxl_max_token_length", "text_encoder_batch_size"))
        trains_t5 = training and (
            getattr(args, "train_text_encoder", False)
            or (hasattr(args, "network_module") and not getattr(args, "network_train_unet_only", True)
                and not getattr(args, "cache_text_encoder_outputs", False))
        )  # fmt: skip
        if trains_t5:
            problems.append(
                f"training T5-XXL is not supported for PixArt: its weights ({T5_BF16_GIB} GiB in bf16) would stay on the "
                "device at every step (none with --cache_text_encoder_outputs), and training it adds their gradients "
                f"({T5_BF16_GIB} GiB) and the optimizer's states ({T5_BF16_GIB}-{4 * T5_BF16_GIB:.1f} GiB for AdamW "
                "8-bit / fp32); the original trainers and OneTrainer keep it frozen. Add --network_train_unet_only "
                "(LoRA) or drop --train_text_encoder (full fine-tune), with --cache_text_encoder_outputs"
            )
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for PixArt: A1111-style weights are for CLIP "
                            "prompts, T5 encodes the caption as written; drop the flag")  # fmt: skip
        vb = getattr(args, "vb_loss_strength", 0.0) or 0.0
        if training and vb < 0:
            problems.append(f"--vb_loss_strength must be 0 or more, got {vb}")
        if training and vb and (getattr(args, "unmasked_probability", 0.0) or 0.0) > 0:
            problems.append("--unmasked_probability with the variational-bound loss is not supported (the bound would "
                            "need the same mask draw as the ε loss): add --vb_loss_strength 0, or drop "
                            "--unmasked_probability")  # fmt: skip
        if problems:
            raise ConfigError(problems)
        return from_namespace(cls, args, train_text_encoder=False)

    def prompt_identity(self) -> str:
        return identity_of((("t5xxl_max_token_length", self.t5xxl_max_token_length),))

    def metadata(self) -> dict[str, Any]:
        return {"ss_t5xxl_max_token_length": self.t5xxl_max_token_length, "ss_vb_loss_strength": self.vb_loss_strength}

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; the PixArt scripts train "
                    "PixArt-α and PixArt-Σ"]  # fmt: skip
        return []
