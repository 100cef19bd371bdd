"""flux_train.py's own flags (full fine-tuning of FLUX.1 dev / schnell and Chroma) and the rules they carry, as
sd-scripts' ``flux_train.py`` reads them: only the transformer trains (sd-scripts' script has no text-encoder
training); ``--mem_eff_save`` writes the model file tensor by tensor (no second copy of the model in memory);
``--double_blocks_to_swap`` / ``--single_blocks_to_swap`` (deprecated) are read as ``--blocks_to_swap =
double + single // 2``, with a warning.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from library.files.weights import streamed_saves

from ..full_training import PlainRules

if TYPE_CHECKING:
    from ..base import Parts
    from ..protocol import ModelFamily

logger = logging.getLogger("sdtrain")


@dataclass(frozen=True)
class FluxRules(PlainRules):
    """The transformer at ``--learning_rate``; ``mem_eff_save``: files written tensor by tensor."""

    mem_eff_save: bool = False

    def save(self, family: ModelFamily, parts: Parts, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        with streamed_saves(self.mem_eff_save):  # --mem_eff_save: .safetensors written tensor by tensor
            family.save(parts, path, dtype=dtype, metadata=metadata, safetensors=safetensors)


class FluxFullTraining:
    """``--mem_eff_save`` and the deprecated block-swap flags."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("FLUX full fine-tuning", "sd-scripts' flux_train.py")
        group.add_argument("--mem_eff_save", action="store_true", help="write the model file tensor by tensor, "
                           "without a second copy of the model in memory")  # fmt: skip
        group.add_argument("--double_blocks_to_swap", type=int, default=None, help="[deprecated] use "
                           "--blocks_to_swap (--blocks_to_swap = this + --single_blocks_to_swap // 2)")  # fmt: skip
        group.add_argument("--single_blocks_to_swap", type=int, default=None, help="[deprecated] use --blocks_to_swap")

    def prepare_args(self, args: argparse.Namespace) -> None:
        """sd-scripts' reading of the deprecated flags: without ``--blocks_to_swap``, ``N = --double_blocks_to_swap +
        --single_blocks_to_swap // 2``."""
        double, single = args.double_blocks_to_swap, args.single_blocks_to_swap
        if args.blocks_to_swap is None and (double or single):
            args.blocks_to_swap = (double or 0) + (single or 0) // 2
            if args.blocks_to_swap:
                logger.warning("--double_blocks_to_swap %s and --single_blocks_to_swap %s are deprecated (sd-scripts): "
                               "read as --blocks_to_swap %d; use that flag", double, single, args.blocks_to_swap)  # fmt: skip

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> FluxRules:
        return FluxRules(mem_eff_save=bool(args.mem_eff_save))
