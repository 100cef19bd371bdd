"""The tiny Anima files the Anima tests share: written once per session from ``ANIMA.tiny.build(seed=0)``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def anima_files(tmp_path_factory) -> dict:
    """{"parts": the tiny model, "dit" (net. + adapter), "qwen3" (model.-prefixed file), "vae" (ComfyUI names),
    "root": their folder}."""
    from library.families.anima import ANIMA

    root = tmp_path_factory.mktemp("anima_tiny")
    parts = ANIMA.tiny.build(seed=0)
    files = {k: str(v) for k, v in ANIMA.tiny.write_files(parts, root, "tiny").items()}
    return {"parts": parts, "root": Path(root), **files}
