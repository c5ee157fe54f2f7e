"""The routing history's sampler: one sample of every router and business line per ``--history-interval``.

The routing windows say how a router reads *now*; on-call opening a page wants *when* it went wrong, and a
trend rule where it is heading. :class:`HistorySampler` takes the current :class:`~mla_watch.windows.RoutingSnapshot`
every ``interval_seconds`` on a background thread (the durable store's disk writes stay off the event loop) and
records it in the :class:`~mla_watch.history.store.HistoryStore`, whose ``full`` tier is also the status page's
live hour (its memory is stated there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from mla_watch.history.store import HistoryStore
from mla_watch.routing.windows import RouterStats, RoutingSnapshot

__all__ = ["HistorySampler"]

log = logging.getLogger(__name__)


class HistorySampler:
    """Calls ``history.record`` with the records of ``snapshot()`` (a :class:`RoutingSnapshot`, or its records)
    every ``history.interval_seconds`` on a daemon thread."""

    def __init__(self, history: HistoryStore, snapshot: Callable[[], RoutingSnapshot | Iterable[RouterStats]]) -> None:
        self.history = history
        self._snapshot = snapshot
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take one sample now; a failure is logged, and costs that sample only."""
        try:
            taken = self._snapshot()
            self.history.record(taken.records if isinstance(taken, RoutingSnapshot) else taken)
        except Exception:  # a bad sample must not end the history
            log.exception("sampling the routing history failed")

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mla-watch-history", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.history.interval_seconds):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
