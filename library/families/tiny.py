"""Tiny models of any registered family, through the family (``ModelFamily.tiny``, see ``base.TinyModel``): each
family's tiny model lives in its folder (``sd/tiny.py``, ``flux/tiny.py``, ``sd3/tiny.py``...)."""

from __future__ import annotations

from pathlib import Path

from .registry import get_family


def tiny_model_folder(family: str, folder: str | Path, seed: int = 0) -> Path:
    """A tiny model of the registered family ``family`` written as a diffusers folder at ``folder`` (what ``--demo``
    trains on). ``ValueError`` for a family without a tiny model."""
    tiny = get_family(family).tiny
    if tiny is None:
        raise ValueError(f"the {family} family has no tiny model")
    return Path(tiny.write_folder(tiny.build(seed), folder))
