"""ToyDiT's own flags and their one reader, :class:`ToyDiTOptions` (``ToyDiTFamily.options``).

Load flags (every entry point that loads a ToyDiT model): ``--toy_text_encoder FILE`` (the text encoder as a file
beside a model file that holds only the transformer and the VAE; it replaces an embedded one) and
``--toy_max_length N`` (tokens per caption, default 32). Training adds the objective's flags (``objective.py``:
``--toy_sigma_law --toy_shift``) and ``--text_encoder_batch_size``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from library.cli.problems import ConfigError
from library.families.base import FamilySpec
from library.families.options import add_once, identity_of, mark_no_effect

from .objective import ToyFlowConfig, add_toy_flow_args

FAMILY_NAMES = ("toydit",)
DEFAULT_LENGTH = 32
# shared flags ToyDiT has nothing to act on (flag -> why): said once in the log and reset
NO_EFFECT = {
    "--v2": "ToyDiT is read from the weights",
    "--v_parameterization": "ToyDiT is a flow-matching model",
    "--clip_skip": "ToyDiT's text encoder has no CLIP layers to skip",
    "--max_token_length": "ToyDiT's caption length is --toy_max_length",
}


@dataclass(frozen=True)
class ToyDiTOptions:
    """The ToyDiT flags of a run or a load; ``flow``: the objective's settings (training only).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    toy_text_encoder: str | None = None
    toy_max_length: int = DEFAULT_LENGTH
    text_encoder_batch_size: int | None = None
    flow: ToyFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        """The load flags; with ``training`` the objective's flags and ``--text_encoder_batch_size``. Outside
        training ``--toy_max_length`` defaults to None (the model's 32), so it names no value another family's model
        would be given."""
        if training:
            add_toy_flow_args(parser)
        g = parser.add_argument_group("ToyDiT model", "the test plug-in family (tests/plugins/toydit)")
        add_once(g, parser, "--toy_text_encoder", type=str, default=None,
                 help="ToyDiT text encoder .safetensors (default: the one inside the model file)")  # fmt: skip
        add_once(g, parser, "--toy_max_length", type=int, default=DEFAULT_LENGTH if training else None,
                 help=f"tokens per caption (default {DEFAULT_LENGTH})")  # fmt: skip
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
            mark_no_effect(parser, NO_EFFECT)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> ToyDiTOptions:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("toy_text_encoder",))
        problems += positive_count_problems(args, ("toy_max_length", "text_encoder_batch_size"))
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for ToyDiT: A1111-style weights are written for CLIP "
                            "tokenizers, and ToyDiT reads bytes; drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = ToyFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        length = getattr(args, "toy_max_length", None)
        return from_namespace(cls, args, flow=flow, toy_max_length=DEFAULT_LENGTH if length is None else length)

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        """A model of another family (read from its weights)."""
        if spec.name not in FAMILY_NAMES:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; the ToyDiT scripts train "
                    "ToyDiT models"]  # fmt: skip
        return []

    def metadata(self) -> dict[str, Any]:
        return {"ss_toy_max_length": self.toy_max_length}

    def prompt_identity(self) -> str:
        return identity_of((("toy_max_length", self.toy_max_length),))
