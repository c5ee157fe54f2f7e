"""The data a router re-tuning job trains and evaluates on: captured traffic or a JSONL dataset.

:class:`TrafficCapture` is an opt-in, bounded store of the token ids of recent requests (prompt
plus completion), kept per business line in a SQLite file in the state directory. It is bounded
four ways: at most ``max_samples_per_line`` samples per line (the oldest go first), samples older
than ``max_age_seconds`` are dropped (and never returned), the stored tokens take at most
``max_bytes`` (4 bytes per token; SQLite's own overhead comes on top), and a sample keeps at most
its first ``max_tokens_per_sample`` tokens. The file holds (tokenized) customer traffic, so it is
created with mode 0600, and token content never appears in logs or error messages; counts do.

:func:`load_jsonl_dataset` reads an offline dataset instead: one JSON object per line with
``"input_ids"``, ``"text"`` or ``"prompt"`` + ``"completion"`` and optionally ``"business_line"``.
Its errors name ``path:line``, the key, the bad value (truncated) and what was expected.

:func:`split_held_out` and :func:`make_batches` turn either into training / evaluation batches.
"""

from __future__ import annotations

import difflib
import json
import logging
import operator
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mla_watch.yamlcheck import fmt

__all__ = ["CaptureError", "DatasetError", "TrafficCapture", "load_jsonl_dataset", "make_batches", "split_held_out"]

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4  # token ids are stored as packed little-endian int32
_MAX_TOKEN_ID = 2**31 - 1
_MAX_LINE_NAME = 200
_PRUNE_EVERY_ADDS = 64  # age prune on add: at most every this many adds ...
_PRUNE_EVERY_SECONDS = 5.0  # ... or when this much clock time has passed since the last one
_MAX_REPORTED_ERRORS = 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    business_line TEXT NOT NULL,
    created_at REAL NOT NULL,
    n_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_line_age ON samples (business_line, created_at, id);
CREATE INDEX IF NOT EXISTS samples_age ON samples (created_at, id);
"""
_COLUMNS = ("id", "business_line", "created_at", "n_tokens", "token_ids")


class CaptureError(RuntimeError):
    """The traffic capture cannot be opened or written (bad state directory, not a database, ...)."""


class DatasetError(ValueError):
    """A dataset file cannot be used; the message names ``path:line``, the key, the value and the expectation.

    ``errors`` holds every problem found (up to 20), one message each.
    """

    def __init__(self, message: str, errors: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]


def _positive(name: str, value: object, kind: type | tuple[type, ...] = (int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        expected = "a positive integer" if kind is int else "a positive number"
        raise ValueError(f"{name} = {fmt(value)}: expected {expected}")


def _pack(tokens: Sequence[int], limit: int) -> tuple[bytes, int]:
    """Validate ``tokens`` (their first ``limit``) and pack them as little-endian int32.

    Messages name the position and the type, never the token value (it is customer content).
    """
    if isinstance(tokens, str | bytes | bytearray) or not hasattr(tokens, "__len__"):
        raise ValueError(f"token_ids: got {type(tokens).__name__}: expected a sequence of token ids (ints)")
    if isinstance(tokens, torch.Tensor | np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"token_ids: got a {tokens.ndim}-D array: expected a 1-D sequence of token ids")
        tokens = tokens.tolist()
    if len(tokens) == 0:
        raise ValueError("token_ids: empty: expected at least one token id")
    kept = list(tokens[:limit])
    values = []
    for index, token in enumerate(kept):
        if isinstance(token, bool):
            raise ValueError(f"token_ids[{index}]: got bool: expected an int token id")
        try:
            value = operator.index(token)
        except TypeError:
            raise ValueError(f"token_ids[{index}]: got {type(token).__name__}: expected an int token id") from None
        if not 0 <= value <= _MAX_TOKEN_ID:
            raise ValueError(f"token_ids[{index}]: out of range: expected an int in [0, 2**31)")
        values.append(value)
    return np.asarray(values, dtype="<i4").tobytes(), len(values)


def _unpack(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


class TrafficCapture:
    """Bounded store of recent token sequences per business line, in a sqlite file in the state directory.

    Thread-safe (one connection behind a lock; WAL mode). One process at a time should write a
    file: the byte budget is tracked in memory between :meth:`prune` calls. ``clock`` gives the
    time samples are stamped with and aged by (injectable for tests).

    On :meth:`add` the per-line count and the byte budget are enforced at once; expired samples
    are dropped at most every 64 adds or 5 s of ``clock`` time (and by :meth:`prune`,
    :meth:`counts`); :meth:`samples` never returns an expired one either way.
    """

    def __init__(self, path: Path, *, max_samples_per_line: int = 2000, max_age_seconds: float = 7 * 86400,
                 max_bytes: int = 64 * 2**20, max_tokens_per_sample: int = 512,
                 clock: Callable[[], float] = time.time) -> None:
        _positive("max_samples_per_line", max_samples_per_line, int)
        _positive("max_age_seconds", max_age_seconds)
        _positive("max_bytes", max_bytes, int)
        _positive("max_tokens_per_sample", max_tokens_per_sample, int)
        self.path = Path(path)
        self.max_samples_per_line = int(max_samples_per_line)
        self.max_age_seconds = float(max_age_seconds)
        self.max_bytes = int(max_bytes)
        self.max_tokens_per_sample = int(max_tokens_per_sample)
        self.clock = clock
        self._lock = threading.Lock()
        self._closed = False
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureError(f"traffic capture {self.path}: cannot create the state directory {directory}: "
                               f"[Errno {exc.errno}] {exc.strerror}") from exc
        try:
            fd, probe = tempfile.mkstemp(prefix=".capture-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CaptureError(f"traffic capture {self.path}: state directory {directory} is not writable: "
                               f"[Errno {exc.errno}] {exc.strerror}") from exc
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
        except OSError as exc:
            raise CaptureError(f"traffic capture {self.path}: cannot open the file for writing: "
                               f"[Errno {exc.errno}] {exc.strerror}") from exc
        db = None
        try:
            db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA busy_timeout = 10000")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("traffic capture %s: journal_mode is %s, not WAL", self.path, mode)
            db.execute("PRAGMA synchronous = NORMAL")  # losing the last few samples in a power cut is fine
            db.executescript(_SCHEMA)
            columns = tuple(row[1] for row in db.execute("PRAGMA table_info(samples)"))
            if columns != _COLUMNS:
                raise CaptureError(f"traffic capture {self.path}: table 'samples' has columns {', '.join(columns)}: "
                                   f"expected {', '.join(_COLUMNS)} (a file written by something else?)")
            stored = db.execute("SELECT COALESCE(SUM(n_tokens), 0) FROM samples").fetchone()[0]
        except sqlite3.Error as exc:
            if db is not None:
                db.close()
            raise CaptureError(f"traffic capture {self.path}: cannot open or initialise the database "
                               f"(expected an SQLite file): {exc}") from exc
        except CaptureError:
            db.close()
            raise
        self._db = db
        self._bytes = int(stored) * BYTES_PER_TOKEN
        self._adds_since_prune = 0
        self._last_prune = self.clock()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def __enter__(self) -> TrafficCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock:
            if self._closed:
                raise CaptureError(f"traffic capture {self.path}: already closed")
            try:
                return fn(self._db)
            except sqlite3.Error as exc:
                raise CaptureError(f"traffic capture {self.path}: {exc}") from exc

    def _transaction(self, db: sqlite3.Connection, fn: Callable[[], Any]) -> Any:
        stored = self._bytes
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            self._bytes = stored
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    # -- writing -----------------------------------------------------------------------------
    def add(self, business_line: str, token_ids: Sequence[int]) -> None:
        """Store the prompt + completion ids of one request (its first ``max_tokens_per_sample``)."""
        if not isinstance(business_line, str) or not business_line or len(business_line) > _MAX_LINE_NAME:
            raise ValueError(f"business_line = {fmt(business_line)}: expected a non-empty string of at most "
                             f"{_MAX_LINE_NAME} characters")
        blob, n_tokens = _pack(token_ids, self.max_tokens_per_sample)

        def insert(db: sqlite3.Connection) -> None:
            now = self.clock()

            def body() -> tuple[int, int, int]:
                db.execute("INSERT INTO samples (business_line, created_at, n_tokens, token_ids) VALUES (?, ?, ?, ?)",
                           (business_line, now, n_tokens, blob))
                self._bytes += n_tokens * BYTES_PER_TOKEN
                over_count = self._trim_line(db, business_line)
                self._adds_since_prune += 1
                expired = 0
                if (self._adds_since_prune >= _PRUNE_EVERY_ADDS
                        or now - self._last_prune >= _PRUNE_EVERY_SECONDS or now < self._last_prune):
                    expired = self._drop_expired(db, now)
                    self._adds_since_prune = 0
                    self._last_prune = now
                over_bytes = self._trim_bytes(db) if self._bytes > self.max_bytes else 0
                return expired, over_count, over_bytes

            dropped = self._transaction(db, body)
            if dropped[0] or dropped[2]:
                self._log_pruned(*dropped, level=logging.DEBUG)  # steady state at the byte budget: every add

        self._run(insert)

    def _trim_line(self, db: sqlite3.Connection, business_line: str) -> int:
        """Drop the oldest samples of one line beyond ``max_samples_per_line``; how many."""
        rows = db.execute(
            "SELECT id, n_tokens FROM samples WHERE business_line = ? ORDER BY created_at DESC, id DESC"
            " LIMIT ? OFFSET ?", (business_line, -1, self.max_samples_per_line)).fetchall()
        return self._delete(db, rows)

    def _drop_expired(self, db: sqlite3.Connection, now: float) -> int:
        cutoff = now - self.max_age_seconds
        rows = db.execute("SELECT id, n_tokens FROM samples WHERE created_at < ?", (cutoff,)).fetchall()
        return self._delete(db, rows)

    def _trim_bytes(self, db: sqlite3.Connection) -> int:
        """Drop the oldest samples (any line) until the stored tokens fit in ``max_bytes``; how many."""
        excess = self._bytes - self.max_bytes
        rows = []
        for row in db.execute("SELECT id, n_tokens FROM samples ORDER BY created_at, id"):
            if excess <= 0:
                break
            rows.append(row)
            excess -= int(row[1]) * BYTES_PER_TOKEN
        return self._delete(db, rows)

    def _delete(self, db: sqlite3.Connection, rows: list[tuple[int, int]]) -> int:
        if rows:
            db.executemany("DELETE FROM samples WHERE id = ?", [(row[0],) for row in rows])
            self._bytes -= sum(int(row[1]) for row in rows) * BYTES_PER_TOKEN
        return len(rows)

    def _log_pruned(self, expired: int, over_count: int, over_bytes: int, level: int = logging.INFO) -> None:
        log.log(level, "traffic capture %s: dropped %d sample(s): %d expired, %d over the per-line limit of %d, "
                 "%d over the byte budget of %d", self.path, expired + over_count + over_bytes, expired,
                 over_count, self.max_samples_per_line, over_bytes, self.max_bytes)

    def prune(self) -> int:
        """Drop expired samples, then enforce the per-line count and the byte budget (oldest first); rows dropped."""

        def run(db: sqlite3.Connection) -> tuple[int, int, int]:
            now = self.clock()

            def body() -> tuple[int, int, int]:
                # re-read the byte total: it is the one figure kept in memory
                stored = db.execute("SELECT COALESCE(SUM(n_tokens), 0) FROM samples").fetchone()[0]
                self._bytes = int(stored) * BYTES_PER_TOKEN
                expired = self._drop_expired(db, now)
                lines = [row[0] for row in db.execute(
                    "SELECT business_line FROM samples GROUP BY business_line HAVING COUNT(*) > ?",
                    (self.max_samples_per_line,))]
                over_count = sum(self._trim_line(db, line) for line in lines)
                over_bytes = self._trim_bytes(db) if self._bytes > self.max_bytes else 0
                return expired, over_count, over_bytes

            dropped = self._transaction(db, body)
            self._adds_since_prune = 0
            self._last_prune = now
            return dropped

        dropped = self._run(run)
        if sum(dropped):
            self._log_pruned(*dropped)
        return sum(dropped)

    # -- reading -----------------------------------------------------------------------------
    def samples(self, business_line: str | None = None, *, limit: int | None = None) -> list[list[int]]:
        """The newest ``limit`` unexpired samples (of one line, or of every line for None), oldest first."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit = {fmt(limit)}: expected None or a non-negative integer")
        if limit == 0:
            return []
        cutoff = self.clock() - self.max_age_seconds
        where, params = "created_at >= ?", [cutoff]
        if business_line is not None:
            where += " AND business_line = ?"
            params.append(business_line)
        params.append(-1 if limit is None else limit)
        rows = self._run(lambda db: db.execute(
            f"SELECT token_ids FROM samples WHERE {where} ORDER BY created_at DESC, id DESC LIMIT ?",
            params).fetchall())
        return [_unpack(row[0]) for row in reversed(rows)]

    def counts(self) -> dict[str, int]:
        """Samples stored per business line, after dropping the expired ones."""
        self.prune()
        rows = self._run(lambda db: db.execute(
            "SELECT business_line, COUNT(*) FROM samples GROUP BY business_line ORDER BY business_line").fetchall())
        return {line: int(count) for line, count in rows}

    def size_bytes(self) -> int:
        """Bytes of token data stored (4 per token); the SQLite file adds a little overhead on top."""
        stored = self._run(lambda db: db.execute("SELECT COALESCE(SUM(n_tokens), 0) FROM samples").fetchone()[0])
        return int(stored) * BYTES_PER_TOKEN


# -- JSONL datasets ----------------------------------------------------------------------------

_CONTENT_KEYS = ("input_ids", "text", "prompt", "completion")
_EXPECTED_KEYS = ("exactly one of 'input_ids' (a list of token ids), 'text' (a string) "
                  "or 'prompt' + 'completion' (strings)")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_jsonl_dataset(path: str | Path, tokenizer: Any, *, business_line: str | None = None,
                       max_samples: int | None = None, add_bos: bool = True) -> list[list[int]]:
    """Token id sequences from a JSONL file: one JSON object per non-blank line.

    Each object has exactly one of ``"input_ids"`` (ints in ``[0, len(tokenizer))``), ``"text"``
    (encoded without special tokens) or ``"prompt"`` + ``"completion"`` (each encoded without
    special tokens, the ids concatenated, as a served request's are), and optionally a
    ``"business_line"`` string; other keys are ignored. With ``business_line`` given, rows of
    other lines are skipped (rows without the key are kept). With ``add_bos``, the tokenizer's
    BOS id is put first unless it already is. Sequences shorter than 2 tokens are skipped.
    Reading stops once ``max_samples`` samples are collected.

    Every problem raises :class:`DatasetError` naming ``path:line``, the key, the value and the
    expectation (up to 20 problems are reported together).
    """
    path = Path(path)
    if max_samples is not None:
        _positive("max_samples", max_samples, int)
    if business_line is not None and not isinstance(business_line, str):
        raise ValueError(f"business_line = {fmt(business_line)}: expected None or a string")
    bos = tokenizer.bos_token_id if add_bos else None
    if add_bos and bos is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id: pass add_bos=False")
    vocab = len(tokenizer)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the file ({exc.strerror or exc}): expected a readable JSONL file "
                           "(one JSON object per line)") from None
    errors: list[str] = []
    samples: list[list[int]] = []
    rows = skipped_line = skipped_short = 0

    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if len(errors) >= _MAX_REPORTED_ERRORS or (max_samples is not None and len(samples) >= max_samples):
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                errors.append(f"{path}:{lineno}: byte {exc.start}: expected UTF-8 text")
                continue
            if not line.strip():
                continue
            rows += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}): "
                              "expected one JSON object per line")
                continue
            if not isinstance(record, dict):
                errors.append(f"{path}:{lineno}: {fmt(record)}: expected a JSON object")
                continue
            ids = _check_record(record, f"{path}:{lineno}", vocab, errors)
            if ids is None:
                continue
            row_line = record.get("business_line")
            if business_line is not None and row_line is not None and row_line != business_line:
                skipped_line += 1
                continue
            if isinstance(ids, tuple):  # strings still to encode
                ids = [token for text in ids for token in _encode(tokenizer, text)]
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            if len(ids) < 2:
                skipped_short += 1
                continue
            samples.append(ids)
    if errors:
        more = " (stopped reading there)" if len(errors) >= _MAX_REPORTED_ERRORS else ""
        head = errors[0] if len(errors) == 1 else f"{len(errors)} problems{more}:\n" + "\n".join(errors)
        raise DatasetError(head, errors)
    if not samples:
        filtered = " by business line" if business_line is None else f" of business lines other than {business_line!r}"
        raise DatasetError(f"{path}: no usable samples: read {rows} row(s), skipped {skipped_line}{filtered} and "
                           f"{skipped_short} shorter than 2 tokens: expected at least one row with 2 or more tokens")
    log.info("dataset %s: %d sample(s) from %d row(s) (%d skipped by business line, %d shorter than 2 tokens)",
             path, len(samples), rows, skipped_line, skipped_short)
    return samples


def _check_record(record: dict, where: str, vocab: int, errors: list[str]) -> list[int] | tuple[str, ...] | None:
    """The ids of a row, or the strings still to encode; None (with the problems appended) when it is invalid."""
    found = len(errors)

    def bad(key: str, value: object, expected: str) -> None:
        errors.append(f"{where}: {key} = {fmt(value)}: expected {expected}")

    if "business_line" in record and not isinstance(record["business_line"], str):
        bad("business_line", record["business_line"], "a string")
    present = [key for key in ("input_ids", "text", "prompt") if key in record]
    if "completion" in record and "prompt" not in record:
        present.append("completion")
    if len(present) != 1:
        if present:
            what = f"several of the keys: {', '.join(repr(k) for k in present)}"
        else:
            keys = [k for k in record if k != "business_line"]
            hints = sorted({m for k in keys for m in difflib.get_close_matches(k, _CONTENT_KEYS, n=1)})
            hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
            what = f"none of the keys 'input_ids', 'text', 'prompt' (keys present: {fmt(keys)}){hint}"
        errors.append(f"{where}: {what}: expected {_EXPECTED_KEYS}")
        return None
    key = present[0]
    if key == "completion":
        errors.append(f"{where}: prompt: missing: expected a 'prompt' string next to 'completion'")
        return None
    if key == "input_ids":
        value = record["input_ids"]
        if not isinstance(value, list):
            bad("input_ids", value, "a list of token ids (ints)")
            return None
        for index, token in enumerate(value):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                bad(f"input_ids[{index}]", token, f"an int token id in [0, {vocab}) (the tokenizer's vocabulary)")
                break
        return list(value) if len(errors) == found else None
    if key == "text":
        if not isinstance(record["text"], str):
            bad("text", record["text"], "a string")
        return (record["text"],) if len(errors) == found else None
    if "completion" not in record:
        errors.append(f"{where}: completion: missing: expected a 'completion' string next to 'prompt' (may be empty)")
        return None
    for name in ("prompt", "completion"):
        if not isinstance(record[name], str):
            bad(name, record[name], "a string")
    return (record["prompt"], record["completion"]) if len(errors) == found else None


# -- splitting and batching --------------------------------------------------------------------


def split_held_out(samples: Sequence[list[int]], fraction: float = 0.2, *,
                   minimum: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """``(train, held_out)``: about ``fraction`` of the samples held out, spread evenly over them.

    Deterministic: every k-th sample (k = 1 / fraction, rounded per position) is held out, so the
    held-out set spans the whole capture rather than its newest end. At least ``minimum`` are held
    out and at least one is left to train on. Both keep the input order.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise ValueError(f"fraction = {fmt(fraction)}: expected a number strictly between 0 and 1")
    _positive("minimum", minimum, int)
    n = len(samples)
    if n < 2:
        raise ValueError(f"split_held_out: got {n} sample(s): at least 2 are needed (one to train on, one held out)")
    n_held = min(n - 1, max(int(minimum), round(n * fraction), 1))
    step = n / n_held  # > 1, so the positions below are distinct
    held = {int((i + 0.5) * step) for i in range(n_held)}
    train = [list(s) for i, s in enumerate(samples) if i not in held]
    held_out = [list(s) for i, s in enumerate(samples) if i in held]
    return train, held_out


def make_batches(samples: Sequence[list[int]], *, batch_size: int = 8, pad_id: int = 0,
                 max_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Consecutive batches in the given order: ``{"input_ids", "attention_mask"}``, LongTensors ``[B, T]``.

    Each sample is cut to its first ``max_tokens`` and right-padded with ``pad_id`` to the
    longest in its batch; the mask is 1 on real tokens, 0 on padding.
    """
    _positive("batch_size", batch_size, int)
    if max_tokens is not None:
        _positive("max_tokens", max_tokens, int)
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ValueError(f"pad_id = {fmt(pad_id)}: expected an int")
    batches = []
    for start in range(0, len(samples), batch_size):
        chunk = []
        for index in range(start, min(start + batch_size, len(samples))):
            sample = samples[index]
            if isinstance(sample, torch.Tensor):
                sample = sample.tolist()
            ids = list(sample[:max_tokens] if max_tokens is not None else sample)
            if not ids:
                raise ValueError(f"samples[{index}]: empty: expected at least one token id")
            chunk.append(ids)
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(chunk):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches
