"""lumina_train.py's own flags (full fine-tuning of Lumina Image 2.0), as sd-scripts' ``lumina_train.py`` reads them:
only the transformer trains (sd-scripts' script trains no Gemma); ``--mem_eff_save`` writes the model file tensor by
tensor (no second copy of the model in memory). ``--fused_optimizer_groups`` / ``--blockwise_fused_optimizers`` are
the shared flag sets of the script; ``--cpu_offload_checkpointing`` the shared block-swap flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.files.weights import streamed_saves

from ..full_training import PlainRules


@dataclass(frozen=True)
class LuminaRules(PlainRules):
    """The transformer at ``--learning_rate``; ``mem_eff_save``: files written tensor by tensor."""

    mem_eff_save: bool = False

    def save(self, family: Any, parts: Any, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        with streamed_saves(self.mem_eff_save):
            family.save(parts, path, dtype=dtype, metadata=metadata, safetensors=safetensors)


class LuminaFullTraining:
    """``--mem_eff_save``."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("Lumina 2 full fine-tuning", "sd-scripts' lumina_train.py")
        group.add_argument("--mem_eff_save", action="store_true", help="write the model file tensor by tensor, "
                           "without a second copy of the model in memory")  # fmt: skip

    def prepare_args(self, args: argparse.Namespace) -> None:
        return None

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> LuminaRules:
        return LuminaRules(mem_eff_save=bool(getattr(args, "mem_eff_save", False)))
