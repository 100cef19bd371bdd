"""The console: log lines, progress bars, error lines.

The libraries' own bars and notices are off during a run (on with
``--console_log_level DEBUG``), log lines are written above the progress bar (never glued onto it), only the main
process logs under ``accelerate launch``. The console-logging flags (sd-scripts' ``--console_log_*``) are defined
here too, with their reader :func:`console_logging`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

logger = logging.getLogger("sdtrain")


class _DropNotices(logging.Filter):
    """Drops the library notices that ask nothing of a user (for the environments where a library's own switch is
    left to the user: an explicit TRANSFORMERS_VERBOSITY / DIFFUSERS_VERBOSITY; accelerate has no switch)."""

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
# what each library's switches were before a run turned them off: restored by --console_log_level DEBUG
_SAVED: dict[str, Any] = {}


def library_output(show: bool) -> None:
    """The progress bars and notices of the libraries sdtrain uses ("Loading weights", "Writing model shards",
    "Loading pipeline components", bitsandbytes' kernel advice, transformers' torchvision notice): off for a run, so
    that a user sees only our bars and our messages; ``show`` (``--console_log_level DEBUG``) puts back what they
    were. Each library's own switch is used (transformers' and diffusers' verbosity and progress bars,
    huggingface_hub's progress bars, the level of the ``bitsandbytes`` logger); their errors always show. A switch
    the user set in the environment (TRANSFORMERS_VERBOSITY, DIFFUSERS_VERBOSITY, HF_HUB_DISABLE_PROGRESS_BARS) is
    left as set. Called by the run's logging setup (``runtime.console_logging``), never at import; imports
    transformers and diffusers (their ``utils`` only), after the ``bitsandbytes`` level is set, since diffusers
    imports bitsandbytes, which logs at import."""
    if show:
        _restore()
    else:
        _quiet(save=not _SAVED)  # a second run in the process keeps the first one's record of theirs


def _quiet(save: bool) -> None:
    bnb = logging.getLogger("bitsandbytes")
    if save:
        _SAVED["bitsandbytes"] = bnb.level
    bnb.setLevel(logging.ERROR)
    for name in _NOTICE_LOGGERS:
        logging.getLogger(name).addFilter(_DROP)  # once: a logger holds a filter once
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    for name, lib in (("transformers", transformers_logging), ("diffusers", diffusers_logging)):
        if save:
            _SAVED[name] = (lib.get_verbosity(), lib.is_progress_bar_enabled())
        if not os.environ.get(f"{name.upper()}_VERBOSITY"):
            lib.set_verbosity_error()
        lib.disable_progress_bar()
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is None:  # else hub's own switch warns and does nothing
        if save:
            _SAVED["huggingface_hub"] = hub_utils.are_progress_bars_disabled()
        hub_utils.disable_progress_bars()


def _restore() -> None:
    if not _SAVED:
        return
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    logging.getLogger("bitsandbytes").setLevel(_SAVED.pop("bitsandbytes"))
    for name in _NOTICE_LOGGERS:
        logging.getLogger(name).removeFilter(_DROP)
    for name, lib in (("transformers", transformers_logging), ("diffusers", diffusers_logging)):
        verbosity, bars = _SAVED.pop(name)
        lib.set_verbosity(verbosity)
        if bars:
            lib.enable_progress_bar()
    if not _SAVED.pop("huggingface_hub", True):
        hub_utils.enable_progress_bars()


def console_level_in(argv: list[str]) -> str | None:
    """The value of ``--console_log_level`` in a command line not parsed yet (for what runs before parsing)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--console_log_level="):
            return arg.split("=", 1)[1]
        if arg == "--console_log_level" and i + 1 < len(argv):
            return argv[i + 1]
    return None


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


def console_logging(level: str | None, file: str | None, simple: bool) -> None:
    """``--console_log_level`` / ``--console_log_file`` / ``--console_log_simple`` (sd-scripts' flags): one handler
    on the root logger, replaced (not added to) when a second run in the same process sets it up again. The
    libraries' own progress bars and notices are off unless the level is DEBUG (:func:`library.cli.console.library_output`).
    """
    import logging

    fmt = "%(message)s" if simple else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if not simple and not file:
        fmt = "%(levelname)s %(message)s"
    library_output(show=level == "DEBUG")

    handler = console_handler(file)  # the console: above the progress bar, INFO from the main process only
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_sdtrain", False)]:
        root.removeHandler(old)
    handler._sdtrain = True
    root.addHandler(handler)
    root.setLevel(getattr(logging, level or "INFO"))


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("console logging")
    g.add_argument(
        "--console_log_level",
        type=str,
        default=None,
        choices=["CRITICAL", "DEBUG", "ERROR", "INFO", "WARNING"],
        help="logging level (default INFO)",
    )
    g.add_argument("--console_log_file", type=str, default=None, help="log to this file instead of stderr")
    g.add_argument("--console_log_simple", action="store_true", help="plain log lines")
