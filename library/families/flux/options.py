"""FLUX.1 / Chroma's own flags (sd-scripts' ``flux_train_utils.add_flux_train_arguments`` and
``flux_train_network.py``'s own), next to their one reader :class:`FluxOptions` (``FluxFamily.options``; see
``library/families/options.py``).

``--clip_l --t5xxl --ae``: the single files beside a BFL transformer file (a diffusers folder carries its own);
``--model_type flux|chroma``: what the user says the weights are (checked against the weights, which decide);
``--t5xxl_max_token_length`` (default per variant: 512 dev and Chroma, 256 schnell, as sd-scripts);
``--apply_t5_attn_mask`` (Chroma: required, as sd-scripts); ``--guidance_scale`` (the embedded guidance FLUX.1-dev is
given in every training step, default 3.5; schnell has no guidance input and Chroma's diffusers model none either:
sd-scripts passes the value to them all, the models ignore it); ``--text_encoder_batch_size`` (captions per
text-encoder call while caching; default the batch size). ``--split_mode`` (deprecated in sd-scripts, which turns it
into ``--blocks_to_swap 18``) and ``--controlnet_model_name_or_path`` (flux_train_control_net.py's) are refused. Every
entry point that loads a FLUX model takes the load flags (``--clip_l --t5xxl --ae --t5xxl_max_token_length
--apply_t5_attn_mask``); a training script also the objective's (``objective.add_flow_matching_args``) and the rest.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect
from .objective import FlowMatchingConfig, add_flow_matching_args

MODEL_TYPES = ("flux", "chroma")
# What --model_type names, by family: FLUX.1 dev and schnell are both "flux" (sd-scripts reads dev / schnell from
# the weights too).
MODEL_TYPE_OF_FAMILY = {"flux-dev": "flux", "flux-schnell": "flux", "chroma": "chroma"}
# The SD-only flags sd-scripts' FLUX script accepts and does not read (flag -> why); flux_train_network.py says so
# once in the log and resets them (library.cli.parse.reset_no_effect_flags).
SD_ONLY_FLAGS = {
    "--v2": "FLUX is detected from the weights (sd-scripts' FLUX script does not read --v2)",
    "--v_parameterization": "FLUX is a flow-matching model, trained on the velocity (sd-scripts' FLUX script does "
    "not read it)",
    "--clip_skip": "FLUX reads CLIP-L's pooled output and T5's last layer (sd-scripts' FLUX script ignores it)",
    "--max_token_length": "CLIP-L reads 77 tokens; the T5 length is --t5xxl_max_token_length (sd-scripts warns "
    "and ignores it)",
}


@dataclass(frozen=True)
class FluxOptions:
    """The FLUX flags of a run or a load (field names = sd-scripts' flags); ``flow``: the objective's settings
    (training only). ``FluxFamily.load(..., options=)`` keeps them as ``Parts.options`` with the defaults filled in
    (the T5 length of the variant, Chroma's mask); the run layer asks :meth:`problems` (the weights against
    ``--model_type``), :meth:`metadata` (``ss_*`` keys of trained files), :meth:`prompt_identity` and
    ``text_encoder_batch_size``.

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    clip_l: str | None = None
    t5xxl: str | None = None
    ae: str | None = None
    model_type: str = "flux"
    t5xxl_max_token_length: int | None = None
    apply_t5_attn_mask: bool = False
    guidance_scale: float = 3.5
    text_encoder_batch_size: int | None = None
    flow: FlowMatchingConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        """The FLUX model group (sd-scripts' names, types and defaults): the load flags; with ``training`` the
        objective's flags, ``--model_type --guidance_scale --text_encoder_batch_size``, the refused ``--split_mode``
        / ``--controlnet_model_name_or_path``, and :data:`SD_ONLY_FLAGS` marked as having no effect. Returns the
        parser."""
        if training:
            add_flow_matching_args(parser)
        g = parser.add_argument_group(
            "FLUX model", "FLUX.1 dev / schnell and Chroma (sd-scripts' flux_train_network.py)"
        )
        add_once(g, parser, "--clip_l", type=str, default=None,
                 help="CLIP-L .safetensors beside a BFL model file (not Chroma)")  # fmt: skip
        add_once(g, parser, "--t5xxl", type=str, default=None, help="T5-XXL .safetensors beside a BFL model file")
        add_once(
            g, parser, "--ae", type=str, default=None, help="the 16-channel AE .safetensors beside a BFL model file"
        )
        if training:
            g.add_argument("--model_type", type=str, default="flux", choices=list(MODEL_TYPES),
                           help="flux (FLUX.1 dev / schnell) or chroma; must agree with the weights")  # fmt: skip
        add_once(g, parser, "--t5xxl_max_token_length", type=int, default=None,
                 help="T5 tokens per caption (default: 512 for dev and Chroma, 256 for schnell)")  # fmt: skip
        add_once(g, parser, "--apply_t5_attn_mask", action="store_true",
                 help="mask T5's padding in T5 and in the transformer's attention (required for Chroma)")  # fmt: skip
        if not training:
            return parser
        g.add_argument("--guidance_scale", type=float, default=3.5,
                       help="embedded guidance given to FLUX.1-dev in training (schnell and Chroma have no guidance "
                       "input: use 0 for Chroma, as sd-scripts' docs)")  # fmt: skip
        add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                 help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        add_unsupported(g, "--split_mode", "sd-scripts deprecated it; use --blocks_to_swap 18, which it stands for",
                        action="store_true")  # fmt: skip
        if "--controlnet_model_name_or_path" not in parser._option_string_actions:  # flux_train_control_net.py's
            add_unsupported(g, "--controlnet_model_name_or_path", "a LoRA / fine-tune script does not train a "
                            "ControlNet: use flux_train_control_net.py", type=str, default=None)  # fmt: skip
        mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> FluxOptions:
        """The flags of :meth:`add_args`: files must exist, counts be positive, the guidance a finite number >= 0; with
        ``training`` the objective's settings (``flow``)."""
        from library.cli.parse import from_namespace, guidance_problems, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("clip_l", "t5xxl", "ae"))
        problems += positive_count_problems(args, ("t5xxl_max_token_length", "text_encoder_batch_size"))
        problems += guidance_problems("--guidance_scale", getattr(args, "guidance_scale", cls.guidance_scale))
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for FLUX.1 / Chroma: A1111-style weights are for CLIP "
                            "prompts, and T5 encodes the caption as written (sd-scripts' FLUX script has no weighting "
                            "either: it fails at the first step); drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = FlowMatchingConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        return from_namespace(cls, args, flow=flow)

    def prompt_identity(self) -> str:
        """The T5 length and mask (what changes the text encoders' outputs)."""
        return identity_of((("t5xxl_max_token_length", self.t5xxl_max_token_length),
                            ("apply_t5_attn_mask", self.apply_t5_attn_mask)))  # fmt: skip

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' FLUX keys of trained files (``flux_train_network.py: update_metadata``) beyond the objective's."""
        return {"ss_model_type": self.model_type, "ss_apply_t5_attn_mask": self.apply_t5_attn_mask,
                "ss_guidance_scale": self.guidance_scale}  # fmt: skip

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        """``--model_type`` against the family read from the weights at ``path`` (its ``spec``); Chroma without
        ``--apply_t5_attn_mask`` (sd-scripts asserts it); ``--clip_l`` for Chroma (it has no CLIP-L)."""
        expected = MODEL_TYPE_OF_FAMILY.get(spec.name)
        if expected is None:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; flux_train_network.py "
                    "trains FLUX.1 dev / schnell and Chroma"]  # fmt: skip
        problems = []
        if expected != self.model_type:
            problems.append(f"--model_type {self.model_type}: {path} is a {spec.title} model (read from its "
                            f"weights); pass --model_type {expected}")  # fmt: skip
        if spec.name == "chroma" and not self.apply_t5_attn_mask:
            problems.append("Chroma needs the T5 attention mask: add --apply_t5_attn_mask (sd-scripts requires it)")
        if spec.name == "chroma" and self.clip_l is not None:
            problems.append(f"--clip_l {self.clip_l}: Chroma has no CLIP-L text encoder; remove --clip_l")
        return problems
