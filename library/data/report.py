"""The bucket report: what every bucket holds, and the images a batch never sees.

The bucket report: per bucket its size, images, samples, batches per epoch, and every image that can never fill
a batch or is never used, printed before training and saved as text or JSON.

Users of every trainer complain that images vanish silently (a bucket with fewer samples than the batch size, unused
regularisation images, uneven batches across GPUs); this report names them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from library.cli.problems import first

from .batching import epoch_batches, per_process
from .resolution import format_size

if TYPE_CHECKING:
    from .dataset_plan import DatasetPlan


@dataclass(frozen=True)
class BucketRow:
    dataset: int
    resolution: str  # the training resolution this bucket belongs to, "WxH"
    bucket: str  # "WxH"
    images: int
    samples: int  # images x repeats (before the per-epoch draw when there are several resolutions)
    batches: int  # ceil(samples / batch_size)
    last_batch: int  # size of the last batch (== batch_size when the bucket divides evenly)


@dataclass
class BucketReport:
    batch_size: list[int]
    grad_accum: int
    num_processes: int
    rows: list[BucketRow]
    train_images: int
    reg_images: int
    samples_per_epoch: int
    batches_per_epoch: int  # epoch 0, all processes together
    batches_per_process: int
    steps_per_epoch: int  # optimizer steps per epoch per process
    never_full: list[str] = field(default_factory=list)  # images whose bucket never fills a batch
    unused: list[str] = field(default_factory=list)  # images never trained
    warnings: list[str] = field(default_factory=list)
    train_with_repeats: int = 0  # sd-scripts' num_train_images / num_reg_images: images x their configured
    reg_with_repeats: int = 0  # num_repeats (regularisation images counted as listed, before balancing)
    conditioning_images: int = 0  # training images paired with a conditioning image (ControlNet trainers)

    def to_text(self) -> str:
        head = (
            f"bucket report: {self.train_images} training + {self.reg_images} regularisation images, "
            f"{self.samples_per_epoch} samples per epoch, batch size {'/'.join(map(str, self.batch_size))} x "
            f"{self.grad_accum} accumulation x {self.num_processes} processes"
        )
        if self.conditioning_images:
            head += f", {self.conditioning_images} paired with conditioning images"
        lines = [head, f"{'ds':>3} {'resolution':>11} {'bucket':>11} {'images':>7} {'samples':>8} {'batches':>8} last"]
        for r in self.rows:
            lines.append(
                f"{r.dataset:>3} {r.resolution:>11} {r.bucket:>11} {r.images:>7} {r.samples:>8} {r.batches:>8} "
                f"{r.last_batch:>4}"
            )
        lines.append(
            f"batches per epoch: {self.batches_per_epoch} ({self.batches_per_process} per process), "
            f"optimizer steps per epoch: {self.steps_per_epoch}"
        )
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str) -> None:
        """Write the report atomically: JSON when ``path`` ends in .json, else the text plus the full image lists."""
        if path.lower().endswith(".json"):
            text = json.dumps(self.to_json(), indent=2)
        else:
            lists = [("never fill a batch", self.never_full), ("never used", self.unused)]
            text = self.to_text() + "".join(f"\n\nimages that {t}:\n" + "\n".join(p) for t, p in lists if p)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".report-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)


def _rows(d: int, plan: DatasetPlan) -> tuple[list[BucketRow], list[str]]:
    rows, never_full = [], []
    size = plan.config.batch_size
    for k, res in enumerate(plan.config.resolutions):
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, a in enumerate(plan.assignments[k]):
            buckets.setdefault(a.bucket, []).append(i)
        for bucket, members in sorted(buckets.items()):
            samples = sum(plan.records[i].num_repeats for i in members)
            batches = math.ceil(samples / size)
            last = samples - (batches - 1) * size
            rows.append(BucketRow(d, format_size(res), format_size(bucket), len(members), samples, batches, last))
            if samples < size:
                never_full += [plan.records[i].path for i in members]
    return rows, never_full


def _named(paths: list[str], shown: int = 3) -> str:
    """The first few file names, then how many more."""
    return first([os.path.basename(p) for p in paths], shown, ", ", " and {n} more")


def _warnings(report: BucketReport, multires: bool, saved_to: str | None = None) -> list[str]:
    out = []
    listed = f"; the full list is in {saved_to}" if saved_to else ""
    if report.never_full:
        out.append(
            f"{len(report.never_full)} images sit in buckets with fewer samples than the batch size, so they never "
            f"fill a batch and always train in smaller batches ({_named(report.never_full)}{listed}); lower "
            "--train_batch_size, add images of that shape, or change the bucket settings"
        )
    if report.unused:
        out.append(f"{len(report.unused)} images are never used in training ({_named(report.unused)}{listed})")
    extra = report.batches_per_process * report.num_processes - report.batches_per_epoch
    if extra:
        out.append(
            f"{report.batches_per_epoch} batches do not split evenly over {report.num_processes} processes: "
            f"{extra} batches per epoch are repeated so every process runs {report.batches_per_process}"
        )
    rest = report.batches_per_process % report.grad_accum
    if rest:
        out.append(
            f"the last optimizer step of each epoch accumulates only {rest} of {report.grad_accum} batches "
            f"({report.batches_per_process} batches per process)"
        )
    if multires:
        out.append(
            "several training resolutions: each sample draws one per epoch, so bucket counts are for all "
            "samples at that resolution and batches per epoch vary slightly (epoch 0 shown)"
        )
    return out


def build_report(
    datasets: Sequence[DatasetPlan], *, grad_accum: int, num_processes: int, seed: int = 0, saved_to: str | None = None
) -> BucketReport:
    """Count buckets, batches and steps for epoch 0 and list images that never fill a batch or never train."""
    rows, never_full, unused = [], [], []
    for d, plan in enumerate(datasets):
        r, n = _rows(d, plan)
        rows += r
        never_full += n
        unused += list(plan.unused)
    total = len(epoch_batches(datasets, seed, 0))
    per = per_process(total, num_processes) if total else 0
    report = BucketReport(
        batch_size=[p.config.batch_size for p in datasets],
        grad_accum=grad_accum,
        num_processes=num_processes,
        rows=rows,
        train_images=sum(1 for p in datasets for r in p.records if not r.is_reg),
        reg_images=sum(1 for p in datasets for r in p.records if r.is_reg),
        samples_per_epoch=sum(r.num_repeats for p in datasets for r in p.records),
        batches_per_epoch=total,
        batches_per_process=per,
        steps_per_epoch=math.ceil(per / grad_accum),
        never_full=never_full,
        unused=unused,
        train_with_repeats=sum(r.num_repeats for p in datasets for r in p.records if not r.is_reg),
        reg_with_repeats=sum(r.num_repeats for p in datasets for r in p.listed_reg),
        conditioning_images=sum(1 for p in datasets for r in p.records if r.conditioning_path),
    )
    report.warnings = _warnings(report, any(len(p.config.resolutions) > 1 for p in datasets), saved_to)
    return report
