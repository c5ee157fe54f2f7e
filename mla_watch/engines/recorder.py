"""Counting SGLang's expert-distribution recorder: every token the engine routed, not only the ones it returned.

Responses carry routing only when a client asks for it; the recorder counts every forward
pass of the engine. In ``stat`` mode (``--expert-distribution-recorder-mode stat``) a POST to
``/dump_expert_distribution_record`` makes rank 0 write the counts since the last dump to
``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_{time.time()}.pt``
and resets them, so the files are disjoint and each is counted once, then deleted. A file
holds ``dict(rank, logical_count, average_utilization_rate_over_window)`` where
``logical_count`` is an int32 ring buffer ``[buffer_size, num_hidden_layers, experts]``: one
row per forward pass, summed over ranks, dense layers' rows zero, rows never written zero
(SGLang ``python/sglang/srt/eplb/expert_distribution.py``, ``_StatAccumulator``). The counts
go to the ``unattributed`` business line: no request can be told apart in them.

The directory is a shared volume, so a file in it may be anything. Each dump is consumed
exactly once: counted whole, or set aside with its reason in
``mla_watch_engine_recorder_rejected_total{reason}`` (deleted, or where it cannot be, never
read again). Before anything is materialised it must be the uncompressed zip ``torch.save``
writes, and ``logical_count`` a dense, contiguous integer tensor no larger than
:data:`MAX_DUMP_PASSES` rows whose storage backs every element it declares; then its counts
must be those of forward passes (>= 0, within int32, every MoE layer of a pass counting the
same tokens x top-k, no expert more than once per token) before any is added. ``torch.save``
writes in place, so a half-written dump has its final name: a file that fails these checks
is set aside only once it has settled (unchanged for ``settle_seconds``), one that changes
while read is left for the next poll, and a young one is counted only whole (the zip's
central directory, written last, must be there). Log lines about files are limited to one
per reason a minute and name numbers, shapes and dtypes, never the file's keys or values.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from mla_watch.engines.recorder_dump import (
    MAX_DUMP_BYTES,
    MAX_DUMP_PASSES,
    REJECT_REASONS,
    STAT_MODE,
    Dump,
    DumpError,
    read_dump,
)
from mla_watch.engines.watch import LOG_EVERY_SECONDS, UNATTRIBUTED_LINE, EngineRouting
from mla_watch.routing.routers import CountDelta

__all__ = [
    "DUMP_NAME_RE",
    "MAX_DUMP_BYTES",
    "MAX_DUMP_PASSES",
    "OUTCOMES",
    "RECORDER_ENGINE",
    "REJECT_REASONS",
    "Dump",
    "DumpError",
    "RecorderPoller",
    "read_dump",
]

log = logging.getLogger("mla_watch.engines.recorder")

RECORDER_ENGINE = "sglang"  # whose recorder it is: the engine its counts are labelled with, where no answer is read
START_PATH = "/start_expert_distribution_record"
DUMP_PATH = "/dump_expert_distribution_record"
# Rank 0's file in stat mode; the group is the time.time() of the dump, the order files are read in.
DUMP_NAME_RE = re.compile(r"expert_distribution_recorder_([0-9]+(?:\.[0-9]+)?)\.pt")
# per_pass / per_token write one file per rank, of another layout (records, not counts).
RANK_DUMP_RE = re.compile(r"expert_distribution_recorder_[0-9]+(?:\.[0-9]+)?_[0-9]+\.pt")
OUTCOMES = ("counted", "empty", "ring_full", "error")
# What identifies one version of a file: inode, size, mtime (ns). Any change means it is still being written.
Signature = tuple[int, int, int]


def _signature(info: os.stat_result) -> Signature:
    return (info.st_ino, info.st_size, info.st_mtime_ns)


class RecorderPoller:
    """Dumps an SGLang engine's expert-distribution recorder every ``interval`` seconds and counts the files.

    ``directory`` is the engine's ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` as this process
    sees it (a shared volume); ``buffer_size`` the engine's
    ``--expert-distribution-recorder-buffer-size`` (``-1``: an unbounded buffer, which never
    wraps), used to tell when the ring wrapped and passes were lost. A file that is no valid
    dump is set aside only once it has settled: its mtime ``settle_seconds`` old on ``clock``
    (wall-clock seconds, as mtimes are), or unchanged since a look that long ago (which a
    clock skewed against the volume's cannot hold back). ``clock`` also paces the log lines.

    ``max_dump_bytes`` and ``max_passes`` bound a file and the rows its tensor may declare (defaults
    :data:`MAX_DUMP_BYTES` and :data:`MAX_DUMP_PASSES`, the buffer size where that is larger); ``reader``
    reads one dump (:func:`read_dump`) and ``unlink`` deletes a counted file (:func:`os.unlink`).
    """

    def __init__(
        self,
        directory: Path,
        engine_url: str,
        routing: EngineRouting,
        *,
        interval: float = 10.0,
        buffer_size: int = 1000,
        timeout: float = 10.0,
        settle_seconds: float = 2.0,
        clock: Callable[[], float] = time.time,
        credentials: tuple[str, str] | None = None,
        max_dump_bytes: int = MAX_DUMP_BYTES,
        max_passes: int = MAX_DUMP_PASSES,
        reader: Callable[..., Dump] | None = None,
        unlink: Callable[[Path], None] = os.unlink,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"recorder interval {interval!r}: expected a number of seconds > 0")
        if not timeout > 0:
            raise ValueError(f"recorder timeout {timeout!r}: expected a number of seconds > 0")
        if type(buffer_size) is not int or not (buffer_size >= 1 or buffer_size == -1):
            raise ValueError(
                f"recorder buffer size {buffer_size!r}: expected the engine's "
                "--expert-distribution-recorder-buffer-size, an integer >= 1 or -1 (unbounded)"
            )
        if (
            isinstance(settle_seconds, bool)
            or not isinstance(settle_seconds, (int, float))
            or not (math.isfinite(settle_seconds) and settle_seconds >= 0)
        ):
            raise ValueError(
                f"recorder settle seconds {settle_seconds!r}: expected a number of seconds >= 0, how "
                "long a dump file must stay unchanged before it is read"
            )
        self.directory = Path(directory)
        self.engine_url = engine_url.rstrip("/")  # shown in logs: credentials come apart, in `credentials`
        self._credentials = credentials
        self.routing = routing
        self.interval = float(interval)
        self.buffer_size = buffer_size
        self.timeout = float(timeout)
        self.settle_seconds = float(settle_seconds)
        self._clock = clock
        self.max_dump_bytes = max_dump_bytes
        self.max_passes = max_passes
        self._read = read_dump if reader is None else reader
        self._unlink = unlink
        self._lock = threading.Lock()  # one poll at a time: a file must not be counted by two
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()
        self._recording = False  # the engine answered the start request (again after it was unreachable)
        self._skipped: set[str] = set()  # set aside but not deleted (too large, undeletable): never read again
        self._looks: dict[str, tuple[Signature, float]] = {}  # a file's version, and when it was first seen so
        self._logged: set[str] = set()
        self._limited: dict[str, tuple[float, int]] = {}  # log key -> (last logged, suppressed since)
        self._log_lock = threading.Lock()

    # -- the thread ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start recording on the engine, then poll every ``interval`` seconds, in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mla-watch-recorder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it (a poll in flight finishes first)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._recording:
                # start resets the engine's counts: it is sent once, and again only after the engine was
                # unreachable (a restarted engine records nothing until asked).
                self._recording = self._post(START_PATH) is None
                if self._recording:
                    log.info(
                        "SGLang expert-distribution recorder started at %s; dumping every %g s into %s",
                        self.engine_url,
                        self.interval,
                        self.directory,
                    )
            else:
                try:
                    self.poll_once()
                except Exception as error:  # a bug must not end the thread: the next round may succeed
                    # The type only: an exception's text may quote a file's content.
                    self._log_limited(
                        "poll",
                        f"SGLang recorder poll failed ({type(error).__name__}); retrying every {self.interval:g} s",
                    )
            self._stop.wait(self.interval)

    # -- one round -------------------------------------------------------------------------------------

    def poll_once(self) -> list[str]:
        """Ask the engine for a dump, then consume every dump file there is; one outcome per file consumed."""
        with self._lock:
            failure = self._post(DUMP_PATH)
            if failure is not None and not failure.startswith("HTTP "):
                self._recording = False  # unreachable: it may come back as a new process, not recording
            return self._consume()

    def consume(self) -> list[str]:
        """Consume the dump files already in ``directory`` (no request); one outcome per file consumed, oldest first."""
        with self._lock:
            return self._consume()

    def _consume(self) -> list[str]:
        outcomes = []
        for name, signature, settled in self._pending():
            try:
                outcome = self._consume_file(name, signature, settled)
            except Exception as error:  # whatever one file does, the ones after it are still read
                self._skipped.add(name)  # the same file would fail the same way: never read again
                outcome = self._reject(
                    self.directory / name,
                    "unexpected",
                    f"{self.directory / name}: failed ({type(error).__name__}); it is left there and not read again",
                )
            if outcome is None:
                continue
            self.routing.metrics.recorder_dumps.labels(outcome).inc()
            outcomes.append(outcome)
        return outcomes

    def _pending(self) -> list[tuple[str, Signature, bool]]:
        """Rank 0's stat dumps, oldest first, with the version seen and whether it settled; others are left alone."""
        found: list[tuple[float, str, Signature, bool]] = []
        names: set[str] = set()
        now = self._clock()
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    names.add(entry.name)
                    match = DUMP_NAME_RE.fullmatch(entry.name)
                    if match is None:
                        if RANK_DUMP_RE.fullmatch(entry.name):
                            self._warn_once(
                                "per_rank",
                                "%s: a per_pass or per_token recorder dump; these modes "
                                "are not supported and their files are left alone: expected the "
                                "engine started with %s",
                                self.directory / entry.name,
                                STAT_MODE,
                            )
                        continue
                    if entry.name in self._skipped or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:  # gone since the listing, or not ours to stat: the next poll looks again
                        continue
                    signature = _signature(info)
                    settled = self._settled(entry.name, signature, info.st_mtime_ns / 1e9, now)
                    found.append((float(match.group(1)), entry.name, signature, settled))
        except OSError as error:
            self._warn_once(
                f"scandir:{error.errno}",
                "%s: cannot list the recorder directory (%s); expected the "
                "engine's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, readable and writable here",
                self.directory,
                error.strerror or type(error).__name__,
            )
            return []
        self._skipped &= names  # a name gone from the directory may come back as a new dump
        self._looks = {name: look for name, look in self._looks.items() if name in names}
        return [(name, signature, settled) for _, name, signature, settled in sorted(found)]

    def _settled(self, name: str, signature: Signature, mtime: float, now: float) -> bool:
        """Whether the writer is done: torch.save writes in place, so a half-written dump has its final name."""
        seen = self._looks.get(name)
        if seen is None or seen[0] != signature:
            seen = self._looks[name] = (signature, now)
        return now - mtime >= self.settle_seconds or now - seen[1] >= self.settle_seconds

    def _consume_file(self, name: str, signature: Signature, settled: bool) -> str | None:
        """Count one dump, or set it aside; its outcome, or ``None`` where it is no file to count (yet).

        A file not yet ``settled`` is counted if it is a whole, valid dump: torch.save writes the zip's central
        directory last, so a file that loads was written to the end (and the engine answers a dump request only
        once its file is written, so a poll counts the dump it asked for). One that fails is left as it is until
        it settles: it may be half-written, and only a settled file is set aside.
        """
        path = self.directory / name
        # No symlink, and no FIFO to block on, even where the name changed since the listing.
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:  # deleted between the listing and now (by someone else): not ours
            return None
        except OSError as error:
            self._skipped.add(name)
            why = error.strerror or type(error).__name__
            return self._reject(
                path, "unreadable", f"{path}: cannot be opened ({why}); it is left there and not read again"
            )
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None
            if _signature(info) != signature:  # replaced or written to since listed: the next poll looks again
                return None
            if info.st_size > self.max_dump_bytes:
                self._skipped.add(name)
                return self._reject(
                    path,
                    "too_large",
                    f"{path}: {info.st_size} bytes, larger than "
                    f"{self.max_dump_bytes}; "
                    "expected a stat-mode recorder dump; it is left there and not read again",
                )
            dump: Dump | None = None
            reason = message = ""
            try:
                limit = max(self.max_passes, self.buffer_size)
                dump = self._read(handle, path, self.routing.geometry, max_passes=limit)
            except DumpError as error:
                reason, message = error.reason, str(error)
            except Exception as error:  # torch or numpy on a crafted tensor: it must not stop the poller
                reason, message = (
                    "unexpected",
                    (
                        f"{path}: reading it failed ({type(error).__name__}); expected a "
                        f"recorder dump written by {STAT_MODE}"
                    ),
                )
            if _signature(os.fstat(handle.fileno())) != signature:
                # Written to while read: a dump still being written, not a broken one. Nothing of it was added.
                self._looks.pop(name, None)
                return None
        if dump is None and not settled:
            return None  # perhaps half-written: read again at a later poll, set aside only once it settled
        outcome = self._apply(path, dump) if dump is not None else self._reject(path, reason, f"{message}; deleted")
        self._delete(path)
        return outcome

    def _apply(self, path: Path, dump: Dump) -> str:
        """Add a validated dump to the windows, every router or none."""
        if dump.recorded == 0:
            return "empty"
        geometry = self.routing.geometry
        # Built in full before the first add; read_dump checked what RollingWindow.add checks (1-D int64 rows of
        # num_experts, >= 0, tokens >= 0, a router of these windows), so no add can raise part-way through.
        deltas = [
            (name, CountDelta(row, dump.tokens)) for name, row in zip(geometry.router_names, dump.counts, strict=True)
        ]
        for name, delta in deltas:
            self.routing.windows.add(name, UNATTRIBUTED_LINE, delta)
        if self.buffer_size > 0 and dump.rows != self.buffer_size:
            self._log_limited(
                "rows",
                f"{path}: key 'logical_count' has {dump.rows} rows; expected {self.buffer_size}, "
                "the configured recorder buffer size: set it to the engine's --expert-distribution-"
                "recorder-buffer-size (-1 for an unbounded buffer), or a wrapped ring goes unnoticed",
            )
        if self.buffer_size > 0 and dump.recorded >= self.buffer_size:
            self._log_limited(
                "ring_full",
                f"{path}: all {dump.rows} rows of the recorder's ring buffer are filled, "
                "so older forward passes were overwritten and not counted; dump more often (a lower "
                f"--sglang-recorder-interval than {self.interval:g} s) or raise the engine's "
                "--expert-distribution-recorder-buffer-size",
            )
            return "ring_full"
        return "counted"

    def _reject(self, path: Path, reason: str, message: str) -> str:
        """Count a file set aside uncounted, by reason; its outcome."""
        self.routing.metrics.recorder_rejected.labels(reason).inc()
        self._log_limited(f"reject:{reason}", message)
        return "error"

    def _delete(self, path: Path) -> None:
        try:
            self._unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self._skipped.add(path.name)  # consumed already: never again
            self._warn_once(
                f"unlink:{error.errno}",
                "%s: read, but cannot be deleted (%s); it and files like it "
                "are not read again, but they fill the directory: expected the recorder directory "
                "writable here",
                path,
                error.strerror or type(error).__name__,
            )

    # -- HTTP and logging ------------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                self._client = httpx.Client(
                    base_url=self.engine_url,
                    timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0)),
                    auth=httpx.BasicAuth(*self._credentials) if self._credentials else None,
                )
            return self._client

    def _post(self, path: str) -> str | None:
        """POST ``path`` to the engine; ``None`` on a 2xx answer, else the kind of failure (logged once)."""
        try:
            response = self._http().post(path)
        except httpx.HTTPError as error:
            kind, detail = type(error).__name__, str(error) or type(error).__name__
        else:
            if response.is_success:
                with self._log_lock:  # a later failure of a kind seen before is news again
                    self._logged = {key for key in self._logged if not key.startswith(path)}
                return None
            kind = f"HTTP {response.status_code}"
            detail = f"{kind}: {response.text[:200]!r}"
        self._warn_once(
            f"{path}:{kind}",
            "POST %s%s failed (%s); expected a 2xx answer from an SGLang server started with %s; retrying every %g s",
            self.engine_url,
            path,
            detail,
            STAT_MODE,
            self.interval,
        )
        return kind

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        """Warn of a condition of this set-up (bounded keys), once until it is cleared."""
        with self._log_lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.warning(message, *args)

    def _log_limited(self, key: str, message: str) -> None:
        """Warn at most once per ``LOG_EVERY_SECONDS`` per key, with how many were left out: files are many."""
        now = self._clock()
        with self._log_lock:
            last, suppressed = self._limited.get(key, (-math.inf, 0))
            if now - last < LOG_EVERY_SECONDS:
                self._limited[key] = (last, suppressed + 1)
                return
            self._limited[key] = (now, 0)
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        log.warning("%s%s", message, more)
