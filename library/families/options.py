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


def musubi_caching(args: list[str]) -> list[str]:
    """musubi-tuner's caching behaviour on our flags, for its training scripts: it always trains from cached latents
    and text-encoder outputs (its separate ``*_cache_*.py`` steps), so ``args`` gets both caches unless it says
    otherwise (``--cache_latents*`` / ``--cache_text_encoder_outputs*`` given): with musubi-tuner's dataset config, on
    disk in its ``cache_directory`` (``--cache_dir``, unless given) else next to the images, where the caching scripts
    write them; with sd-scripts' dataset config, in memory."""
    from library.cli.parse import peek
    from library.data import musubi_dataset

    args = list(args)
    config = peek(args, "dataset_config")
    on_disk = "_to_disk" if musubi_dataset.read_musubi(config) is not None else ""
    folder = musubi_dataset.cache_directory(config)
    if folder is not None and peek(args, "cache_dir") is None:
        args += ["--cache_dir", folder]
    if not any(a.startswith("--cache_latents") for a in args):
        args.append("--cache_latents" + on_disk)
    if not any(a.startswith("--cache_text_encoder_outputs") for a in args):
        args.append("--cache_text_encoder_outputs" + on_disk)
    return args
