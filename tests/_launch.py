"""The ``accelerate launch`` command line of the two-process tests (gloo on the CPU).

Each launch gets a port of its own: the test suite runs in parallel workers (pytest-xdist), and two launches on
accelerate's default port 29500 at once would join each other's process group.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(*, quiet: bool = False) -> list[str]:
    """``accelerate launch --multi_gpu --num_processes 2`` on one machine, fp32, no dynamo, its own port."""
    accelerate = Path(sys.executable).with_name("accelerate")
    return [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
            *(["--quiet"] if quiet else [])]  # fmt: skip


# For a wrapper script that runs several trainings one after another in the launched processes: accelerate's
# ``end_training`` destroys the process group, and a launched process cannot open it a second time (the launcher's
# rendezvous is over), so each run's end keeps it for the next one (trackers still finish).
KEEP_PROCESS_GROUP = """
from accelerate import Accelerator
Accelerator.end_training = lambda self: [tracker.finish() for tracker in self.trackers]
"""
