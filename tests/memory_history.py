"""An in-memory routing history for tests: a :class:`~mla_watch.alerting.trend.TrendSource` filled from records.

Stands in for the durable history store (which implements the same protocol) until it is wired in.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

from mla_watch.alerting.model import METRICS
from mla_watch.windows import ALL_LINES

__all__ = ["MemoryHistory"]


class MemoryHistory:
    """Every metric of every record, by (router, business line, metric), kept in time order."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}

    def add(self, at: float, records: Iterable[Mapping[str, object]]) -> None:
        """Record ``records`` (RouterWindows.stats() records) as taken at ``at``; None / NaN values are skipped."""
        for record in records:
            line = record.get("business_line") or ALL_LINES
            for metric in METRICS:
                value = record.get(metric)
                if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
                    continue
                times, values = self._series.setdefault((str(record["name"]), str(line), metric), ([], []))
                if times and at < times[-1]:
                    raise ValueError(f"points must come in time order: {at} after {times[-1]}")
                times.append(at)
                values.append(float(value))

    def points(self, router: str, business_line: str, metric: str, since: float,
               until: float) -> tuple[list[float], list[float]]:
        times, values = self._series.get((router, business_line, metric), ([], []))
        lo, hi = bisect.bisect_left(times, since), bisect.bisect_right(times, until)
        return times[lo:hi], values[lo:hi]
