"""Where the sidecar's blocking reads run, so that a crowd of public readers cannot starve monitoring.

Heavy public reads (``/v1/history``, ``/v1/status``: unauthenticated, up to megabytes of JSON each)
run on :class:`BoundedReads`, a few threads of their own with a bounded number of reads in flight
or queued; past that a read is refused at once with 429 and ``Retry-After`` instead of queueing
memory and CPU without end. ``/metrics`` and ``/v1/routing`` run on :func:`monitoring_executor`,
never behind them, and neither takes a thread of the default executor, which alert evaluation
and the other ``asyncio.to_thread`` work of the sidecar share.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from mla_watch.server.requests import ApiError

__all__ = [
    "MONITORING_WORKERS",
    "READS_ADMITTED",
    "READ_WORKERS",
    "RETRY_AFTER_SECONDS",
    "BoundedReads",
    "monitoring_executor",
]

READ_WORKERS = 2  # threads for heavy public reads: at most this many cores go to outside readers
READS_ADMITTED = 4  # heavy reads in flight or queued at once: a few answers' worth of memory, not a crowd's
RETRY_AFTER_SECONDS = 2  # about the time a 30-day history answer takes to build
MONITORING_WORKERS = 2  # /metrics and /v1/routing: a scrape is never queued behind the other

T = TypeVar("T")


def monitoring_executor() -> ThreadPoolExecutor:
    """The threads ``/metrics`` and ``/v1/routing`` build their answers on."""
    return ThreadPoolExecutor(max_workers=MONITORING_WORKERS, thread_name_prefix="mla-watch-monitoring")


class BoundedReads:
    """A small executor for heavy public reads that admits at most ``admitted`` of them at once."""

    def __init__(
        self, *, workers: int = READ_WORKERS, admitted: int = READS_ADMITTED, retry_after: int = RETRY_AFTER_SECONDS
    ) -> None:
        if not 1 <= workers <= admitted:
            raise ValueError(f"workers = {workers!r}, admitted = {admitted!r}: expected 1 <= workers <= admitted")
        self.workers = workers
        self.admitted = admitted
        self.retry_after = retry_after
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mla-watch-reads")
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Reads admitted and not finished (running or queued)."""
        with self._lock:
            return self._in_flight

    async def run(self, what: str, read: Callable[[], T]) -> T:
        """``read()`` on a read thread; raises a 429 :class:`ApiError` naming ``what`` when full.

        A read's place is given back when its thread is done with it, not when the client goes away:
        a disconnected client's read still running still counts.
        """
        if not self._admit():
            raise ApiError(
                429,
                f"{what} refused: {self.admitted} heavy reads (/v1/history, /v1/status) are already "
                f"running or queued, the most this sidecar takes at once so that /metrics and "
                f"/v1/routing keep answering; retry after {self.retry_after} s",
                code="too_many_reads",
                error_type="rate_limit_error",
                headers={"Retry-After": str(self.retry_after)},
            )
        try:
            future = self._executor.submit(read)
        except RuntimeError:  # shut down: the server is stopping
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _admit(self) -> bool:
        with self._lock:
            if self._in_flight >= self.admitted:
                return False
            self._in_flight += 1
            return True

    def _done(self, _future: Future | None) -> None:
        with self._lock:
            self._in_flight -= 1

    def shutdown(self) -> None:
        """Stop taking reads; queued ones are cancelled, running ones finish on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
