"""stable_cascade_train_stage_c.py's own flags and rules, as sd-scripts' stable-cascade branch reads them:
``--train_text_encoder`` (the script's flag: CLIP-bigG trains too) at ``--learning_rate_te1`` (default
``--learning_rate``). The output is the branch's ``stage_c_saver_common``: stage C under Stability's names at the
model path, and a trained text model next to it as ``<name>_text_model.safetensors`` (transformers names, what
``--text_model_checkpoint_path`` takes).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..full_training import PlainRules, raise_if, text_cache_problems

if TYPE_CHECKING:
    from ..base import Parts
    from ..full_training import FamilyWriter


@dataclass(frozen=True)
class CascadeRules(PlainRules):
    """The branch's rules: the text model at its learning rate, written beside the stage C file."""

    def save(self, family: FamilyWriter, parts: Parts, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        family.save(parts, path, dtype=dtype, metadata=metadata, safetensors=safetensors)
        if self.text_encoder_lrs is not None and path.suffix.lower() == ".safetensors":
            family.save_text_model(parts, path, dtype)  # type: ignore[attr-defined]


class CascadeFullTraining:
    """``--learning_rate_te1`` beside the script's ``--train_text_encoder``."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("Stable Cascade full fine-tuning", "stable_cascade_train_stage_c.py")
        if "--learning_rate_te1" not in parser._option_string_actions:
            g.add_argument("--learning_rate_te1", type=float, default=None,
                           help="learning rate of the text model (default: --learning_rate)")  # fmt: skip

    def prepare_args(self, args: argparse.Namespace) -> None:
        return None

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> CascadeRules:
        trains = bool(getattr(args, "train_text_encoder", False) or train_text_encoder)
        raise_if(text_cache_problems(args, trains))
        return CascadeRules(text_encoder_lrs=(getattr(args, "learning_rate_te1", None),) if trains else None)
