"""The SQLite files of the state directory (outbox, re-tune jobs, traffic capture), opened one way.

Each is owner-only (0600 before SQLite writes a byte: its ``-wal`` and ``-shm`` files take the
same mode), in WAL mode with a busy timeout, used from several threads under one lock, and every
``sqlite3.Error`` reaches the caller as the store's own error type naming the file.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from mla_watch.common.state_dir import ensure_private_file

__all__ = ["PrivateDatabase"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class PrivateDatabase:
    """One SQLite file, thread-safe. ``what`` names it in messages (``"outbox"``); ``error`` is raised."""

    def __init__(self, path: Path, *, what: str, error: type[Exception], schema: str,
                 synchronous: Literal["NORMAL", "FULL"] = "NORMAL") -> None:
        self.path = Path(path)
        self._what = what
        self._error = error
        self._lock = threading.Lock()
        self._closed = False
        directory = self.path.parent
        try:  # a clear message for a read-only or full state directory, before SQLite's own
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise error(f"{what} {self.path}: state directory {directory} is not writable: "
                        f"[Errno {exc.errno}] {exc.strerror}") from exc
        try:
            ensure_private_file(self.path)  # 0600, also when an older file was looser
        except OSError as exc:
            raise error(f"{what} {self.path}: cannot open the file for writing: "
                        f"[Errno {exc.errno}] {exc.strerror}") from exc
        db = None
        try:
            db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA busy_timeout = 10000")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("%s %s: journal_mode is %s, not WAL", what, self.path, mode)
            db.execute(f"PRAGMA synchronous = {synchronous}")
            db.executescript(schema)
        except sqlite3.Error as exc:
            if db is not None:
                db.close()
            raise error(f"{what} {self.path}: cannot open or initialise the database (expected an SQLite "
                        f"file): {exc}") from exc
        self._db = db

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` under the lock; an SQLite error becomes the store's error."""
        with self._lock:
            if self._closed:
                raise self._error(f"{self._what} {self.path}: already closed")
            try:
                return fn(self._db)
            except sqlite3.Error as exc:
                raise self._error(f"{self._what} {self.path}: {exc}") from exc

    def execute(self, sql: str, parameters: Any = ()) -> list[tuple]:
        """One statement; its rows."""
        return self.run(lambda db: db.execute(sql, parameters).fetchall())

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
