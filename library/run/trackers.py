"""The trackers (TensorBoard / wandb): their flags, their reader :class:`TrackerConfig`, and each run's own log
folder (a resumed run continues its run's step axis)."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.cli.parse import from_namespace
from library.cli.problems import ConfigError

logger = logging.getLogger("sdtrain")


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
