"""The tiny Qwen-Image files the Qwen-Image tests share: written once per session from
``QWEN_IMAGE.tiny.build(seed=0)``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_files(tmp_path_factory) -> dict:
    """{"parts": the tiny model, "dit" (diffusers names), "text_encoder" (model.-prefixed, ComfyUI's layout), "vae"
    (ComfyUI names), "root": their folder}."""
    from library.families.qwen_image import QWEN_IMAGE

    root = tmp_path_factory.mktemp("qwen_image_tiny")
    parts = QWEN_IMAGE.tiny.build(seed=0)
    files = {k: str(v) for k, v in QWEN_IMAGE.tiny.write_files(parts, root, "tiny").items()}
    return {"parts": parts, "root": Path(root), **files}
