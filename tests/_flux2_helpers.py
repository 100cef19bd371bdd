"""The tiny FLUX.2 files the FLUX.2 tests share: written once per session from ``FLUX2.tiny.build(seed=0)``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def flux2_files(tmp_path_factory) -> dict:
    """{"parts": the tiny model, "dit" (BFL names), "text_encoder" (the first of a split Qwen3 pair), "vae" (BFL
    names), "root": their folder}."""
    from library.families.flux2 import FLUX2

    root = tmp_path_factory.mktemp("flux2_tiny")
    parts = FLUX2.tiny.build(seed=0)
    files = {k: str(v) for k, v in FLUX2.tiny.write_files(parts, root, "tiny").items()}
    return {"parts": parts, "root": Path(root), **files}
