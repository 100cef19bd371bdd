"""SD3 / SD3.5's own flags (sd-scripts' ``sd3_train_utils.add_sd3_training_arguments``; ``--training_shift`` and the
weighting flags are the objective's: ``objective.add_sd3_flow_args``), next to their one reader :class:`SD3Options`
(``SD3Family.options``; see ``library/families/options.py``).

``--clip_l --clip_g --t5xxl``: text-encoder single files that replace (or supply) the ones in an SAI file; a diffusers
folder carries its own. ``--t5xxl_max_token_length`` (T5 tokens per caption, default 256 as sd-scripts).
``--apply_lg_attn_mask`` / ``--apply_t5_attn_mask``: CLIP-L and CLIP-G (resp. T5) get their padding masks, so
their outputs come from the caption's tokens only (sd-scripts passes the masks to the encoders; the transformer gets
none). ``--clip_l_dropout_rate --clip_g_dropout_rate --t5_dropout_rate``: the
probability per caption that an encoder's output is replaced by zeros (sd-scripts' ``Sd3TextEncodingStrategy``; with
cached outputs the dropping happens at each step, as sd-scripts' ``drop_cached_text_encoder_outputs``).
``--pos_emb_random_crop_rate`` and ``--enable_scaled_pos_embed``: SD3.5-medium's position-embedding tricks (sd-scripts:
"Only for SD3.5M"; refused for the other variants). ``--text_encoder_batch_size``: captions per text-encoder call while
caching (default the batch size). Every entry point that loads an SD3 model takes the load flags (``--clip_l --clip_g
--t5xxl --t5xxl_max_token_length --apply_lg_attn_mask --apply_t5_attn_mask``); a training script the rest.

sd-scripts marks ``--save_clip --save_t5xxl --t5xxl_device --t5xxl_dtype`` "[DOES NOT WORK]" and reads none of them:
here they are accepted, said in the log once and reset (``library.cli.parse.add_no_effect``), so command lines run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from library.cli.parse import add_no_effect
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect
from .objective import SD3FlowConfig, add_sd3_flow_args

FAMILY_NAMES = ("sd3", "sd3.5-medium", "sd3.5-large")
# The flags sd-scripts documents as "Only for SD3.5M" (SD3.5-medium's position-embedding handling).
MEDIUM_ONLY = ("pos_emb_random_crop_rate", "enable_scaled_pos_embed")
DROPOUT_FLAGS = ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate")
# The SD-only flags sd-scripts' SD3 script accepts and does not read (flag -> why); sd3_train_network.py says so
# once in the log and resets them (library.cli.parse.reset_no_effect_flags).
SD_ONLY_FLAGS = {
    "--v2": "SD3 is detected from the weights (sd-scripts' SD3 script does not read --v2)",
    "--v_parameterization": "SD3 is a flow-matching model (sd-scripts' SD3 script does not read it)",
    "--clip_skip": "SD3 reads CLIP-L's and CLIP-G's penultimate layers and T5's last (sd-scripts' SD3 script ignores "
    "it)",
    "--max_token_length": "CLIP-L and CLIP-G read 77 tokens; the T5 length is --t5xxl_max_token_length (sd-scripts "
    "warns and ignores it)",
}
# sd-scripts' "[DOES NOT WORK]" flags (flag -> why nothing here acts on them).
DOES_NOT_WORK = {
    "--save_clip": "a trained adapter file holds the adapter only, and sd-scripts marks the flag [DOES NOT WORK] "
    "(merge the encoders with tools/merge_sd3_safetensors.py)",
    "--save_t5xxl": "a trained adapter file holds the adapter only, and sd-scripts marks the flag [DOES NOT WORK] "
    "(merge the encoders with tools/merge_sd3_safetensors.py)",
    "--t5xxl_device": "T5-XXL runs where the other text encoders run (sd-scripts marks the flag [DOES NOT WORK])",
    "--t5xxl_dtype": "T5-XXL takes the text encoders' dtype (--mixed_precision, --fp8_base); sd-scripts marks the "
    "flag [DOES NOT WORK]",
}


@dataclass(frozen=True)
class SD3Options:
    """The SD3 flags of a run or a load (field names = sd-scripts' flags); ``flow``: the objective's settings
    (training only). ``SD3Family.load(..., options=)`` keeps them as ``Parts.options`` with the defaults filled in
    (and the training resolutions of ``--enable_scaled_pos_embed`` once known: ``pos_embed_resolutions``); the run
    layer asks :meth:`problems` (the weights against the SD3.5-medium-only flags), :meth:`metadata` (``ss_*`` keys of
    trained files), :meth:`prompt_identity` and ``text_encoder_batch_size``.

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    clip_l: str | None = None
    clip_g: str | None = None
    t5xxl: str | None = None
    t5xxl_max_token_length: int = 256
    apply_lg_attn_mask: bool = False
    apply_t5_attn_mask: bool = False
    clip_l_dropout_rate: float = 0.0
    clip_g_dropout_rate: float = 0.0
    t5_dropout_rate: float = 0.0
    pos_emb_random_crop_rate: float = 0.0
    enable_scaled_pos_embed: bool = False
    text_encoder_batch_size: int | None = None
    flow: SD3FlowConfig | None = None
    pos_embed_resolutions: tuple[Any, ...] | None = None  # --enable_scaled_pos_embed: the tables' resolutions

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        """The SD3 model group (sd-scripts' names, types and defaults): the load flags; with ``training`` the
        objective's flags, sd-scripts' "[DOES NOT WORK]" flags (accepted, no effect), the dropout and
        position-embedding flags, ``--text_encoder_batch_size``, and :data:`SD_ONLY_FLAGS` marked as having no
        effect. Returns the parser. Outside training ``--t5xxl_max_token_length`` defaults to None (the model's
        256) so that it names no value another family's model would take."""
        if training:
            add_sd3_flow_args(parser)
        g = parser.add_argument_group(
            "SD3 model", "SD3 medium, SD3.5 medium / large (sd-scripts' sd3_train_network.py)"
        )
        for name, what in (("clip_l", "CLIP-L"), ("clip_g", "CLIP-G"), ("t5xxl", "T5-XXL")):
            add_once(g, parser, f"--{name}", type=str, default=None,
                     help=f"{what} .safetensors (default: the one inside the SAI model file)")  # fmt: skip
        if training:
            for flag, reason in DOES_NOT_WORK.items():
                if flag.startswith("--save_"):
                    add_no_effect(g, flag, reason, action="store_true")
                else:
                    add_no_effect(g, flag, reason, type=str, default=None)
        add_once(g, parser, "--t5xxl_max_token_length", type=int, default=256 if training else None,
                 help="T5 tokens per caption (default 256)")  # fmt: skip
        add_once(g, parser, "--apply_lg_attn_mask", action="store_true",
                 help="mask the padding in CLIP-L's and CLIP-G's attention")  # fmt: skip
        add_once(g, parser, "--apply_t5_attn_mask", action="store_true",
                 help="mask the padding in T5-XXL's attention")  # fmt: skip
        if not training:
            return parser
        for flag, what in zip(DROPOUT_FLAGS, ("CLIP-L", "CLIP-G", "T5-XXL")):
            g.add_argument(f"--{flag}", type=float, default=0.0,
                           help=f"probability per caption that {what}'s output is zeroed in training (default 0)")  # fmt: skip
        g.add_argument("--pos_emb_random_crop_rate", type=float, default=0.0,
                       help="SD3.5-medium: probability per step that the position-embedding crop is drawn at random "
                       "(default 0: centred)")  # fmt: skip
        g.add_argument("--enable_scaled_pos_embed", action="store_true",
                       help="SD3.5-medium: position embeddings scaled per bucket resolution (multi-resolution "
                       "training)")  # fmt: skip
        add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                 help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> SD3Options:
        """The flags of :meth:`add_args`: files must exist, counts be positive, rates lie in [0, 1]; with
        ``training`` the objective's settings (``flow``)."""
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        # the SD3 loader also reads an encoder from a diffusers folder (library/families/sd3/loading.py)
        problems = missing_path_problems(args, ("clip_l", "clip_g", "t5xxl"), folders=True)
        problems += positive_count_problems(args, ("t5xxl_max_token_length", "text_encoder_batch_size"))
        for flag in (*DROPOUT_FLAGS, "pos_emb_random_crop_rate"):
            value = getattr(args, flag, 0.0)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                problems.append(f"--{flag} is a probability: give a number from 0 to 1, got {value}")
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for SD3: A1111-style weights are not implemented for "
                            "SD3's three encoders (sd-scripts' SD3 script has no weighting either: it fails at the "
                            "first step); drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = SD3FlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        length = getattr(args, "t5xxl_max_token_length", None)
        return from_namespace(cls, args, flow=flow, t5xxl_max_token_length=256 if length is None else length)

    def with_pos_embed(self, random_crop_rate: float, resolutions: Iterable | None) -> SD3Options:
        """These options with the position-embedding settings :meth:`SD3Family.set_pos_embed` installed."""
        import dataclasses

        return dataclasses.replace(self, pos_emb_random_crop_rate=random_crop_rate,
                                   pos_embed_resolutions=None if resolutions is None else tuple(resolutions))  # fmt: skip

    def prompt_identity(self) -> str:
        """The T5 length and the masks (what changes the text encoders' outputs)."""
        return identity_of((("t5xxl_max_token_length", self.t5xxl_max_token_length),
                            ("apply_lg_attn_mask", self.apply_lg_attn_mask),
                            ("apply_t5_attn_mask", self.apply_t5_attn_mask)))  # fmt: skip

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' SD3 keys of trained files (``sd3_train_network.py: update_metadata``) beyond the objective's
        (``ss_weighting_scheme ss_logit_mean ss_logit_std ss_mode_scale``: ``SD3FlowObjective.metadata``)."""
        return {"ss_apply_lg_attn_mask": self.apply_lg_attn_mask, "ss_apply_t5_attn_mask": self.apply_t5_attn_mask}

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        """A model of another family; the SD3.5-medium-only flags on SD3 medium or SD3.5-large weights."""
        if spec.name not in FAMILY_NAMES:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; sd3_train_network.py "
                    "trains SD3 medium and SD3.5 medium / large"]  # fmt: skip
        if spec.name == "sd3.5-medium":
            return []
        given = [f"--{flag}" for flag in MEDIUM_ONLY if getattr(self, flag)]
        return [f"{flag}: only for SD3.5-medium (sd-scripts: 'Only for SD3.5M'), and {path} is a {spec.title} "
                "model (read from its weights); remove the flag" for flag in given]  # fmt: skip
