"""The time a stop may take, shared by every part that stops.

A pod's orchestrator sends SIGTERM and kills the process a grace period later (Kubernetes: 30 s unless the pod
says otherwise). ``serve`` ends within :data:`STOP_SECONDS` of SIGTERM whatever is in flight: uvicorn waits
:data:`CONNECTIONS_SECONDS` for the requests in flight, then the sidecar's parts stop within one
:class:`StopBudget` of :data:`PARTS_SECONDS` (each part waits only for what the budget has left: a part that
overruns leaves less to the next, never more in all). What a part has not finished by then is abandoned safely
by the part itself: a reference reading is discarded, a re-tune job is recorded as interrupted, counts still
queued are dropped and counted as dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CONNECTIONS_SECONDS", "PARTS_SECONDS", "STOP_SECONDS", "StopBudget"]

STOP_SECONDS = 10.0  # SIGTERM to the process's end, at most: the pod's grace must cover it
CONNECTIONS_SECONDS = 4.0  # uvicorn's wait for requests in flight (timeout_graceful_shutdown): a stream finishes
# The parts' stop after that; the rest of STOP_SECONDS is the interpreter's exit.
PARTS_SECONDS = 5.0


class StopBudget:
    """A deadline shared by the parts of one stop: :meth:`left` is what the next wait may take."""

    def __init__(self, seconds: float = PARTS_SECONDS, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.ends_at = clock() + seconds

    def left(self, at_most: float | None = None) -> float:
        """Seconds left (never below 0), and never above ``at_most`` where given."""
        left = max(0.0, self.ends_at - self._clock())
        return left if at_most is None else min(left, at_most)
