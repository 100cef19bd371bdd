"""Optimizer steps inside the backward pass (``--fused_backward_pass``, ``--fused_optimizer_groups``).

Each trained parameter gets a post-accumulate-grad hook. When every parameter of a chunk has its gradient, the
optimizer steps that chunk alone (its param groups temporarily narrowed to the chunk) and the chunk's gradients are
freed at once, so the gradients of the whole model never sit in memory together:

* ``--fused_backward_pass``: one chunk per parameter (sd-scripts: Adafactor only);
* ``--fused_optimizer_groups N``: N chunks of about equal size, any per-parameter optimizer;
* ``--blockwise_fused_optimizers`` (flux_train.py): one chunk per transformer block and one for every other weight
  (:func:`block_chunks`), sd-scripts' one optimizer per block: with a per-parameter optimizer, stepping one
  optimizer narrowed to a block is the same update as a separate optimizer over that block.

For optimizers whose update of a parameter depends only on that parameter (Adafactor, AdamW, Lion, SGD...) the
result equals the ordinary step. ``--max_grad_norm`` then clips each parameter's gradient on its own (as
sd-scripts' per-parameter hooks do, for both flags), not the global norm. Parameters a chunk waits for but that got no gradient this step are stepped by the loop's ordinary
``optimizer.step()`` afterwards (it skips parameters whose gradient was already used and freed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def chunk_parameters(params: Sequence[nn.Parameter], groups: int | None) -> list[list[nn.Parameter]]:
    """One chunk per parameter (``groups`` None) or ``groups`` chunks of about equal element counts, in order."""
    if not groups:
        return [[p] for p in params]
    total = sum(p.numel() for p in params)
    chunks: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if size >= total * len(chunks) / groups and len(chunks) < groups:
            chunks.append([])
        chunks[-1].append(p)
        size += p.numel()
    return [c for c in chunks if c]


def block_chunks(
    params: Sequence[nn.Parameter], block_lists: Sequence[Sequence[nn.Module]]
) -> list[list[nn.Parameter]]:
    """One chunk per block of ``block_lists`` (its parameters among ``params``), then one chunk of the remaining
    ``params`` (embedders, norms, output layer); empty chunks are left out. sd-scripts' flux_train.py
    ``--blockwise_fused_optimizers`` groups: ``(double, i)``, ``(single, i)`` and ``other``."""
    wanted = {id(p) for p in params}
    chunks, taken = [], set()
    for blocks in block_lists:
        for block in blocks:
            chunk = [p for p in block.parameters() if id(p) in wanted and id(p) not in taken]
            taken |= {id(p) for p in chunk}
            chunks.append(chunk)
    chunks.append([p for p in params if id(p) not in taken])
    return [c for c in chunks if c]


class FusedStep:
    """Hooks that step ``optimizer`` chunk by chunk during backward (module docstring)."""

    def __init__(self, optimizer: Any, chunks: list[list[nn.Parameter]], max_grad_norm: float = 0.0):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
        self.chunks, self.max_grad_norm = chunks, max_grad_norm
        self.ready = [0] * len(chunks)
        self.handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, chunk in enumerate(chunks) for p in chunk
        ]

    def _hook(self, index: int):
        def hook(param: nn.Parameter) -> None:
            self.ready[index] += 1
            if self.ready[index] == len(self.chunks[index]):
                self.step_chunk(self.chunks[index])

        return hook

    @torch.no_grad()
    def step_chunk(self, params: list[nn.Parameter]) -> None:
        if self.max_grad_norm:
            for p in params:  # one norm per parameter, not the chunk's joint norm
                torch.nn.utils.clip_grad_norm_(p, self.max_grad_norm)
        for p in params:  # state loaded on another device (a resumed run whose weight sat on the host): to the weight's
            state = self.optimizer.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != p.device:
                    state[k] = v.to(p.device)
        ids = {id(p) for p in params}
        saved = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in ids]
        try:
            self.optimizer.step()
        finally:
            for group, old in zip(self.optimizer.param_groups, saved):
                group["params"] = old
        for p in params:
            p.grad = None

    def reset(self) -> None:
        """After each optimizer step: chunks that did not complete (some parameter got no gradient) start over."""
        self.ready = [0] * len(self.chunks)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
