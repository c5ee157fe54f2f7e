"""Routing entropy over the last hour, per router and business line: the status page's heat map.

The routing windows say how a router reads *now*; on-call opening a page wants *when* it went
wrong. :class:`RoutingHistory` keeps a ring buffer of samples of the routing records (one every
``interval_seconds``, the last ``span_seconds`` of them: 360 points for an hour at 10 s), and
:class:`HistorySampler` takes them on a background thread.

Memory is bounded by ``span / interval`` points times the (router, business line) pairs seen;
a series whose router or line stops appearing is dropped once its last value leaves the span.
A series appears with its first value: a router that never saw a token has no row.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mla_watch.windows import ALL_LINES

__all__ = ["HistorySampler", "RoutingHistory"]

log = logging.getLogger(__name__)



@dataclass
class _Series:
    router: str
    layer: int
    kind: str
    business_line: str
    floor_bits: float | None
    ceiling_bits: float | None
    num_slots: int | None = None


class RoutingHistory:
    """A bounded time series of ``entropy_bits`` per (router, business line).

    ``record(records)`` appends one point stamped ``clock()`` (wall-clock seconds, shown to
    people); ``snapshot(since)`` returns the points newer than ``since`` with every series
    aligned to them (``None`` where a series had no value or its window held no token).
    Values are kept in flat arrays (NaN for none): an hour of a DeepSeek-V3.2 (119 routers,
    5 lines) takes about 2 MiB.
    """

    def __init__(self, *, span_seconds: float = 3600.0, interval_seconds: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        for name, value in (("span_seconds", span_seconds), ("interval_seconds", interval_seconds)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} = {value!r}: expected a positive number of seconds")
        if interval_seconds > span_seconds:
            raise ValueError(f"interval_seconds = {interval_seconds!r}: expected at most span_seconds "
                             f"({span_seconds!r})")
        self.span_seconds = float(span_seconds)
        self.interval_seconds = float(interval_seconds)
        self.clock = clock
        self._lock = threading.Lock()
        self._times: list[float] = []
        # per series, aligned with _times: entropy bits (NaN: no value) and too_small flags
        self._values: dict[tuple[str, str], array[float]] = {}
        self._too_small: dict[tuple[str, str], bytearray] = {}
        self._series: dict[tuple[str, str], _Series] = {}

    def record(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append one point from routing records (``RouterWindows.stats`` of every line and of None)."""
        now = round(self.clock(), 3)  # as shown: a client passes it back as `since`
        point: dict[tuple[str, str], tuple[float, bool]] = {}
        series: dict[tuple[str, str], _Series] = {}
        for record in records:
            line = record.get("business_line") or ALL_LINES
            key = (str(record["name"]), str(line))
            series[key] = _Series(str(record["name"]), int(record.get("layer", -1)), str(record.get("kind", "")),
                                  str(line), record.get("floor_bits"), record.get("ceiling_bits"),
                                  record.get("num_slots"))
            bits = record.get("entropy_bits")
            if record.get("tokens") and bits is not None and math.isfinite(bits):
                point[key] = (round(float(bits), 4), bool(record.get("too_small")))
        with self._lock:
            if self._times and now < self._times[-1]:  # the wall clock stepped back: start over
                self._times.clear()
                self._values.clear()
                self._too_small.clear()
                self._series.clear()
            before = len(self._times)
            self._times.append(now)
            for key in point.keys() - self._values.keys():
                self._values[key] = array("d", [math.nan] * before)
                self._too_small[key] = bytearray(before)
            self._series.update((key, info) for key, info in series.items() if key in self._values)
            for key, values in self._values.items():
                value, too_small = point.get(key, (math.nan, False))
                values.append(value)
                self._too_small[key].append(too_small)
            self._expire(now)

    def _expire(self, now: float) -> None:
        old = bisect.bisect_left(self._times, now - self.span_seconds)
        if not old:
            return
        del self._times[:old]
        for key in list(self._values):
            values = self._values[key]
            del values[:old]
            del self._too_small[key][:old]
            if all(math.isnan(value) for value in values):  # nothing left to show
                del self._values[key], self._too_small[key], self._series[key]

    def __len__(self) -> int:
        return len(self._times)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        """JSON-ready: ``{"interval_seconds", "span_seconds", "times", "series": [...]}``.

        Each series: ``router, layer, kind, business_line, floor_bits, ceiling_bits, num_slots``, ``values``
        (entropy bits or ``None``, one per time) and ``too_small`` (the window held fewer tokens
        than the router's trusted minimum), sorted by business line, layer and router.
        """
        with self._lock:
            start = 0 if since is None else bisect.bisect_right(self._times, since)
            times = self._times[start:]
            columns = {key: (values[start:], self._too_small[key][start:]) for key, values in self._values.items()}
            series = sorted(self._series.items(), key=lambda item: (item[1].business_line != ALL_LINES,
                                                                    item[1].business_line, item[1].layer,
                                                                    item[1].router))
        out = []
        for key, info in series:
            values, too_small = columns[key]
            out.append({"router": info.router, "layer": info.layer, "kind": info.kind,
                        "business_line": info.business_line, "floor_bits": info.floor_bits,
                        "ceiling_bits": info.ceiling_bits, "num_slots": info.num_slots,
                        "values": [None if math.isnan(value) else value for value in values],
                        "too_small": [bool(flag) for flag in too_small]})
        return {"interval_seconds": self.interval_seconds, "span_seconds": self.span_seconds,
                "times": times, "series": out}


class _Recorder(Protocol):
    def record(self, records: Iterable[Mapping[str, Any]]) -> None: ...


class HistorySampler:
    """Calls ``history.record(records())`` every ``history.interval_seconds`` on a daemon thread, and
    ``sink.record`` with the same records for each of ``sinks`` (the durable store: its disk writes
    stay off the event loop)."""

    def __init__(self, history: RoutingHistory, records: Callable[[], list[dict[str, Any]]],
                 sinks: Iterable[_Recorder] = ()) -> None:
        self.history = history
        self._records = records
        self.sinks = list(sinks)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        try:
            records = self._records()
        except Exception:  # a bad sample must not end the history
            log.exception("sampling the routing history failed")
            return
        for target in (self.history, *self.sinks):
            try:
                target.record(records)
            except Exception:  # one target failing must not cost the other its point
                log.exception("recording the routing history in %s failed", type(target).__name__)

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
