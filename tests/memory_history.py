"""An in-memory routing history for tests: a :class:`~mla_watch.alerting.trend.TrendSource` filled from records.

Lets a test of the alert engine's trend rules place each sample at the time it chooses, without a state directory;
the durable history store (:class:`~mla_watch.history.store.HistoryStore`) implements the same protocol.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from mla_watch.alerting.vocabulary import METRICS
from mla_watch.routing.windows import RouterStats

__all__ = ["MemoryHistory"]


class MemoryHistory:
    """Every metric of every record, by (router, business line, metric), kept in time order."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}

    def add(self, at: float, records: Iterable[RouterStats]) -> None:
        """Record ``records`` as taken at ``at``; None / NaN values are skipped."""
        for record in records:
            for metric in METRICS:
                value = getattr(record.stats, metric)
                if value is None or math.isnan(value):
                    continue
                times, values = self._series.setdefault((record.router.name, record.line_label, metric), ([], []))
                if times and at < times[-1]:
                    raise ValueError(f"points must come in time order: {at} after {times[-1]}")
                times.append(at)
                values.append(float(value))

    def points(
        self, router: str, business_line: str, metric: str, since: float, until: float
    ) -> tuple[list[float], list[float]]:
        times, values = self._series.get((router, business_line, metric), ([], []))
        lo, hi = bisect.bisect_left(times, since), bisect.bisect_right(times, until)
        return times[lo:hi], values[lo:hi]
