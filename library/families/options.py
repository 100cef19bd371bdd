"""A family's own flags, read once: the :class:`FamilyOptions` protocol, :class:`NoOptions` for families without
flags of their own, and the helpers their ``add_args`` share.

Every entry point that loads a model asks the family for its flags instead of listing them: a training script adds
``family.options.add_args(parser, training=True)`` (the load flags, the objective's flags and the training-only
ones), gen_img.py and the caching tools ``training=False`` (the load flags) for every registered family. The
reader ``family.options.from_args(args, training=...)`` gives one frozen, typed object: ``family.load(...,
options=)`` takes it and keeps it as ``Parts.options`` (the loaded model's settings: prompt lengths, masks,
guidance, dropouts ...), the family's prompts, objective and files read it there, and the run layer asks it for
``problems`` (against the weights), ``metadata`` (the ``ss_*`` keys of trained files), ``prompt_identity`` (the
settings that change text-encoder outputs, part of the text-cache key) and ``text_encoder_batch_size``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .base import FamilyOptions, FamilySpec


@dataclass(frozen=True)
class NoOptions:
    """The options of a family whose every flag is a shared one (SD 1.x / 2.x / SDXL)."""

    text_encoder_batch_size: int | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> NoOptions:
        return cls()

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        return []

    def metadata(self) -> dict[str, Any]:
        return {}

    def prompt_identity(self) -> str:
        return ""


def option_actions(options: type[FamilyOptions], training: bool) -> list[argparse.Action]:
    """The argparse actions of the flags ``options.add_args`` adds (on a scratch parser), in order."""
    parser = argparse.ArgumentParser(add_help=False)
    options.add_args(parser, training=training)
    return [a for a in parser._actions if a.option_strings]


def add_once(group: Any, parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """``group.add_argument(flag, **kwargs)`` unless ``parser`` has the flag already (another family's load flag of
    the same name and meaning, e.g. ``--t5xxl``, added by a tool that takes every family's flags)."""
    if flag not in parser._option_string_actions:
        group.add_argument(flag, **kwargs)


def mark_no_effect(parser: argparse.ArgumentParser, reasons: dict[str, str]) -> None:
    """Mark shared flags that do nothing for this family (flag -> why): ``library.cli.parse.reset_no_effect_flags``
    says so once in the log and resets them."""
    actions = parser._option_string_actions
    for flag, reason in reasons.items():
        if flag in actions:
            actions[flag].no_effect_reason = reason


def identity_of(settings: Iterable[tuple[str, Any]]) -> str:
    """``"/name=value"`` per setting, sorted by name (a text-encoder-output cache key part)."""
    return "".join(f"/{k}={v}" for k, v in sorted(settings))
