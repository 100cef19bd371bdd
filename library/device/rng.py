"""Every random state a training step reads, captured and restored (exact resume, sampling rounds that leave
the training draws untouched)."""

from __future__ import annotations

import random

import torch


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every random state a training step reads: torch CPU/CUDA, Python's ``random`` and our named generators."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["generators"] = {name: g.get_state() for name, g in (generators or {}).items()}
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in (generators or {}).items():
        g.set_state(state["generators"][name])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
