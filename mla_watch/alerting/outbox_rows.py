"""The outbox's file, row by row: its schema, a request to send as a row of ``outbox`` (:class:`OutboxItem`), a
request given up as a row of ``dead_letter``, and the SQL that writes and reads them.

Functions over an open connection, with no lock and no memory of their own: :class:`mla_watch.alerting.outbox.Outbox`
runs them through its database and decides what to do when the file refuses them.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from mla_watch.alerting.notifiers import OutgoingRequest, redact_url
from mla_watch.common.sqlite import rollback

__all__ = [
    "SCHEMA",
    "OutboxItem",
    "dead_letter_rows",
    "delete_row",
    "due_rows",
    "insert_dead_letter",
    "insert_row",
    "move_to_dead_letter",
    "update_retry",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    receiver TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    url TEXT NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL,
    last_error TEXT,
    UNIQUE (receiver, idempotency_key)
);
CREATE INDEX IF NOT EXISTS outbox_next_attempt ON outbox (next_attempt_at);
CREATE TABLE IF NOT EXISTS dead_letter (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    outbox_id INTEGER NOT NULL,
    receiver TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    url TEXT NOT NULL,
    body BLOB NOT NULL,
    attempts INTEGER NOT NULL,
    created_at REAL NOT NULL,
    failed_at REAL NOT NULL,
    error TEXT NOT NULL
);
"""
_DEAD_LETTER_COLUMNS = (
    "id",
    "outbox_id",
    "receiver",
    "idempotency_key",
    "url",
    "body",
    "attempts",
    "created_at",
    "failed_at",
    "error",
)
_INSERT_DEAD_LETTER = (
    "INSERT INTO dead_letter (outbox_id, receiver, idempotency_key, url, body, attempts,"
    " created_at, failed_at, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@dataclass(frozen=True)
class OutboxItem:
    id: int
    receiver: str
    request: OutgoingRequest
    attempts: int  # failed attempts so far
    created_at: float
    next_attempt_at: float
    last_error: str | None = None


def insert_row(
    db: sqlite3.Connection,
    receiver: str,
    request: OutgoingRequest,
    attempts: int,
    created: float,
    next_at: float,
    error: str | None,
) -> int | None:
    """Insert a request to send; its id, or None when ``(receiver, idempotency_key)`` is already pending."""
    cur = db.execute(
        "INSERT INTO outbox (receiver, idempotency_key, url, headers, body, attempts, created_at,"
        " next_attempt_at, last_error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (receiver, idempotency_key) DO NOTHING",
        (
            receiver,
            request.idempotency_key,
            request.url,
            json.dumps(dict(request.headers)),
            bytes(request.body),
            attempts,
            created,
            next_at,
            error,
        ),
    )
    return cur.lastrowid if cur.rowcount == 1 else None  # a row inserted: lastrowid is its id


def delete_row(db: sqlite3.Connection, item_id: int) -> None:
    """The request was delivered: its row goes."""
    db.execute("DELETE FROM outbox WHERE id = ?", (item_id,))


def update_retry(db: sqlite3.Connection, item_id: int, failures: int, next_at: float, error: str) -> None:
    """Count ``failures`` more failed attempts of a row and make it due again at ``next_at``."""
    db.execute(
        "UPDATE outbox SET attempts = attempts + ?, next_attempt_at = ?, last_error = ? WHERE id = ?",
        (failures, next_at, error, item_id),
    )


def insert_dead_letter(db: sqlite3.Connection, item: OutboxItem, attempts: int, now: float, error: str) -> None:
    """Keep a request that was never in the file (one held in memory) in the dead-letter table, its URL redacted."""
    db.execute(
        _INSERT_DEAD_LETTER,
        (
            item.id,
            item.receiver,
            item.request.idempotency_key,
            redact_url(item.request.url),
            bytes(item.request.body),
            attempts,
            item.created_at,
            now,
            error,
        ),
    )


def move_to_dead_letter(
    db: sqlite3.Connection, item_id: int, error: str, *, attempted: bool, now: float
) -> tuple[str, int] | None:
    """Move a row to the dead-letter table in one transaction (its URL redacted); its receiver and attempts, or None
    when there is no such row."""
    db.execute("BEGIN IMMEDIATE")
    try:
        row = db.execute(
            "SELECT receiver, idempotency_key, url, body, attempts, created_at FROM outbox WHERE id = ?",
            (item_id,),
        ).fetchone()
        if row is None:
            rollback(db)
            return None
        receiver, key, url, body, attempts, created = row
        attempts = int(attempts) + (1 if attempted else 0)
        db.execute(_INSERT_DEAD_LETTER, (item_id, receiver, key, redact_url(url), body, attempts, created, now, error))
        db.execute("DELETE FROM outbox WHERE id = ?", (item_id,))
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise
    return receiver, attempts


def due_rows(db: sqlite3.Connection, now: float, limit: int) -> list[OutboxItem]:
    """The rows due at ``now``, oldest due first, at most ``limit``."""
    rows = db.execute(
        "SELECT id, receiver, idempotency_key, url, headers, body, attempts, created_at, next_attempt_at,"
        " last_error FROM outbox WHERE next_attempt_at <= ? ORDER BY next_attempt_at, id LIMIT ?",
        (now, limit),
    ).fetchall()
    return [
        OutboxItem(
            id=int(item_id),
            receiver=receiver,
            request=OutgoingRequest(url=url, body=bytes(body), headers=json.loads(headers), idempotency_key=key),
            attempts=int(attempts),
            created_at=float(created),
            next_attempt_at=float(next_at),
            last_error=error,
        )
        for item_id, receiver, key, url, headers, body, attempts, created, next_at, error in rows
    ]


def dead_letter_rows(db: sqlite3.Connection) -> list[dict]:
    """The dead-letter table, oldest first, one dictionary a row (its body decoded as UTF-8)."""
    out = []
    for row in db.execute(f"SELECT {', '.join(_DEAD_LETTER_COLUMNS)} FROM dead_letter ORDER BY id").fetchall():
        record = dict(zip(_DEAD_LETTER_COLUMNS, row, strict=True))
        record["body"] = bytes(record["body"]).decode("utf-8", errors="replace")
        out.append(record)
    return out
