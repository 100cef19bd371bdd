"""Shared by the textual-inversion and pivotal-tuning tests: the example images with a new token in their captions."""

from __future__ import annotations

from pathlib import Path

from library.run.demo import make_example_dataset

TOKEN = "shapetok"


def token_dataset(folder: Path) -> Path:
    """The example images, captions "sks shape, ..." rewritten to "shapetok shape, ..." (a token not in CLIP's
    vocabulary)."""
    folder = make_example_dataset(folder)
    for txt in folder.rglob("*.txt"):
        txt.write_text(txt.read_text().replace("sks shape", f"{TOKEN} shape"))
    return folder
