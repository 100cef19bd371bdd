"""A family's full fine-tuning rules (``ModelFamily.full_training``): its own flags, which parts train at which
learning rates, what stays frozen, how the trained model is written.

The run layer's ``ModelTrainable`` (library/run/model_trainable.py) is the same for every family; it asks the
rules read for the run (:class:`TrainingRules`, from ``family.full_training.read(args, ...)``) and never the
family's name. A family whose full fine-tuning needs nothing of its own uses :class:`PlainFullTraining`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from library.cli.problems import ConfigError

if TYPE_CHECKING:
    from .base import Parts


class FamilyWriter(Protocol):
    """The family a rule's ``save`` writes with (its ``ModelFamily.save``; the protocol module imports this one, so
    the family is typed by what is asked of it here)."""

    def save(self, parts: Parts, path: str | Path, **options: Any) -> Path: ...


@runtime_checkable
class TrainingRules(Protocol):
    """What one full fine-tuning run of a family trains and writes (frozen, typed; read by
    :meth:`FullTraining.read`)."""

    text_encoder_lrs: tuple[float | None, ...] | None
    """Per text encoder (in ``Parts.text_encoders`` order) its learning rate (None: ``--learning_rate``; 0: it stays
    frozen); None: no text encoder trains."""
    train_denoiser: bool
    """False when only text encoders train (``--learning_rate 0`` where the family's script reads it so)."""

    def freeze(self, denoiser: nn.Module) -> None:
        """``requires_grad_(False)`` on the denoiser parameters the flags keep frozen (blocks at lr 0, the last N
        parameters ...)."""
        ...

    def denoiser_groups(self, denoiser: nn.Module, lr: float) -> list[dict] | None:
        """The denoiser's optimizer groups when the flags split it (per-block learning rates), else None (one
        group at ``lr``)."""
        ...

    def save(self, family: FamilyWriter, parts: Parts, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        """Write the trained model at ``path`` (a single file by its suffix, else a diffusers folder), atomically."""
        ...


@runtime_checkable
class FullTraining(Protocol):
    """A family's full fine-tuning flags and their reader."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        """The family's own full-training flags (sd-scripts' names, types and defaults), in a group of their own."""
        ...

    def prepare_args(self, args: argparse.Namespace) -> None:
        """Put deprecated or implied flags in their current form (e.g. a flag that turns a cache on), before any
        group is read."""
        ...

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> TrainingRules:
        """The run's rules from the flags (``train_text_encoder``: whether the script's method trains the text
        encoders); ``ConfigError`` listing every problem."""
        ...


@dataclass(frozen=True)
class PlainRules:
    """Rules with nothing of a family's own: the given encoders at their learning rates, the whole denoiser at
    ``--learning_rate``, the family's own file."""

    text_encoder_lrs: tuple[float | None, ...] | None = None
    train_denoiser: bool = True

    def freeze(self, denoiser: nn.Module) -> None:
        return None

    def denoiser_groups(self, denoiser: nn.Module, lr: float) -> list[dict] | None:
        return None

    def save(self, family: FamilyWriter, parts: Parts, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        family.save(parts, path, dtype=dtype, metadata=metadata, safetensors=safetensors)


class PlainFullTraining:
    """Full fine-tuning with no flags of the family's own (the text encoders, when the method trains them, at
    ``--learning_rate``)."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        return None

    def prepare_args(self, args: argparse.Namespace) -> None:
        return None

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> PlainRules:
        return PlainRules(text_encoder_lrs=(None,) if train_text_encoder else None)


def lr_problems(lrs: tuple[float | None, ...]) -> list[str]:
    """Text-encoder learning rates must be >= 0 (0: that encoder stays frozen)."""
    given = [lr for lr in lrs if lr is not None]
    if any(lr < 0 for lr in given):
        return [f"text-encoder learning rates must be >= 0, got {given}"]
    return []


def text_cache_problems(args: argparse.Namespace, trains_text_encoder: bool) -> list[str]:
    """Cached text-encoder outputs while a text encoder trains (refused: its outputs change every step)."""
    if trains_text_encoder and args.cache_text_encoder_outputs:
        return ["--cache_text_encoder_outputs cannot be used while training the text encoder "
                "(drop --train_text_encoder, or set --stop_text_encoder_training -1 in train_db.py)"]  # fmt: skip
    return []


def raise_if(problems: list[str]) -> None:
    """``ConfigError`` listing ``problems`` when there are any."""
    if problems:
        raise ConfigError(problems)
