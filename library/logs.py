"""The console and the trackers: log lines, progress bars, error lines, TensorBoard / wandb runs.

The console and the trackers: third-party notices that tell a user nothing are silenced once, log lines are
written above the progress bar (never glued onto it), only the main process logs under ``accelerate launch``, and
each run logs to its own TensorBoard run folder (a resumed run continues its run's step axis).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any


class _DropNotices(logging.Filter):
    """Drops the library notices that ask nothing of a user."""

    NOTICES = (
        "requires torchvision (not installed)",  # transformers: image processors fall back to PIL (we use none)
        "AutoencoderKL that should be kept in float32",  # diffusers: the VAE's fp32-modules note when it is cast
        "were not passed to `accelerate launch`",  # accelerate: its defaults notice (when run in-process)
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(n in message for n in self.NOTICES)


_DROP = _DropNotices()
# the loggers that emit those notices (a filter on the emitting logger applies wherever the record goes)
_NOTICE_LOGGERS = ("transformers.utils.import_utils", "diffusers.models.modeling_utils", "accelerate.commands.launch")


def quiet_libraries() -> None:
    """Silence the notices of transformers / diffusers / accelerate that ask nothing of a user (every other warning
    still shows). Called once at start-up (``library/__init__.py``); imports none of those libraries."""
    for name in _NOTICE_LOGGERS:
        logger = logging.getLogger(name)
        if _DROP not in logger.filters:
            logger.addFilter(_DROP)


class TqdmHandler(logging.Handler):
    """A console handler that writes through ``tqdm.write``: a log line moves the progress bar down instead of
    being glued onto it. Without ``stream`` it writes to the ``sys.stderr`` of the moment (which a caller may have
    replaced since the handler was made)."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream or sys.stderr)
        except Exception:  # as logging.StreamHandler: a broken console never stops training
            self.handleError(record)


def close_progress_bars() -> None:
    """Close every open tqdm bar (each ends its line), so that an error printed next starts on a line of its own."""
    from tqdm import std
    from tqdm.auto import tqdm as auto_tqdm

    bars = set(getattr(std.tqdm, "_instances", ())) | set(getattr(auto_tqdm, "_instances", ()))
    for bar in list(bars):
        bar.close()


def print_error(message: object) -> None:
    """``error: <message>`` on stderr, on a line of its own (below any progress bar)."""
    import sys

    close_progress_bars()
    print(f"error: {message}", file=sys.stderr)


def is_main_process() -> bool:
    """True unless this is a secondary process of ``accelerate launch`` / torchrun (read before accelerate starts)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


class _MainProcessOnly(logging.Filter):
    """Under ``accelerate launch`` only rank 0 writes INFO lines; warnings and errors come from every process."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or is_main_process()


def console_handler(log_file: str | None) -> logging.Handler:
    """The handler for ``--console_log_file`` (a plain file) or the console (above the progress bar, main process
    only for INFO)."""
    handler = logging.FileHandler(log_file) if log_file else TqdmHandler()
    if not log_file:
        handler.addFilter(_MainProcessOnly())
    return handler


# ----------------------------------------------------------------------------------------------------- trackers
def tracker_run(logging_dir: str | None, log_prefix: str | None, resume: str | None) -> tuple[str, int | None]:
    """``(run folder name, purge step)`` of this run's logs under ``--logging_dir``.

    A new run gets ``<log_prefix><YYYYmmddHHMMSS>`` (sd-scripts' layout: ``logging_dir/<run>/<tracker name>``).
    A resumed run reuses the run folder recorded in its state and purges the events from the state's next step
    on (TensorBoard's ``purge_step``), so steps logged after the state by the interrupted run are not drawn twice.
    """
    if resume:
        from library.resume import read_counters

        counters = read_counters(Path(resume))
        if counters.get("log_run"):
            return str(counters["log_run"]), int(counters["step"]) + 1
    return (log_prefix or "") + _timestamp(), None


def _timestamp() -> str:
    return time.strftime("%Y%m%d%H%M%S", time.localtime())


def init_trackers(
    accelerator: Any, trackers: Any, resume: str | None, config: dict, init_kwargs: dict, name: str
) -> str:
    """Start accelerate's trackers (``name``: the tracker/project name, unless --log_tracker_name) in this run's
    folder (see :func:`tracker_run`); returns the run folder name."""
    run, purge_step = tracker_run(trackers.logging_dir, trackers.log_prefix, resume)
    if trackers.logging_dir:
        accelerator.project_configuration.logging_dir = str(Path(trackers.logging_dir) / run)
    if purge_step is not None and "tensorboard" in trackers.trackers:
        init_kwargs.setdefault("tensorboard", {}).setdefault("purge_step", purge_step)
    accelerator.init_trackers(name, config=config, init_kwargs=init_kwargs)
    return run
