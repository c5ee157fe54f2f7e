"""Which files of the state directory cannot be written now, and why: said once per change, not once per write.

A full or read-only state directory is an ordinary day: the sidecar goes on serving and keeps in memory what
it could not write, and every writer (the alert state, the outbox, the history, the baselines, router
versions, captured traffic) tries again by itself. Each tells :class:`StateWrites` how its last write went:
:meth:`StateWrites.failed` logs one line when a file starts failing or fails another way, and
:meth:`StateWrites.written` one when it is written again; in between the log is quiet, however many writes
fail. ``/readyz`` and ``/metrics`` read :meth:`StateWrites.failing` and :meth:`StateWrites.error_counts`.

A file is named by its first path component inside ``root`` (``alerts.json``, ``routers``): a bounded set of
names, fit for a metric label; one outside ``root`` by its full path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_watch.common.output_file import problem_words, write_error

__all__ = ["StateWrites"]

log = logging.getLogger("mla_watch.state")

_STATE_ADVICE = "kept in memory and written again by itself once it can be"


@dataclass
class _Failing:
    path: str
    problem: str
    message: str
    since: float


class StateWrites:
    """The write health of the files under ``root``; thread-safe. ``clock``: wall-clock seconds."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.root = None if root is None else Path(os.path.abspath(root))
        self._clock = clock
        self._lock = threading.Lock()
        self._failing: dict[str, _Failing] = {}
        self._errors: dict[str, int] = {}

    def name(self, path: str | os.PathLike[str]) -> str:
        """The file's name in :meth:`failing` and in the metric: its first component inside ``root``."""
        full = Path(os.path.abspath(path))
        if self.root is not None:
            try:
                return full.relative_to(self.root).parts[0]
            except (ValueError, IndexError):
                pass
        return str(full)

    def failed(
        self, path: str | os.PathLike[str], error: BaseException, *, what: str = "", kept: str = _STATE_ADVICE
    ) -> str:
        """A write of ``path`` failed with ``error``: counted; logged when the file was writable before or failed
        another way. Returns the one-line message (``what`` names the file in it: "alert state file")."""
        name = self.name(path)
        label = f"{what} {path}".strip()
        message = str(write_error(label, error, advice=kept))
        problem = problem_words(error)
        with self._lock:
            self._errors[name] = self._errors.get(name, 0) + 1
            before = self._failing.get(name)
            changed = before is None or before.problem != problem
            self._failing[name] = _Failing(
                str(path), problem, message, before.since if before is not None and not changed else self._clock()
            )
        if changed:
            log.error("%s", message)
        return message

    def written(self, path: str | os.PathLike[str], *, what: str = "") -> None:
        """A write of ``path`` went through: if its file was failing, say once that it is written again."""
        name = self.name(path)
        if name not in self._failing:  # the common case, without the lock
            return
        with self._lock:
            before = self._failing.pop(name, None)
        if before is not None:
            log.warning(
                "%s %s is written again (it could not be for %.0f s: %s)",
                what or "state file",
                path,
                max(0.0, self._clock() - before.since),
                before.problem,
            )

    def is_failing(self, path: str | os.PathLike[str]) -> bool:
        return self.name(path) in self._failing

    def failing(self) -> list[dict[str, Any]]:
        """The files that cannot be written now: ``file``, ``path``, ``problem`` (words), ``message`` (the line
        logged), ``since`` (seconds since the epoch); sorted by file."""
        with self._lock:
            return [
                {
                    "file": name,
                    "path": entry.path,
                    "problem": entry.problem,
                    "message": entry.message,
                    "since": entry.since,
                }
                for name, entry in sorted(self._failing.items())
            ]

    def error_counts(self) -> dict[str, int]:
        """Failed writes per file since start."""
        with self._lock:
            return dict(self._errors)
