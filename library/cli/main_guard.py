"""Every command line's exit status: input errors as one ``error:`` line (status 2), a stopped run 1, Ctrl-C 130."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def main_guard(func: Callable[[], Any]) -> int:
    """The exit status of ``func()`` (an entry script's ``run(argv)``) run as a command line; every entry script's
    ``main(argv)`` is this. Problems with the user's input (``ValueError``, ``ConfigError``) and with the files and
    disks it names (``OSError``: no such file, no permission, disk full while saving) print as one ``error:`` line
    and give status 2; a run that stopped early (a training ``Result`` that failed or was interrupted, a check that
    returned False) gives 1; Ctrl-C gives 130 without a traceback. ``--plan_memory`` plans the command instead of
    running it (library/cli/plan_flags.py) and gives 0. Anything else is a bug and propagates with its
    traceback. ``--help`` exits 0 through argparse's ``SystemExit``."""
    from library.cli.console import library_output
    from library.cli.plan_flags import PlanRequested, run_planner

    library_output(False)  # the libraries' bars and notices (as in a training run); our bars and messages stay
    try:
        try:
            result = func()
        except PlanRequested:  # --plan_memory: the same command, planned (library/measure/plan.py)
            run_planner(func)
            return 0
    except (ValueError, OSError) as e:
        from library.cli.console import print_error

        print_error(user_message(e))
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    stopped = getattr(result, "failed", None) or getattr(result, "interrupted", False)
    return 1 if result is False or stopped else 0


def user_message(error: BaseException) -> str:
    """The text of an input error; an ``OSError`` without a file name in its text gets it (``[Errno 13] Permission
    denied: 'x'`` becomes ``x: permission denied``)."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror[0].lower()}{error.strerror[1:]}"
    return str(error)
