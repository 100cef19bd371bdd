"""Which samples form which batch in which epoch: a pure function of (seed, epoch), sharded per process.

As sd-scripts (``library/train_util.py: BaseDataset.make_buckets / shuffle_buckets``): every (image x repeat) goes
into the bucket of its resolution, each bucket is shuffled and cut into batches of ``batch_size`` (the last one may be
smaller), and all batches of all datasets are shuffled together every epoch. With several training resolutions, each
sample draws its resolution per epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .seeding import rng_for

if TYPE_CHECKING:
    from .dataset_plan import DatasetPlan

Size = tuple[int, int]


@dataclass(frozen=True)
class BatchSpec:
    """One batch: dataset index, resolution index, bucket ``(width, height)`` and its (record, repeat) samples."""

    dataset: int
    resolution: int
    bucket: Size
    samples: tuple[tuple[int, int], ...]


def draw_resolution(seed: int, epoch: int, dataset: int, record: int, repeat: int, count: int) -> int:
    """The training resolution (index) of one sample in one epoch; always 0 with a single resolution."""
    return 0 if count == 1 else rng_for(seed, epoch, "resolution", dataset, record, repeat).randrange(count)


def _groups(plan: DatasetPlan, d: int, seed: int, epoch: int) -> dict[tuple[int, Size], list[tuple[int, int]]]:
    groups: dict[tuple[int, Size], list[tuple[int, int]]] = {}
    count = len(plan.config.resolutions)
    for i, record in enumerate(plan.records):
        for r in range(record.num_repeats):
            k = draw_resolution(seed, epoch, d, i, r, count)
            groups.setdefault((k, plan.assignments[k][i].bucket), []).append((i, r))
    return groups


def epoch_batches(datasets: Sequence[DatasetPlan], seed: int, epoch: int) -> list[BatchSpec]:
    """All batches of one epoch, in training order (the same for every process; shard with ``shard``)."""
    batches = []
    for d, plan in enumerate(datasets):
        size = plan.config.batch_size
        for (k, bucket), samples in sorted(_groups(plan, d, seed, epoch).items()):
            rng_for(seed, epoch, "bucket", d, k, bucket).shuffle(samples)
            for start in range(0, len(samples), size):
                batches.append(BatchSpec(d, k, bucket, tuple(samples[start : start + size])))
    rng_for(seed, epoch, "order").shuffle(batches)
    return batches


def per_process(total: int, world_size: int) -> int:
    """Batches each process runs per epoch: ``ceil(total / world_size)`` (short ranks repeat early batches)."""
    return math.ceil(total / world_size)


def shard(batches: list[BatchSpec], rank: int, world_size: int) -> list[BatchSpec]:
    """This process's batches: every ``world_size``-th, the list padded by wrapping around so that every process
    runs the same number of steps (as accelerate's ``even_batches``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if not batches:
        return []
    n = per_process(len(batches), world_size) * world_size
    padded = [batches[i % len(batches)] for i in range(n)]
    return padded[rank::world_size]
