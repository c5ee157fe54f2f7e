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

A disk that is full or read-only does not stop a page. A request the file cannot take is *held* in
memory (at most ``max_held`` requests and ``max_held_bytes`` bytes of bodies; past either the oldest
is dropped, counted and logged) and delivered from there like any other; the outcome of a delivery
that cannot be recorded (a row to delete, a retry to count) is kept in memory too. At every
:meth:`Outbox.due` the outbox tries to write what it holds, oldest first, and once the disk takes it
again nothing held is lost: what is still undelivered is in the file, to survive a restart. Only a
restart while the disk is still refusing loses what is held (the log says how many).
"""

from __future__ import annotations

import functools
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from mla_watch.alerting import outbox_rows as rows
from mla_watch.alerting.notifiers import Notifier, OutgoingRequest, notifier_for, redact_url
from mla_watch.alerting.outbox_rows import OutboxItem
from mla_watch.alerting.sending import SendResult, backoff_delay, parse_retry_after, send_request
from mla_watch.alerting.vocabulary import Notification, Receiver
from mla_watch.common.sqlite import PrivateDatabase
from mla_watch.common.state_writes import StateWrites

__all__ = [
    "MAX_HELD",
    "MAX_HELD_BYTES",
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
# What becomes of a notification the outbox's file could not take (also counted by receiver and outcome).
HELD, DROPPED = "held", "dropped"
MAX_HELD = 1000  # requests held in memory while the disk refuses them ...
MAX_HELD_BYTES = 32 << 20  # ... and the bytes of their bodies


class OutboxError(RuntimeError):
    """The outbox cannot be opened or written (bad state directory, corrupt file, ...)."""


@dataclass
class _Unsaved:
    """What became of a row of the file that the file could not record yet."""

    outcome: str  # "delivered", "retry" or "dead"
    failures: int = 0  # retries to add to the row's attempts
    next_attempt_at: float = 0.0
    error: str = ""
    attempted: bool = True


class Outbox:
    """A SQLite-backed queue of outgoing requests (thread-safe; WAL mode; one file per state dir), with what the
    file cannot take held in memory (see the module docstring).

    ``writes``: told whether the file can be written (``/readyz``, the metrics, the log once per change);
    ``on_hold(receiver, outcome)``: called for every request held (``"held"``) or dropped past the bound.
    """

    def __init__(
        self,
        path: Path,
        *,
        clock: Callable[[], float] = time.time,
        writes: StateWrites | None = None,
        max_held: int = MAX_HELD,
        max_held_bytes: int = MAX_HELD_BYTES,
        on_hold: Callable[[str, str], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self.max_held = int(max_held)
        self.max_held_bytes = int(max_held_bytes)
        self.on_hold = on_hold
        self._lock = threading.Lock()
        self._held: dict[int, OutboxItem] = {}  # negative ids, oldest first: requests not in the file yet
        self._held_bytes = 0
        self._next_held = -1
        self._unsaved: dict[int, _Unsaved] = {}  # rows of the file whose outcome is not written yet
        self.dropped = 0  # held requests dropped past the bound since start
        directory = self.path.parent
        if not directory.is_dir():
            raise OutboxError(f"outbox {self.path}: state directory {directory} does not exist or is not a directory")
        self._store = PrivateDatabase(
            self.path, what="outbox", error=OutboxError, schema=rows.SCHEMA, synchronous="FULL", writes=writes
        )  # a page must survive a power cut

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._flush()
            if self._held or self._unsaved:
                log.error(
                    "outbox %s: closing with %d notification(s) held in memory that the file could not take: "
                    "they are lost (%d delivery outcome(s) not recorded: those may be sent again)",
                    self.path,
                    len(self._held),
                    len(self._unsaved),
                )
        self._store.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        return self._store.run(fn)

    def write_held(self) -> int:
        """Write what is held in memory to the file where the disk takes it now; how many are still held."""
        with self._lock:
            self._flush()
            return len(self._held)

    @property
    def held(self) -> int:
        """Requests held in memory because the file could not take them."""
        return len(self._held)

    # -- writing -----------------------------------------------------------------------------
    def enqueue(self, receiver: str, request: OutgoingRequest) -> int | None:
        """Store ``request`` for ``receiver`` (committed on return, or held in memory when the file cannot take it)
        and return its id (negative while held).

        None when an identical ``(receiver, idempotency_key)`` is still pending (not enqueued twice).
        """
        scheme = urlsplit(request.url).scheme if request.url else ""
        if scheme not in ("http", "https"):
            raise ValueError(f"receiver {receiver!r}: the request URL must be http(s), got {redact_url(request.url)}")
        now = self.clock()
        with self._lock:
            if any(
                item.receiver == receiver and item.request.idempotency_key == request.idempotency_key
                for item in self._held.values()
            ):
                return None
            if not self._held:  # else the file refused the last write: this one waits behind the older ones
                try:
                    item_id = self._insert(receiver, request, 0, now, now, None)
                except OutboxError:
                    pass
                else:
                    if item_id is None:
                        log.debug(
                            "outbox: %r for receiver %r is already pending; not enqueued again",
                            request.idempotency_key,
                            receiver,
                        )
                    return item_id
            return self._hold(
                OutboxItem(id=0, receiver=receiver, request=request, attempts=0, created_at=now, next_attempt_at=now)
            )

    def _insert(
        self, receiver: str, request: OutgoingRequest, attempts: int, created: float, next_at: float, error: str | None
    ) -> int | None:
        row = (receiver, request, attempts, created, next_at, error)
        return cast(int | None, self._run(lambda db: rows.insert_row(db, *row)))

    def _hold(self, item: OutboxItem) -> int:
        """Keep ``item`` in memory under a new negative id, dropping the oldest past the bounds (under the lock)."""
        item_id = self._next_held
        self._next_held -= 1
        self._held[item_id] = replace(item, id=item_id)
        self._held_bytes += len(item.request.body)
        self._report(item.receiver, HELD)
        while len(self._held) > self.max_held or (self._held_bytes > self.max_held_bytes and len(self._held) > 1):
            oldest = next(iter(self._held))
            dropped = self._held.pop(oldest)
            self._held_bytes -= len(dropped.request.body)
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.error(
                    "outbox %s: %d notification(s) held in memory, the most it holds (%d, %d bytes): dropped "
                    "the oldest, for receiver %r (%d dropped since start)",
                    self.path,
                    len(self._held),
                    self.max_held,
                    self.max_held_bytes,
                    dropped.receiver,
                    self.dropped,
                )
            self._report(dropped.receiver, DROPPED)
        return item_id

    def _report(self, receiver: str, outcome: str) -> None:
        if self.on_hold is None:
            return
        try:
            self.on_hold(receiver, outcome)
        except Exception:
            log.exception("on_hold callback failed for receiver %r", receiver)

    def _flush(self) -> None:
        """Write what is held, oldest first, and the outcomes not recorded yet; stop at the first refusal (under the
        lock)."""
        try:
            for item_id in list(self._unsaved):
                self._record(item_id, self._unsaved[item_id])
                del self._unsaved[item_id]
            for item_id in list(self._held):
                item = self._held[item_id]
                self._insert(
                    item.receiver, item.request, item.attempts, item.created_at, item.next_attempt_at, item.last_error
                )
                del self._held[item_id]
                self._held_bytes -= len(item.request.body)
                if not self._held:
                    log.info("outbox %s: every notification held in memory is in the file again", self.path)
        except OutboxError:
            return

    def _record(self, item_id: int, change: _Unsaved) -> None:
        if change.outcome == "delivered":
            self._run(lambda db: rows.delete_row(db, item_id))
        elif change.outcome == "retry":
            self._run(lambda db: rows.update_retry(db, item_id, change.failures, change.next_attempt_at, change.error))
        else:
            self._move_to_dead_letter(item_id, change.error, attempted=change.attempted, now=self.clock())

    def submit(self, receiver: Receiver, notification: Notification, *, notifier: Notifier | None = None) -> list[int]:
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
        with self._lock:
            if item_id < 0:
                item = self._held.pop(item_id, None)
                if item is not None:
                    self._held_bytes -= len(item.request.body)
                return
            self._change(item_id, _Unsaved("delivered"))

    def retry_later(self, item_id: int, delay: float, error: str) -> None:
        """Count a failed attempt and make the item due again ``delay`` seconds from now."""
        when = self.clock() + max(0.0, float(delay))
        with self._lock:
            if item_id < 0:
                item = self._held.get(item_id)
                if item is not None:
                    self._held[item_id] = replace(
                        item, attempts=item.attempts + 1, next_attempt_at=when, last_error=error
                    )
                return
            before = self._unsaved.get(item_id)
            self._change(item_id, _Unsaved("retry", (before.failures if before is not None else 0) + 1, when, error))

    def _change(self, item_id: int, change: _Unsaved) -> None:
        """Record ``change`` of a row in the file, or keep it in memory until the file takes it (under the lock)."""
        if item_id not in self._unsaved:
            try:
                self._record(item_id, change)
                return
            except OutboxError:
                pass
        self._unsaved[item_id] = change

    def give_up(self, item_id: int, error: str, *, attempted: bool = True) -> None:
        """Move the item to the dead-letter table (with the error, the redacted URL) and report it."""
        now = self.clock()
        with self._lock:
            if item_id < 0:
                item = self._held.pop(item_id, None)
                if item is None:
                    return
                self._held_bytes -= len(item.request.body)
                attempts = item.attempts + (1 if attempted else 0)
                try:
                    self._run(lambda db: rows.insert_dead_letter(db, item, attempts, now, error))
                    kept = f"kept in the dead_letter table of {self.path}"
                except OutboxError:
                    kept = "held in memory, not kept: the outbox's file cannot be written"
                log.error(
                    "notification for receiver %r failed permanently after %d attempt(s): %s (%s)",
                    item.receiver,
                    attempts,
                    error,
                    kept,
                )
                return
            if item_id in self._unsaved:
                before = self._unsaved[item_id]
                if before.outcome == "retry":  # the failures not recorded yet count too
                    error = f"{error} (after {before.failures} more failed attempt(s))"
                self._unsaved[item_id] = _Unsaved("dead", error=error, attempted=attempted)
                log.error(
                    "notification %d failed permanently: %s (moved to the dead_letter table of %s once the "
                    "file can be written)",
                    item_id,
                    error,
                    self.path,
                )
                return
            try:
                moved = self._move_to_dead_letter(item_id, error, attempted=attempted, now=now)
            except OutboxError:
                self._unsaved[item_id] = _Unsaved("dead", error=error, attempted=attempted)
                log.error(
                    "notification %d failed permanently: %s (moved to the dead_letter table of %s once the "
                    "file can be written)",
                    item_id,
                    error,
                    self.path,
                )
                return
        if moved is not None:
            log.error(
                "notification %d for receiver %r failed permanently after %d attempt(s): %s "
                "(kept in the dead_letter table of %s)",
                item_id,
                moved[0],
                moved[1],
                error,
                self.path,
            )

    def _move_to_dead_letter(self, item_id: int, error: str, *, attempted: bool, now: float) -> tuple[str, int] | None:
        move = functools.partial(rows.move_to_dead_letter, item_id=item_id, error=error, attempted=attempted, now=now)
        return cast(tuple[str, int] | None, self._run(move))

    # -- reading -----------------------------------------------------------------------------
    def due(self, limit: int = 100) -> list[OutboxItem]:
        """Pending items whose ``next_attempt_at`` has come, oldest due first: the file's and those held in memory
        (first, what is held is written to the file where it can be)."""
        now = self.clock()
        with self._lock:
            self._flush()
            unsaved = dict(self._unsaved)
            held = [item for item in self._held.values() if item.next_attempt_at <= now]
        try:
            stored = self._run(lambda db: rows.due_rows(db, now, int(limit) + len(unsaved)))
        except OutboxError as unreadable:  # the file cannot even be read: what is held still goes out
            log.debug("outbox %s: cannot read it: %s", self.path, unreadable)
            stored = []
        items = []
        for item in stored:
            change = unsaved.get(item.id)
            if change is not None:
                if change.outcome != "retry" or change.next_attempt_at > now:
                    continue  # delivered, dead, or not due again yet: only the memory knows
                failures = item.attempts + change.failures
                item = replace(item, attempts=failures, next_attempt_at=change.next_attempt_at, last_error=change.error)
            items.append(item)
        items += held
        items.sort(key=lambda item: (item.next_attempt_at, item.created_at))
        return items[:limit]

    def pending(self) -> int:
        """Requests not delivered yet: in the file and held in memory."""
        with self._lock:
            settled = sum(1 for change in self._unsaved.values() if change.outcome != "retry")
            held = len(self._held)
        try:
            stored = int(self._run(lambda db: db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]))
        except OutboxError:
            stored = settled
        return stored - settled + held

    def next_due_at(self) -> float | None:
        """When the earliest pending item becomes due (None when nothing is pending)."""
        with self._lock:
            times = [item.next_attempt_at for item in self._held.values()]
            times += [change.next_attempt_at for change in self._unsaved.values() if change.outcome == "retry"]
        value = self._run(lambda db: db.execute("SELECT MIN(next_attempt_at) FROM outbox").fetchone()[0])
        if value is not None:
            times.append(float(value))
        return min(times) if times else None

    def dead_letters(self) -> list[dict]:
        return cast(list[dict], self._run(rows.dead_letter_rows))


# -- sending -----------------------------------------------------------------------------------


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

    def __init__(
        self,
        outbox: Outbox,
        receivers: Mapping[str, Receiver],
        *,
        on_result: Callable[[str, str], None] | None = None,
        base_delay: float = 1.0,
        max_delay: float = 300.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] | None = None,
        sender: Callable[[OutgoingRequest, float], SendResult] = send_request,
    ) -> None:
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
                log.info(
                    "notification %d delivered to receiver %r after %d retries", item.id, item.receiver, item.attempts
                )
            self._report(item.receiver, "delivered")
            return
        status = result.status
        error = result.error or (f"HTTP {status}" if status is not None else "no response")
        retryable = (
            (status is None and not result.permanent) or status == 429 or (status is not None and 500 <= status < 600)
        )
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
        log.warning(
            "notification %d to receiver %r (%s) failed (attempt %d of %d): %s; retrying in %.1f s",
            item.id,
            item.receiver,
            redact_url(item.request.url),
            attempts,
            receiver.max_attempts,
            error,
            delay,
        )
        self.outbox.retry_later(item.id, delay, error)
        self._report(item.receiver, "retry")

    # -- background thread ------------------------------------------------------------------
    def start(self, interval: float = 1.0) -> None:
        """Run :meth:`run_once` on a daemon thread every ``interval`` seconds until :meth:`stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, args=(float(interval),), name="mla-watch-notify", daemon=True
        )
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
