"""Problems with the user's input: collecting them, "did you mean" suggestions and the one message that lists them.

Every reader of user input (command line, ``--config_file``, dataset TOML, metadata JSON, network and optimizer
arguments, sample prompts, adapter files' keys, the tools' inputs) reports here, so a run that has several problems
says all of them at once, before any work, in one format::

    3 problems in the configuration:
      dataset.toml: general.shufle_caption: unknown key; did you mean "shuffle_caption"?
      --noise_offset must be >= 0 (around 0.1 is usual), got -1.0
      ...

Each problem is one line that starts with where it is (a file and key path, or a flag) and ends with how to fix
it. :class:`ConfigError` (a ``ValueError``) carries the lines in ``.problems``; readers that run under another one
(``library.run.config.read_config``) take those lines, never the text. Entry scripts print the message as ``error: ...`` and
exit with status 2 (``networks.tool_common.main_guard``, ``library.cli.console.print_error``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def first(items: Sequence[str], limit: int | None, sep: str = "\n", more: str = "\n... and {n} more") -> str:
    """``items`` joined by ``sep``, cut after ``limit`` with ``more`` (``{n}``: how many were left out)."""
    if limit is None or len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + more.format(n=len(items) - limit)


def format_problems(
    problems: Sequence[str], what: str = "configuration", limit: int | None = None, hint: str = ""
) -> str:
    """``N problem(s) in the <what>:``, one indented line per problem (after ``limit``: ``... and N more``), then
    ``hint`` (advice for all of them) on a line of its own."""
    n, lines = len(problems), first(problems, limit, "\n  ", "\n  ... and {n} more")
    return f"{n} problem{'s' if n != 1 else ''} in the {what}:\n  {lines}" + (f"\n{hint}" if hint else "")


class ConfigError(ValueError):
    """One or more problems with the user's input; ``.problems`` holds one line each, ``str()`` lists them under a
    header naming ``what`` was read (``limit``: show at most that many lines; ``hint``: advice for all of them)."""

    def __init__(self, problems: Sequence[str], what: str = "configuration", limit: int | None = None, hint: str = ""):
        self.problems = list(problems)
        self.what = what
        super().__init__(format_problems(self.problems, what, limit, hint))


def problems_of(error: ValueError) -> list[str]:
    """The problem lines of ``error``: its ``.problems`` for a :class:`ConfigError`, else its text as one line."""
    return list(error.problems) if isinstance(error, ConfigError) else [str(error)]


def suggestions(word: str, candidates: Iterable[str], n: int = 1, ignore_case: bool = False) -> list[str]:
    """The up to ``n`` candidates closest to ``word`` (difflib ratio >= 0.6), best first."""
    candidates = list(candidates)
    if not ignore_case:
        return difflib.get_close_matches(word, candidates, n=n, cutoff=0.6)
    by_lower = {c.lower(): c for c in candidates}
    return [by_lower[c] for c in difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=0.6)]


def did_you_mean(
    word: str,
    candidates: Iterable[str],
    *,
    show: Callable[[str], str] = repr,
    otherwise: str = "",
    form: str = "; {}",
    n: int = 1,
    ignore_case: bool = False,
) -> str:
    """``"; did you mean 'x'?"`` for the candidates closest to ``word`` (several joined by "or"); without one,
    ``otherwise`` (e.g. ``"known keys: a, b"``) or ``""``. ``form`` places the text (``" ({})"`` for parentheses);
    ``show`` writes a candidate (``repr`` quotes it, ``'--{}'.format`` makes it a flag)."""
    close = suggestions(word, candidates, n=n, ignore_case=ignore_case)
    text = f"did you mean {' or '.join(show(c) for c in close)}?" if close else otherwise
    return form.format(text) if text else ""


class Problems:
    """Collects problems (and warnings) from several readers; :meth:`raise_if_any` raises one :class:`ConfigError`
    listing every problem."""

    def __init__(self, what: str = "configuration") -> None:
        self.what = what
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, where: str, text: str | None = None) -> None:
        """Add ``"<where>: <text>"`` (or ``where`` alone, a whole line, when ``text`` is None)."""
        self.errors.append(where if text is None else f"{where}: {text}")

    def warn(self, where: str, text: str) -> None:
        self.warnings.append(f"{where}: {text}")

    def extend(self, lines: Iterable[str]) -> None:
        self.errors.extend(lines)

    def read(self, reader: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``reader(*args, **kwargs)``; its :class:`ConfigError` problems are added here (then None is returned)."""
        try:
            return reader(*args, **kwargs)
        except ConfigError as e:
            self.errors.extend(e.problems)
            return None

    def __bool__(self) -> bool:
        return bool(self.errors)

    def raise_if_any(self, what: str | None = None, limit: int | None = None) -> None:
        if self.errors:
            raise ConfigError(self.errors, what or self.what, limit)
