"""Durable notification delivery: a SQLite outbox in the state directory and a dispatcher thread.

Every request is committed to the outbox *before* anything is sent, and a row is deleted only
after the receiver answered 2xx, so a crash (even SIGKILL) at any point loses nothing: the
next process that opens the same outbox sends what is left. Delivery is therefore
at-least-once; a request that was sent but not yet marked delivered when the process died is
sent again with the same body and the same ``Idempotency-Key`` header (for the Alertmanager
webhook format, the same ``groupKey``), so receivers can deduplicate.

Callers (the engine, the server) only :meth:`Outbox.enqueue` / :meth:`Outbox.submit`, which
are short SQLite writes; HTTP happens only on the :class:`Dispatcher`'s thread, so a slow or
broken receiver never blocks them.

Retries follow Alertmanager: 5xx, 429, timeouts, connection errors and malformed responses
are retried with exponential backoff and full jitter (``uniform(0, min(cap, base * 2**n))``
after the n-th failure, or the receiver's ``Retry-After`` for 429/503); any other status
(3xx, other 4xx) is permanent. A request that fails permanently or exhausts the receiver's
``max_attempts`` is moved to the ``dead_letter`` table (kept for inspection) and reported.

A receiver whose ``url`` is None (its ``${ENV_VAR}`` is unset) is disabled: :meth:`Outbox.submit`
enqueues nothing for it and returns an empty list (the caller logs that, once). Items already
queued for a receiver that is later disabled or removed are dead-lettered by the dispatcher.

One process at a time should dispatch from one outbox file (the dispatcher does not claim rows).
The file holds receiver URLs and headers (secrets), so it is created with mode 0600.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mla_watch.alerting.model import Notification, Receiver
from mla_watch.alerting.notifiers import Notifier, OutgoingRequest, notifier_for, redact_url
from mla_watch.common.sqlite import PrivateDatabase

__all__ = [
    "OUTCOMES",
    "Dispatcher",
    "Outbox",
    "OutboxError",
    "OutboxItem",
    "SendResult",
    "backoff_delay",
    "parse_retry_after",
    "send_request",
]

log = logging.getLogger(__name__)

OUTCOMES: tuple[str, ...] = ("delivered", "retry", "failed")
MAX_RETRY_AFTER = 24 * 3600.0
_ERROR_BODY_BYTES = 300

_SCHEMA = """
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


class OutboxError(RuntimeError):
    """The outbox cannot be opened or written (bad state directory, corrupt file, ...)."""


@dataclass(frozen=True)
class OutboxItem:
    id: int
    receiver: str
    request: OutgoingRequest
    attempts: int  # failed attempts so far
    created_at: float
    next_attempt_at: float
    last_error: str | None = None


class Outbox:
    """A SQLite-backed queue of outgoing requests (thread-safe; WAL mode; one file per state dir)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self._lock = threading.Lock()
        directory = self.path.parent
        if not directory.is_dir():
            raise OutboxError(f"outbox {self.path}: state directory {directory} does not exist "
                              "or is not a directory")
        self._store = PrivateDatabase(self.path, what="outbox", error=OutboxError, schema=_SCHEMA,
                                      synchronous="FULL")  # a page must survive a power cut

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return self._store.run(fn)

    # -- writing -----------------------------------------------------------------------------
    def enqueue(self, receiver: str, request: OutgoingRequest) -> int | None:
        """Store ``request`` for ``receiver`` (committed on return) and return its id.

        None when an identical ``(receiver, idempotency_key)`` is still pending (not enqueued twice).
        """
        scheme = urlsplit(request.url).scheme if request.url else ""
        if scheme not in ("http", "https"):
            raise ValueError(f"receiver {receiver!r}: the request URL must be http(s), got {redact_url(request.url)}")
        now = self.clock()

        def insert(db: sqlite3.Connection) -> int | None:
            cur = db.execute(
                "INSERT INTO outbox (receiver, idempotency_key, url, headers, body, attempts, created_at,"
                " next_attempt_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?)"
                " ON CONFLICT (receiver, idempotency_key) DO NOTHING",
                (receiver, request.idempotency_key, request.url, json.dumps(dict(request.headers)),
                 bytes(request.body), now, now))
            return cur.lastrowid if cur.rowcount == 1 else None  # a row inserted: lastrowid is its id

        item_id = self._run(insert)
        if item_id is None:
            log.debug("outbox: %r for receiver %r is already pending; not enqueued again",
                      request.idempotency_key, receiver)
        return item_id

    def submit(self, receiver: Receiver, notification: Notification, *,
               notifier: Notifier | None = None) -> list[int]:
        """Render ``notification`` for ``receiver`` and enqueue every request; the new ids.

        A disabled receiver (``url`` None) gets nothing enqueued: returns [] (the caller logs).
        """
        if receiver.url is None:
            return []
        notifier = notifier or notifier_for(receiver)
        ids = []
        for request in notifier.render(notification):
            item_id = self.enqueue(receiver.name, request)
            if item_id is not None:
                ids.append(item_id)
        return ids

    def delivered(self, item_id: int) -> None:
        """The receiver answered 2xx: forget the item."""
        self._run(lambda db: db.execute("DELETE FROM outbox WHERE id = ?", (item_id,)))

    def retry_later(self, item_id: int, delay: float, error: str) -> None:
        """Count a failed attempt and make the item due again ``delay`` seconds from now."""
        when = self.clock() + max(0.0, float(delay))
        self._run(lambda db: db.execute(
            "UPDATE outbox SET attempts = attempts + 1, next_attempt_at = ?, last_error = ? WHERE id = ?",
            (when, error, item_id)))

    def give_up(self, item_id: int, error: str, *, attempted: bool = True) -> None:
        """Move the item to the dead-letter table (with the error, the redacted URL) and report it."""
        now = self.clock()

        def move(db: sqlite3.Connection) -> tuple[str, int] | None:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT receiver, idempotency_key, url, body, attempts, created_at"
                                 " FROM outbox WHERE id = ?", (item_id,)).fetchone()
                if row is None:
                    db.execute("ROLLBACK")
                    return None
                receiver, key, url, body, attempts, created = row
                attempts = int(attempts) + (1 if attempted else 0)
                db.execute("INSERT INTO dead_letter (outbox_id, receiver, idempotency_key, url, body, attempts,"
                           " created_at, failed_at, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (item_id, receiver, key, redact_url(url), body, attempts, created, now, error))
                db.execute("DELETE FROM outbox WHERE id = ?", (item_id,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return receiver, attempts

        moved = self._run(move)
        if moved is not None:
            log.error("notification %d for receiver %r failed permanently after %d attempt(s): %s "
                      "(kept in the dead_letter table of %s)", item_id, moved[0], moved[1], error, self.path)

    # -- reading -----------------------------------------------------------------------------
    def due(self, limit: int = 100) -> list[OutboxItem]:
        """Pending items whose ``next_attempt_at`` has come, oldest due first."""
        now = self.clock()
        rows = self._run(lambda db: db.execute(
            "SELECT id, receiver, idempotency_key, url, headers, body, attempts, created_at, next_attempt_at,"
            " last_error FROM outbox WHERE next_attempt_at <= ? ORDER BY next_attempt_at, id LIMIT ?",
            (now, int(limit))).fetchall())
        items = []
        for item_id, receiver, key, url, headers, body, attempts, created, next_at, error in rows:
            request = OutgoingRequest(url=url, body=bytes(body), headers=json.loads(headers), idempotency_key=key)
            items.append(OutboxItem(id=int(item_id), receiver=receiver, request=request, attempts=int(attempts),
                                    created_at=float(created), next_attempt_at=float(next_at), last_error=error))
        return items

    def pending(self) -> int:
        return int(self._run(lambda db: db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]))

    def next_due_at(self) -> float | None:
        """When the earliest pending item becomes due (None when nothing is pending)."""
        value = self._run(lambda db: db.execute("SELECT MIN(next_attempt_at) FROM outbox").fetchone()[0])
        return None if value is None else float(value)

    def dead_letters(self) -> list[dict]:
        rows = self._run(lambda db: db.execute(
            "SELECT id, outbox_id, receiver, idempotency_key, url, body, attempts, created_at, failed_at, error"
            " FROM dead_letter ORDER BY id").fetchall())
        names = ("id", "outbox_id", "receiver", "idempotency_key", "url", "body", "attempts", "created_at",
                 "failed_at", "error")
        out = []
        for row in rows:
            record = dict(zip(names, row, strict=True))
            record["body"] = bytes(record["body"]).decode("utf-8", errors="replace")
            out.append(record)
        return out


# -- sending -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendResult:
    """What one POST came to: an HTTP status, or None when no valid response arrived."""

    status: int | None
    error: str = ""
    retry_after: str | None = field(default=None)  # the raw Retry-After header, if any
    permanent: bool = False  # no status, but retrying cannot help (e.g. an invalid URL)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _scrub(text: str, request: OutgoingRequest) -> str:
    """Remove anything secret-looking that a receiver might echo: the URL, its path and query, header values."""
    secrets = [request.url]
    try:
        parts = urlsplit(request.url)
        secrets += [parts.path, parts.query, parts.netloc]
        secrets += [seg for seg in parts.path.split("/") if len(seg) >= 6]
    except ValueError:
        pass
    secrets += [str(v) for k, v in request.headers.items()
                if k.lower() not in ("content-type", "user-agent", "idempotency-key")]
    try:  # PagerDuty's routing key travels in the body
        payload = json.loads(request.body)
        if isinstance(payload, dict) and payload.get("routing_key"):
            secrets.append(str(payload["routing_key"]))
    except (ValueError, UnicodeError):
        pass
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return text


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'connection error'}"
    return f"{type(exc).__name__} (malformed or missing response)"


def send_request(request: OutgoingRequest, timeout: float) -> SendResult:
    """POST ``request`` once, within about ``timeout`` seconds overall; never raises for network trouble.

    Uses :mod:`http.client` directly: no proxies from the environment, no redirects followed.
    """
    deadline = time.monotonic() + max(0.001, float(timeout))

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        return left

    try:
        parts = urlsplit(request.url)
        host, port = parts.hostname, parts.port
        if parts.scheme not in ("http", "https") or not host:
            raise ValueError("bad URL")
    except ValueError:
        return SendResult(None, "invalid URL (scheme, host or port)", permanent=True)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=remaining())
    try:
        conn.connect()
        conn.sock.settimeout(remaining())
        headers = dict(request.headers)
        headers.setdefault("Content-Type", "application/json")
        conn.request("POST", path, body=request.body, headers=headers)
        sock = conn.sock
        sock.settimeout(remaining())
        response = conn.getresponse()  # may detach conn.sock (Connection: close); the response keeps it open
        status = int(response.status)
        error = ""
        if not 200 <= status < 300:
            snippet = b""
            try:
                sock.settimeout(remaining())
                snippet = response.read(_ERROR_BODY_BYTES)
            except Exception:  # best effort: the status is what matters
                pass
            text = snippet.decode("utf-8", errors="replace").strip()
            text = "".join(ch if ch.isprintable() else " " for ch in text)[:200]
            error = f"HTTP {status} {str(response.reason)[:80]}".strip() + (f": {text}" if text else "")
            error = _scrub(error, request)
        return SendResult(status, error, retry_after=response.getheader("Retry-After"))
    except (http.client.InvalidURL, UnicodeError) as exc:
        return SendResult(None, _describe_exception(exc), permanent=True)
    except Exception as exc:  # timeouts, refused connections, TLS errors, garbage responses
        return SendResult(None, _describe_exception(exc))
    finally:
        conn.close()


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP-date); None if absent/invalid."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


def backoff_delay(failures: int, base: float, cap: float, rng: random.Random) -> float:
    """Full jitter: ``uniform(0, min(cap, base * 2**failures))`` (``failures`` = failed attempts before this one)."""
    ceiling = min(float(cap), float(base) * (2.0 ** min(int(failures), 60)))
    return rng.uniform(0.0, max(0.0, ceiling))


class Dispatcher:
    """Sends due outbox items; retries 5xx, timeouts, connection errors and 429 (honouring
    Retry-After seconds or HTTP-date) with exponential backoff and full jitter (``base_delay``,
    ``max_delay``, and ``max_attempts`` from the Receiver); other 4xx are permanent: give_up +
    reported; never blocks the caller (sending happens on :meth:`run_once`'s caller, normally the
    thread :meth:`start` runs).

    ``on_result(receiver_name, outcome)`` is called after every attempt with outcome
    ``"delivered"``, ``"retry"`` or ``"failed"`` (for ``notifications_total{receiver,outcome}``).
    ``clock`` defaults to the outbox's clock (used to read Retry-After HTTP-dates).
    """

    def __init__(self, outbox: Outbox, receivers: Mapping[str, Receiver], *,
                 on_result: Callable[[str, str], None] | None = None, base_delay: float = 1.0,
                 max_delay: float = 300.0, rng: random.Random | None = None,
                 clock: Callable[[], float] | None = None,
                 sender: Callable[[OutgoingRequest, float], SendResult] = send_request) -> None:
        self.outbox = outbox
        self.receivers = receivers
        self.on_result = on_result
        self.base_delay = float(base_delay)
        self.max_delay = float(max_delay)
        self.rng = rng or random.Random()
        self.clock = clock or outbox.clock
        self.sender = sender
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _report(self, receiver: str, outcome: str) -> None:
        if self.on_result is None:
            return
        try:
            self.on_result(receiver, outcome)
        except Exception:
            log.exception("on_result callback failed for receiver %r", receiver)

    def run_once(self) -> int:
        """Send everything due now, one request after another; how many were attempted."""
        items = self.outbox.due()
        for item in items:
            self._attempt(item)
        return len(items)

    def _attempt(self, item: OutboxItem) -> None:
        receiver = self.receivers.get(item.receiver)
        if receiver is None or receiver.url is None:
            why = "is no longer configured" if receiver is None else "is disabled (no URL)"
            self.outbox.give_up(item.id, f"receiver {item.receiver!r} {why}", attempted=False)
            self._report(item.receiver, "failed")
            return
        result = self.sender(item.request, receiver.timeout_seconds)
        if result.ok:
            self.outbox.delivered(item.id)
            if item.attempts:
                log.info("notification %d delivered to receiver %r after %d retries",
                         item.id, item.receiver, item.attempts)
            self._report(item.receiver, "delivered")
            return
        status = result.status
        error = result.error or (f"HTTP {status}" if status is not None else "no response")
        retryable = (status is None and not result.permanent) or status == 429 or (
            status is not None and 500 <= status < 600)
        if not retryable:
            self.outbox.give_up(item.id, f"permanent failure: {error}")
            self._report(item.receiver, "failed")
            return
        attempts = item.attempts + 1
        if attempts >= max(1, int(receiver.max_attempts)):
            self.outbox.give_up(item.id, f"gave up after {attempts} attempts; last error: {error}")
            self._report(item.receiver, "failed")
            return
        delay = None
        if status in (429, 503):
            delay = parse_retry_after(result.retry_after, self.clock())
        if delay is None:
            delay = backoff_delay(item.attempts, self.base_delay, self.max_delay, self.rng)
        log.warning("notification %d to receiver %r (%s) failed (attempt %d of %d): %s; retrying in %.1f s",
                    item.id, item.receiver, redact_url(item.request.url), attempts, receiver.max_attempts,
                    error, delay)
        self.outbox.retry_later(item.id, delay, error)
        self._report(item.receiver, "retry")

    # -- background thread ------------------------------------------------------------------
    def start(self, interval: float = 1.0) -> None:
        """Run :meth:`run_once` on a daemon thread every ``interval`` seconds until :meth:`stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(float(interval),),
                                        name="mla-watch-notify", daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            busy = False
            try:
                busy = self.run_once() >= 100
            except Exception:
                log.exception("notification dispatcher: run failed; trying again in %.1f s", interval)
            if not busy:
                self._stop.wait(interval)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it (an in-flight request finishes or times out first)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
