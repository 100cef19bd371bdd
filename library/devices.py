"""Where modules and tensors live during a run: the device for what computes, the host for what waits.

On an 8-12 GB card the model does not fit next to everything else, so a run keeps on the device only what the
current phase computes with (library/train_setup.py): the VAE alone while latents are cached, the text encoders
alone while their outputs are cached, then the denoiser (and whatever the step still runs) for training; parts that
only sampling needs come in for a sampling round and leave after it (:func:`on_device`).

Copies from the host to a CUDA device are made without waiting for the device (:func:`to_device`): a plain
``tensor.to("cuda")`` from pageable memory waits until every queued kernel has finished, which stalls the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn


def module_device(module: nn.Module) -> torch.device | None:
    """The device of the module's first parameter (None for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return None


def is_freed(module: nn.Module) -> bool:
    """A part whose weights were given back (library/train_setup.py ``release_unused_parts``): it stays where it is."""
    device = module_device(module)
    return device is not None and device.type == "meta"


@contextlib.contextmanager
def on_device(modules: Iterable[nn.Module | None], device: torch.device | str) -> Iterator[None]:
    """Move the modules that are elsewhere to ``device`` for the block, and each back to where it was after it
    (also when the block raises). Modules already there, freed ones and ``None`` are left as they are."""
    device = torch.device(device)
    moved: list[tuple[nn.Module, torch.device]] = []
    for module in modules:
        if module is None or is_freed(module):
            continue
        where = module_device(module)
        if where is not None and where != device:
            module.to(device)
            moved.append((module, where))
    try:
        yield
    finally:
        for module, where in reversed(moved):
            module.to(where)


def to_device(tensor: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """``tensor.to(device, dtype)`` that does not wait for the device when the copy goes from the host to a GPU
    (the host side of such a copy is staged before the call returns, so the source may be freed or reused)."""
    device = torch.device(device)
    non_blocking = tensor.device.type == "cpu" and device.type == "cuda"
    return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking)
