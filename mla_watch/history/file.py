"""The durable routing history's SQLite file: its schema, one sample's write, an unreadable file set aside.

One row per (tier, time) holds the point of every series as one packed little-endian float32 array
``[series id, value]``; the series' names live in a side table (see :mod:`mla_watch.history.store`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.common.sqlite import PrivateDatabase, rollback
from mla_watch.common.state_writes import StateWrites

__all__ = ["HISTORY_FILE", "open_database", "rewrite_since", "set_aside", "write_sample"]

log = logging.getLogger("mla_watch.history.store")  # the store's records keep their logger's name

HISTORY_FILE = "history.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY, router TEXT NOT NULL, business_line TEXT NOT NULL, layer INTEGER NOT NULL,
    kind TEXT NOT NULL, floor_bits REAL, ceiling_bits REAL, num_slots INTEGER, UNIQUE (router, business_line));
CREATE TABLE IF NOT EXISTS points (tier TEXT NOT NULL, t REAL NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (tier, t)) WITHOUT ROWID;
PRAGMA journal_size_limit = 4194304;
"""


def open_database(path: Path, error: type[Exception], writes: StateWrites | None = None) -> PrivateDatabase:
    """The history file at ``path`` (created 0600 with its schema); ``error`` when it cannot be opened."""
    return PrivateDatabase(path, what="routing history", error=error, schema=_SCHEMA, writes=writes)


def set_aside(path: Path, why: str) -> None:
    """Move an unreadable history file (and its WAL) to ``<name>.corrupt``, or remove it when that fails."""
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):  # a stale WAL would be replayed into the new file
            companion = path.with_name(path.name + suffix)
            if companion.exists():
                os.replace(companion, aside.with_name(aside.name + suffix))
        log.error(
            "routing history file %s is unreadable (%s); starting with an empty history, kept it as %s",
            path,
            why,
            aside,
        )
    except OSError as error:
        log.error(
            "routing history file %s is unreadable (%s); could not move it to %s (%s): removing it",
            path,
            why,
            aside,
            error,
        )
        path.unlink(missing_ok=True)


def write_sample(
    db: sqlite3.Connection,
    truncate: list | None,
    new_series: list[tuple[int, Any]],
    points: list[tuple[str, float, np.ndarray]],
    expired: list,
    freed: list[int],
) -> None:
    """One sample in one transaction: points dropped after a clock step back, freed and new series, the new
    points of each tier, the expired ones."""
    db.execute("BEGIN IMMEDIATE")
    try:
        if truncate is not None:
            db.executemany("DELETE FROM points WHERE tier = ? AND t > ?", truncate)
        if freed:
            db.executemany("DELETE FROM series WHERE id = ?", [(sid,) for sid in freed])
        _write_rows(db, new_series, points, expired)
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise


def rewrite_since(
    db: sqlite3.Connection,
    since: dict[str, float],
    series: list[tuple[int, Any]],
    points: list[tuple[str, float, np.ndarray]],
    expired: list,
) -> None:
    """After writes the disk refused: make the file hold what memory holds, in one transaction. Per tier, the
    points from ``since[tier]`` on are replaced by ``points``; the series table becomes ``series``."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.executemany("DELETE FROM points WHERE tier = ? AND t >= ?", list(since.items()))
        kept = [sid for sid, _ in series]
        db.execute(f"DELETE FROM series WHERE id NOT IN ({', '.join('?' * len(kept))})", kept)
        _write_rows(db, series, points, expired)
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise


def _write_rows(
    db: sqlite3.Connection, series: list[tuple[int, Any]], points: list[tuple[str, float, np.ndarray]], expired: list
) -> None:
    """The series and points given written (replacing rows of the same keys), the expired points deleted."""
    db.executemany(
        "INSERT OR REPLACE INTO series VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (sid, i.router, i.business_line, i.layer, i.kind, i.floor_bits, i.ceiling_bits, i.num_slots)
            for sid, i in series
        ],
    )
    db.executemany(
        "INSERT OR REPLACE INTO points VALUES (?, ?, ?)",
        [(tier, t, row.astype("<f4").tobytes()) for tier, t, row in points],
    )
    db.executemany("DELETE FROM points WHERE tier = ? AND t < ?", expired)
