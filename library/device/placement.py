"""Where modules and tensors live during a run: the device for what computes, the host for what waits.

On an 8-12 GB card the model does not fit next to everything else, so a run keeps on the device only what the
current phase computes with (library/run/setup.py): the VAE alone while latents are cached, the text encoders
alone while their outputs are cached, then the denoiser (and whatever the step still runs) for training; parts that
only sampling needs come in for a sampling round and leave after it (:func:`on_device`).

Copies from the host to a CUDA device are made without waiting for the device (:func:`to_device`): a plain
``tensor.to("cuda")`` from pageable memory waits until every queued kernel has finished, which stalls the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from library.families.base import module_device, stays_on_host


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def is_freed(module: nn.Module) -> bool:
    """A part whose weights were given back (library/run/setup.py ``release_unused_parts``): it stays where it is."""
    return _has_parameters(module) and module_device(module).type == "meta"


@contextlib.contextmanager
def on_device(modules: Iterable[nn.Module | None], device: torch.device | str) -> Iterator[None]:
    """Move the modules that are elsewhere to ``device`` for the block, and each back to where it was after it
    (also when the block raises). Modules already there, freed ones, ones kept on the host
    (``families.base.keep_on_host``: ``--text_encoder_cpu``) and ``None`` are left as they are."""
    device = torch.device(device)
    moved: list[tuple[nn.Module, torch.device]] = []
    for module in modules:
        if module is None or not _has_parameters(module) or is_freed(module) or stays_on_host(module):
            continue
        where = module_device(module)
        if where != device:
            module.to(device)
            moved.append((module, where))
    try:
        yield
    finally:
        for module, where in reversed(moved):
            module.to(where)


@contextlib.contextmanager
def on_device_when_used(
    modules: Iterable[nn.Module | None], device: torch.device | str
) -> Iterator[Callable[[], None]]:
    """:func:`on_device` entered at the first call of the function it yields (a caching step that finds every entry
    on disk never moves its encoder), left at the end of the block."""
    with contextlib.ExitStack() as stack:
        entered: list[bool] = []

        def use() -> None:
            if not entered:
                stack.enter_context(on_device(modules, device))
                entered.append(True)

        yield use


def to_device(tensor: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """``tensor.to(device, dtype)`` that does not wait for the device when the copy goes from the host to a GPU
    (the host side of such a copy is staged before the call returns, so the source may be freed or reused)."""
    device = torch.device(device)
    non_blocking = tensor.device.type == "cpu" and device.type == "cuda"
    return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking)
