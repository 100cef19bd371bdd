"""Run train_network.run in this process and call back at the start and end of every training step.

Used by bench_memory.py (tensor memory per step) and bench_train.py (time, CUDA memory and FLOPs per step). A step
starts when the loop asks for its first batch loss and ends at ``Trainer.step_done`` (after the optimizer step).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Hook = Callable[[int], None]


def run_training(argv: Sequence[str], family: str, on_start: Hook | None = None, on_end: Hook | None = None) -> list:
    """Train with ``argv`` (``family`` "sdxl" uses the SDXL script's families); ``on_start(i)`` / ``on_end(i)`` are
    called around step ``i`` (0-based). Returns the (start, end) wall times of the steps."""
    sys.path.insert(0, str(ROOT))
    import train_network
    from library.families import trained_together
    from library.run import loop
    from library.run.trainer import Trainer

    times: list[list[float]] = []
    original_loss, original_done = loop.batch_loss, Trainer.step_done

    def batch_loss(*a, **kw):
        if not times or len(times[-1]) == 2:  # the first batch of a step (more come with accumulation)
            if on_start is not None:
                on_start(len(times))
            times.append([time.time()])
        return original_loss(*a, **kw)

    def step_done(self, loss):
        if on_end is not None:
            on_end(len(times) - 1)
        times[-1].append(time.time())
        original_done(self, loss)

    loop.batch_loss, Trainer.step_done = batch_loss, step_done
    try:
        train_network.run(list(argv), family_names=trained_together(family))
    finally:
        loop.batch_loss, Trainer.step_done = original_loss, original_done
    return [tuple(t) for t in times]
