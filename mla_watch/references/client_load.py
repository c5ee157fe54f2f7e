"""Whether clients wait longer than they usually do: what a reference reading beside an engine yields to.

:class:`ClientLatency` is told the latency of each proxied client request (the time the sidecar took to answer
it: the whole answer, or a stream's first bytes) and keeps two running levels: the recent one (the last few
requests) and the usual one (the last few hundred). :meth:`ClientLatency.busy` is true while the recent level
is above ``ratio`` times the usual one: the engine is loaded, by clients or by the reference prompts themselves,
and a reference reading waits (:class:`~mla_watch.references.readers.EngineReader`). A quiet engine (no client
request for ``quiet_seconds``) is never busy: nobody waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["ClientLatency"]

RECENT_WEIGHT = 0.25  # the recent level: about the last 4 requests
USUAL_WEIGHT = 0.01  # the usual level: about the last 100 requests
MIN_REQUESTS = 10  # before this many, no usual level is known: never busy


class ClientLatency:
    """The recent and usual latency of client requests; :meth:`busy` while the recent one is well above usual."""

    def __init__(
        self, *, ratio: float = 1.5, quiet_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not ratio > 1:
            raise ValueError(f"ratio {ratio!r}: expected a factor > 1")
        self.ratio = ratio
        self.quiet_seconds = quiet_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self.requests = 0
        self.recent = 0.0
        self.usual = 0.0
        self._last_at = -float("inf")

    def observe(self, seconds: float) -> None:
        """One client request answered in ``seconds``."""
        if not seconds >= 0:
            return
        with self._lock:
            if self.requests == 0:
                self.recent = self.usual = seconds
            else:
                self.recent += RECENT_WEIGHT * (seconds - self.recent)
                self.usual += USUAL_WEIGHT * (seconds - self.usual)
            self.requests += 1
            self._last_at = self._clock()

    def busy(self) -> bool:
        """Whether clients now wait more than ``ratio`` times their usual latency (and sent a request lately)."""
        with self._lock:
            if self.requests < MIN_REQUESTS or self._clock() - self._last_at > self.quiet_seconds:
                return False
            return self.recent > self.ratio * self.usual
