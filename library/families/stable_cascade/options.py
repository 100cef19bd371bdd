"""Stable Cascade's own flags, next to their one reader :class:`CascadeOptions` (``StableCascadeFamily.options``),
with the names of sd-scripts' stable-cascade branch.

Load flags: ``--effnet_checkpoint_path`` (the EfficientNet encoder, ``effnet_encoder.safetensors``: what makes the
stage C latents; the shared ``--vae`` is read as the same file), ``--text_model_checkpoint_path`` (CLIP-bigG with
projection, transformers names, as the branch reads and writes it), ``--save_text_model`` (write the text encoder of
the loaded model to ``--text_model_checkpoint_path``: the branch fetches it from the hub for that, here it comes from
a diffusers ``StableCascadePriorPipeline`` folder's ``text_encoder/``). Training: ``--adaptive_loss_weight`` (the
branch's running per-log-SNR loss weights: refused, see ``objective.py``), ``--text_encoder_batch_size``,
``--previewer_checkpoint_path`` (Stability's ``previewer.safetensors``: what ``--sample_prompts`` needs, the samples
being its preview of the stage C latents, as the branch; ``previewer.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect

FAMILY_NAME = "stable_cascade"
NO_EFFECT = {
    "--v2": "Stable Cascade is told from the weights",
    "--clip_skip": "stage C reads CLIP-bigG's last hidden state, as the stable-cascade branch",
    "--max_token_length": "stage C reads 77 CLIP tokens",
}


@dataclass(frozen=True)
class CascadeOptions:
    """The Stable Cascade flags of a run or a load."""

    effnet_checkpoint_path: str | None = None
    text_model_checkpoint_path: str | None = None
    save_text_model: bool = False
    text_encoder_batch_size: int | None = None
    previewer_checkpoint_path: str | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        g = parser.add_argument_group("Stable Cascade model", "stage C (stable_cascade_train_c_network.py, "
                                      "stable_cascade_train_stage_c.py, stable_cascade_gen_img.py)")  # fmt: skip
        add_once(g, parser, "--effnet_checkpoint_path", type=str, default=None,
                 help="EfficientNet encoder (effnet_encoder.safetensors): makes the stage C latents")  # fmt: skip
        add_once(g, parser, "--text_model_checkpoint_path", type=str, default=None,
                 help="CLIP-bigG text model with projection (.safetensors, transformers names) beside a stage C "
                      "single file")  # fmt: skip
        add_once(g, parser, "--save_text_model", action="store_true",
                 help="write the loaded model's text encoder (a diffusers folder's) to --text_model_checkpoint_path")  # fmt: skip
        if not training:
            return parser
        add_once(g, parser, "--previewer_checkpoint_path", type=str, default=None,
                 help="Stability's previewer.safetensors: samples during training are its RGB preview of the stage C "
                      "latents (8x their size), as the stable-cascade branch")  # fmt: skip
        add_once(g, parser, "--adaptive_loss_weight", action="store_true",
                 help="the branch's adaptive loss weight (refused: see docs/stable_cascade.md); P2 otherwise")  # fmt: skip
        add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                 help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        mark_no_effect(parser, NO_EFFECT)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> CascadeOptions:
        """The flags of :meth:`add_args`; ``ConfigError`` listing every problem."""
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("effnet_checkpoint_path", "previewer_checkpoint_path"))
        if not getattr(args, "save_text_model", False):
            problems += missing_path_problems(args, ("text_model_checkpoint_path",))
        elif not getattr(args, "text_model_checkpoint_path", None):
            problems.append("--save_text_model needs --text_model_checkpoint_path (the file to write)")
        problems += positive_count_problems(args, ("text_encoder_batch_size",))
        if training and getattr(args, "adaptive_loss_weight", False):
            problems.append("--adaptive_loss_weight is not supported: its running loss averages per log-SNR bucket "
                            "would have to be saved with --save_state for an exact resume, and they are not; the "
                            "default P2 weight 1 / (1 + SNR) is the branch's default")  # fmt: skip
        if training and getattr(args, "effnet_checkpoint_path", None) and getattr(args, "vae", None):
            problems.append("--vae and --effnet_checkpoint_path both name the EfficientNet encoder; give one")
        model = getattr(args, "pretrained_model_name_or_path", None)
        in_folder = bool(model) and Path(model, "effnet", "effnet_encoder.safetensors").is_file()
        if training and not (getattr(args, "effnet_checkpoint_path", None) or getattr(args, "vae", None) or in_folder):
            problems.append("--effnet_checkpoint_path is required for training (as in the stable-cascade branch): "
                            "Stability's effnet_encoder.safetensors makes the stage C latents")  # fmt: skip
        if training and getattr(args, "sample_prompts", None) and not getattr(args, "previewer_checkpoint_path", None):
            problems.append("--sample_prompts needs --previewer_checkpoint_path for Stable Cascade training (Stability's "
                            "previewer.safetensors turns the stage C latents into the sample image, as the "
                            "stable-cascade branch); full images: stable_cascade_gen_img.py --decoder on the saved files")  # fmt: skip
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for Stable Cascade (as the stable-cascade branch); "
                            "drop the flag")  # fmt: skip
        if problems:
            raise ConfigError(problems)
        return from_namespace(cls, args)

    def prompt_identity(self) -> str:
        return identity_of((("encoder", "clip_bigG_last"),))

    def metadata(self) -> dict[str, Any]:
        return {}

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name != FAMILY_NAME:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; the Stable Cascade scripts train "
                    "a stage C prior"]  # fmt: skip
        return []


def stage_c_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The branch's ``--stage_c_checkpoint_path`` as a second name of ``--pretrained_model_name_or_path`` (one flag,
    one value; a config file writes it as ``pretrained_model_name_or_path``)."""
    action = parser._option_string_actions["--pretrained_model_name_or_path"]
    if "--stage_c_checkpoint_path" not in parser._option_string_actions:
        action.option_strings.append("--stage_c_checkpoint_path")
        parser._option_string_actions["--stage_c_checkpoint_path"] = action
    return parser
