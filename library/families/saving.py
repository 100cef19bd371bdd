"""Saving helpers every family uses: plain-JSON module configs, atomic folders, weight files and the ModelSpec
architecture names. Each family's own writer is in its folder (``sd/saving.py``, ``flux/saving.py``...)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from library.files.weights import save_state_dict


def clean_config(config: Mapping) -> dict:
    """A module config as plain JSON-able data (diffusers' private ``_*`` keys and volatile fields dropped)."""
    drop = {"transformers_version", "dtype", "torch_dtype", "architectures", "_name_or_path", "output_hidden_states"}
    return {k: copy.deepcopy(v) for k, v in dict(config).items() if not k.startswith("_") and k not in drop}


@contextlib.contextmanager
def atomic_dir(folder: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``folder``; on success it replaces ``folder`` (an old one is removed)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
        old = None
        if folder.exists():
            old = folder.with_name(f"{tmp.name}.old")
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _save_weights(state: Mapping[str, Tensor], path: Path, dtype: torch.dtype | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_state_dict(dict(state), path, {"format": "pt"}, dtype)


def with_kind(architecture: str, kind: str) -> str:
    """``modelspec.architecture`` for a checkpoint (``kind`` "") or an adapter ("lora", "textual-inversion",
    "control-net-lllite", "controlnet": sd-scripts' SDXL ControlNet suffix)."""
    kinds = ("", "lora", "textual-inversion", "control-net-lllite", "controlnet")
    if kind not in kinds:
        raise ValueError(f"modelspec kind {kind!r}: expected one of {', '.join(map(repr, kinds))}")
    return f"{architecture}/{kind}" if kind else architecture
