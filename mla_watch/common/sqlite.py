"""The SQLite files of the state directory (outbox, re-tune jobs, traffic capture), opened one way.

Each is owner-only (0600 before SQLite writes a byte: its ``-wal`` and ``-shm`` files take the
same mode), in WAL mode with a busy timeout, used from several threads under one lock, and every
``sqlite3.Error`` reaches the caller as the store's own error type naming the file.

A write the disk refuses (full, read-only, an I/O error) is said in words (``output_file.write_error``) and
told to the state directory's :class:`~mla_watch.common.state_writes.StateWrites`, which logs it once per
change; the next write that changes a row tells it the file is written again. After an I/O error the
connection is opened afresh before the next statement: SQLite may not recover one by itself.
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

from mla_watch.common.output_file import write_error
from mla_watch.common.state_dir import ensure_private_file
from mla_watch.common.state_writes import StateWrites

__all__ = ["PrivateDatabase", "rollback"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# The result codes of a write the disk refused (sqlite3.Error.sqlite_errorname, up to its second "_")
_DISK_ERRORS = frozenset({"SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_PERM"})


def rollback(db: sqlite3.Connection) -> None:
    """End a failed transaction: SQLite has already rolled it back itself after some errors (a full disk, an I/O
    error), and a ROLLBACK then would fail and hide the error that matters."""
    if db.in_transaction:
        db.execute("ROLLBACK")


def _refused_by_the_disk(error: sqlite3.Error) -> bool:
    return "_".join(str(getattr(error, "sqlite_errorname", "")).split("_")[:2]) in _DISK_ERRORS


class PrivateDatabase:
    """One SQLite file, thread-safe. ``what`` names it in messages (``"outbox"``); ``error`` is raised."""

    def __init__(
        self,
        path: Path,
        *,
        what: str,
        error: type[Exception],
        schema: str,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        writes: StateWrites | None = None,
        kept: str | None = None,
    ) -> None:
        self.path = Path(path)
        self._what = what
        self._error = error
        self._synchronous = synchronous
        self._schema = schema  # run again on a fresh connection: it holds per-connection pragmas too
        self.writes = writes
        self._kept = kept  # what becomes of a write the disk refused, in the line logged (default: kept in memory)
        self._lock = threading.Lock()
        self._closed = False
        self._reopen = False  # an I/O error: open the connection afresh before the next statement
        directory = self.path.parent
        try:  # a clear message for a read-only or full state directory, before SQLite's own
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise error(
                f"{what} {self.path}: state directory {directory} is not writable: [Errno {exc.errno}] {exc.strerror}"
            ) from exc
        try:
            ensure_private_file(self.path)  # 0600, also when an older file was looser
        except OSError as exc:
            raise error(
                f"{what} {self.path}: cannot open the file for writing: [Errno {exc.errno}] {exc.strerror}"
            ) from exc
        try:
            self._db = self._connect()
            self._db.executescript(schema)
        except sqlite3.Error as exc:
            if hasattr(self, "_db"):
                self._db.close()
            raise error(
                f"{what} {self.path}: cannot open or initialise the database (expected an SQLite file): {exc}"
            ) from exc

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("%s %s: journal_mode is %s, not WAL", self._what, self.path, mode)
            db.execute(f"PRAGMA synchronous = {self._synchronous}")
        except sqlite3.Error:
            db.close()
            raise
        return db

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` under the lock; an SQLite error becomes the store's error (one that the disk refused
        says so in words, and is told to ``writes``)."""
        with self._lock:
            if self._closed:
                raise self._error(f"{self._what} {self.path}: already closed")
            try:
                if self._reopen:
                    fresh = self._connect()
                    try:
                        fresh.executescript(self._schema)
                    except sqlite3.Error:
                        fresh.close()
                        raise
                    self._db.close()
                    self._db, self._reopen = fresh, False
                changes = self._db.total_changes
                result = fn(self._db)
            except sqlite3.Error as exc:
                if not _refused_by_the_disk(exc):
                    raise self._error(f"{self._what} {self.path}: {exc}") from exc
                if str(getattr(exc, "sqlite_errorname", "")).startswith("SQLITE_IOERR"):
                    self._reopen = True
                if self.writes is not None:
                    message = (
                        self.writes.failed(self.path, exc, what=self._what)
                        if self._kept is None
                        else self.writes.failed(self.path, exc, what=self._what, kept=self._kept)
                    )
                else:
                    message = str(write_error(f"{self._what} {self.path}", exc))
                raise self._error(message) from exc
            if self.writes is not None and self._db.total_changes != changes:
                self.writes.written(self.path, what=self._what)
            return result

    def execute(self, sql: str, parameters: Any = ()) -> list[tuple]:
        """One statement; its rows."""
        return self.run(lambda db: db.execute(sql, parameters).fetchall())

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
