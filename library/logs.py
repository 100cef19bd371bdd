"""The console and the trackers: log lines, progress bars, error lines, TensorBoard / wandb runs.

The console and the trackers: the libraries' own bars and notices are off during a run (on with
``--console_log_level DEBUG``), log lines are written above the progress bar (never glued onto it), only the main
process logs under ``accelerate launch``, and each run logs to its own TensorBoard run folder (a resumed run
continues its run's step axis). The console-logging and tracker flags are defined here too, with their reader
:class:`TrackerConfig`.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.config import from_namespace
from library.problems import ConfigError

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


# ----------------------------------------------------------------------------------------------------- trackers
def tracker_run(logging_dir: str | None, log_prefix: str | None, resume: str | None) -> tuple[str, int | None]:
    """``(run folder name, purge step)`` of this run's logs under ``--logging_dir``.

    A new run gets ``<log_prefix><YYYYmmddHHMMSS>`` (sd-scripts' layout: ``logging_dir/<run>/<tracker name>``).
    A resumed run reuses the run folder recorded in its state and purges the events from the state's next step
    on (TensorBoard's ``purge_step``), so steps logged after the state by the interrupted run are not drawn twice.
    """
    if resume:
        from library.run.resume import read_counters

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


def add_tracker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trackers")
    g.add_argument("--logging_dir", type=str, default=None, help="TensorBoard log folder")
    g.add_argument("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"])
    g.add_argument("--log_prefix", type=str, default=None, help="prefix of the run's log folder")
    g.add_argument("--log_tracker_name", type=str, default=None)
    g.add_argument("--log_tracker_config", type=str, default=None, help="TOML of per-tracker init kwargs")
    g.add_argument("--wandb_run_name", type=str, default=None)
    g.add_argument("--wandb_api_key", type=str, default=None)
    g.add_argument("--log_config", action="store_true", help="log the (sanitised) arguments to the trackers")


@dataclass(frozen=True)
class TrackerConfig:
    logging_dir: str | None = None
    log_with: str | None = None
    log_prefix: str | None = None
    log_tracker_name: str | None = None
    log_tracker_config: str | None = None
    wandb_run_name: str | None = None
    wandb_api_key: str | None = None
    log_config: bool = False

    @property
    def trackers(self) -> list[str]:
        if self.log_with == "all":
            return ["tensorboard", "wandb"]
        if self.log_with:
            return [self.log_with]
        return ["tensorboard"] if self.logging_dir else []

    def login(self) -> None:
        """``--wandb_api_key``: log in to wandb before its run starts (as sd-scripts), when wandb is used."""
        if not self.wandb_api_key:
            return
        if "wandb" not in self.trackers:
            logger.warning("--wandb_api_key is not used: wandb logging is off (add --log_with wandb or all)")
            return
        import wandb

        wandb.login(key=self.wandb_api_key)

    def unused(self) -> list[str]:
        """Notes on tracker flags that are set but have nothing to act on (sd-scripts ignores them silently)."""
        names = ("log_prefix", "log_tracker_name", "log_tracker_config", "log_config")
        out = []
        if not self.trackers:
            out += [f"--{n} is not used: no tracker logs this run (add --logging_dir or --log_with)"
                    for n in names if getattr(self, n)]  # fmt: skip
        if self.wandb_run_name and "wandb" not in self.trackers:
            out.append("--wandb_run_name is not used: wandb logging is off (add --log_with wandb or all)")
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrackerConfig:
        """Read the flags of :func:`add_tracker_args`; flags with nothing to act on are noted in the log."""
        cfg = from_namespace(cls, args)
        problems = cfg.problems()
        if problems:
            raise ConfigError(problems)
        for note in cfg.unused():
            logger.warning(note)
        return cfg

    def problems(self) -> list[str]:
        """The wandb package must be installed when wandb logging is asked for (found before training)."""
        import importlib.util

        if "wandb" in self.trackers and importlib.util.find_spec("wandb") is None:
            return [f"--log_with {self.log_with} needs the wandb package: pip install wandb (or sdtrain[wandb])"]
        return []
