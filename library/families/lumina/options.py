"""Lumina Image 2.0's own flags (sd-scripts' ``lumina_train_util.add_lumina_train_arguments``), next to their one
reader :class:`LuminaOptions` (``LuminaFamily.options``; see ``library/families/options.py``).

Load flags (every entry point that loads a Lumina model): ``--gemma2 --ae`` (the files beside the Alpha-VLLM
transformer file), ``--gemma2_max_token_length`` (Gemma tokens per caption, default 256) and ``--system_prompt``
(put before every caption as ``"<system prompt> <Prompt Start> <caption>"``; default none). Training: the
objective's flags (``objective.add_lumina_flow_args``), ``--use_flash_attn`` / ``--use_sage_attn`` (refused when
their package is not installed, naming it; with it, attention still runs through PyTorch's
``scaled_dot_product_attention``, said once in the log), ``--sample_batch_size`` (samples are made one prompt at a
time: said once) and ``--text_encoder_batch_size``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect
from .objective import LuminaFlowConfig, add_lumina_flow_args

log = logging.getLogger(__name__)

ATTENTION_PACKAGES = {"use_flash_attn": "flash_attn", "use_sage_attn": "sageattention"}
SD_ONLY_FLAGS = {
    "--v2": "Lumina 2 is detected from the weights (sd-scripts' Lumina script does not read --v2)",
    "--v_parameterization": "Lumina 2 is a flow-matching model (sd-scripts' Lumina script does not read it)",
    "--clip_skip": "Lumina 2 reads Gemma-2's second-to-last hidden states (sd-scripts' Lumina script ignores it)",
    "--max_token_length": "Gemma's length is --gemma2_max_token_length (sd-scripts' Lumina script ignores it)",
}


@dataclass(frozen=True)
class LuminaOptions:
    """The Lumina flags of a run or a load (field names = sd-scripts' flags); ``flow``: the objective's (training)."""

    gemma2: str | None = None
    ae: str | None = None
    gemma2_max_token_length: int | None = None
    system_prompt: str = ""
    use_flash_attn: bool = False
    use_sage_attn: bool = False
    sample_batch_size: int | None = None
    text_encoder_batch_size: int | None = None
    flow: LuminaFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_lumina_flow_args(parser)
        g = parser.add_argument_group("Lumina 2 model", "Lumina Image 2.0 (sd-scripts' lumina_train_network.py)")
        add_once(g, parser, "--gemma2", type=str, default=None,
                 help="Gemma-2-2B .safetensors (or folder) beside the Alpha-VLLM transformer file")  # fmt: skip
        add_once(g, parser, "--ae", type=str, default=None, help="the FLUX AE .safetensors beside the model file")
        add_once(g, parser, "--gemma2_max_token_length", type=int, default=None,
                 help="Gemma tokens per caption (default 256)")  # fmt: skip
        add_once(g, parser, "--system_prompt", type=str, default="",
                 help='put before every caption as "<system prompt> <Prompt Start> <caption>" (default none)')  # fmt: skip
        if not training:
            return parser
        for flag, package in ATTENTION_PACKAGES.items():
            add_once(g, parser, f"--{flag}", action="store_true",
                     help=f"sd-scripts' attention through {package} (needs the package; sdtrain computes attention "
                     "with PyTorch's scaled_dot_product_attention)")  # fmt: skip
        add_once(g, parser, "--sample_batch_size", type=int, default=None,
                 help="sd-scripts' prompts per sampling batch; sdtrain samples one prompt at a time")  # fmt: skip
        add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                 help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> LuminaOptions:
        """The flags of :meth:`add_args`; ``ConfigError`` listing every problem."""
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("gemma2", "ae"), folders=True)
        problems += positive_count_problems(args, ("gemma2_max_token_length", "sample_batch_size",
                                                   "text_encoder_batch_size"))  # fmt: skip
        length = getattr(args, "gemma2_max_token_length", None)
        if length is not None and length >= 1 and length % 8:
            problems.append(f"--gemma2_max_token_length {length}: must be a multiple of 8 (captions are padded to a "
                            f"multiple of 8, as sd-scripts does, and truncated at this length); try {length + 8 - length % 8}")  # fmt: skip
        for flag, package in ATTENTION_PACKAGES.items():
            if getattr(args, flag, False):
                if importlib.util.find_spec(package) is None:
                    problems.append(f"--{flag} needs the {package} package, which is not installed; install it or "
                                    "drop the flag (attention then runs through PyTorch's SDPA)")  # fmt: skip
                else:
                    log.warning("--%s: %s is installed, but sdtrain's Lumina 2 computes attention with PyTorch's "
                                "scaled_dot_product_attention (same result; it picks fused kernels itself)", flag,
                                package)  # fmt: skip
        if getattr(args, "sample_batch_size", None):
            log.warning("--sample_batch_size %s: sdtrain samples one prompt at a time (the images are the same)",
                        args.sample_batch_size)  # fmt: skip
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for Lumina 2: A1111-style weights are for CLIP "
                            "prompts, Gemma encodes the caption as written (sd-scripts' Lumina script does not weight "
                            "them either); drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = LuminaFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        return from_namespace(cls, args, flow=flow, system_prompt=getattr(args, "system_prompt", None) or "")

    def prompt_identity(self) -> str:
        return identity_of((("gemma2_max_token_length", self.gemma2_max_token_length),
                            ("system_prompt", self.system_prompt)))  # fmt: skip

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' Lumina keys of trained files beyond the objective's."""
        return {"ss_system_prompt": self.system_prompt}

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name != "lumina2":
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; lumina_train_network.py trains "
                    "Lumina Image 2.0"]  # fmt: skip
        return []
