"""The plan training reads (``build_datasets``): every dataset's plan with its bucket report.

``build_datasets``: plan the datasets (``dataset_plan.py``: records, regularisation balance, validation split,
buckets), make their bucket report (``report.py``), then log the warnings and print (and save) the report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .data_args import DataArgs
from .dataset_plan import DatasetPlan, DatasetPlans, plan_datasets
from .report import BucketReport, build_report

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Everything the loader needs; all per-step randomness derives from ``seed``."""

    datasets: tuple[DatasetPlan, ...]
    args: DataArgs
    seed: int
    grad_accum: int
    num_processes: int
    report: BucketReport
    warnings: tuple[str, ...]
    validation: Plan | None = None  # the held-out images (``--validation_split``), batched like training


def build_datasets(
    args: DataArgs,
    *,
    grad_accum: int = 1,
    num_processes: int = 1,
    seed: int = 0,
    size_multiple: int = 64,
    is_main_process: bool = True,
    validation_split: float = 0.0,
    validation_seed: int | None = None,
) -> Plan:
    """Validate and read the datasets (:func:`~library.data.dataset_plan.plan_datasets`, which raises one ValueError
    listing every problem); print (and save, with ``--bucket_report``) the bucket report.

    ``size_multiple``: image sides must be multiples of it (from the model family). Batch size comes from
    ``--train_batch_size`` or the dataset file. The main process prints the report to stdout and saves it; warnings
    are logged on every process. ``validation_split``: fraction of each subset's training images held out (see
    :func:`~library.data.dataset_plan.split_validation`) into ``plan.validation``; ``validation_seed`` defaults to
    ``seed``.
    """
    if grad_accum < 1 or num_processes < 1:
        raise ValueError(f"grad_accum ({grad_accum}) and num_processes ({num_processes}) must be >= 1")
    planned = plan_datasets(
        args, seed=seed, size_multiple=size_multiple, validation_split=validation_split, validation_seed=validation_seed
    )
    plan = _with_reports(planned, args, grad_accum, num_processes, seed, is_main_process)
    _announce(plan, is_main_process)
    return plan


def _with_reports(
    planned: DatasetPlans, args: DataArgs, grad_accum: int, num_processes: int, seed: int, is_main_process: bool
) -> Plan:
    """The plan with the bucket report of its training datasets and, for held-out images, its validation plan."""
    report = build_report(planned.train, grad_accum=grad_accum, num_processes=num_processes, seed=seed,
                          saved_to=args.bucket_report if is_main_process else None)  # fmt: skip
    validation = None
    if planned.held_out:
        val_report = build_report(planned.held_out, grad_accum=1, num_processes=num_processes, seed=seed)
        validation = Plan(planned.held_out, args, seed, 1, num_processes, val_report, ())
    return Plan(planned.train, args, seed, grad_accum, num_processes, report, planned.warnings, validation)


def _announce(plan: Plan, is_main_process: bool) -> None:
    """Log the plan's and its report's warnings (every process); print and save the report (main process)."""
    for w in plan.warnings:
        logger.warning(w)
    for w in plan.report.warnings:
        logger.warning("!!! %s", w)
    if is_main_process:
        print(plan.report.to_text(), flush=True)
        if plan.args.bucket_report:
            plan.report.save(plan.args.bucket_report)
        if plan.validation is not None:
            v = plan.validation.report
            print(f"validation: {v.train_images} images held out ({v.batches_per_epoch} batches)", flush=True)
