"""Where a routing statistic is heading: the history a trend rule reads, and the arithmetic it judges.

A trend rule (``trend:`` or ``predict:`` in a rules file) does not judge the latest window; it
judges the least-squares line through one series of the routing history over a look-back:

* ``trend`` judges the line's slope, in the metric's unit per hour or per day (Prometheus'
  ``deriv``);
* ``predict`` judges the line's value ``ahead`` seconds from now, with the line's intercept
  taken at now (Prometheus' ``predict_linear``).

The history is a :class:`TrendSource`: the durable routing history implements it, tests use an
in-memory one. No torch, no I/O here.

**Enough data to judge.** A line through a few points, or through points bunched at one end of
the look-back, extrapolates noise: a series is judged only when it has at least
:data:`MIN_POINTS` points and they span at least :data:`MIN_COVERAGE` (half) of the look-back.
Otherwise the instance is *not judged*, exactly like a window under ``min_tokens``: no breach,
no recovery, it keeps its state and timers (a sidecar that just started, or a router that went
quiet for hours, neither pages nor resolves on a guess).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["MIN_COVERAGE", "MIN_POINTS", "Fit", "TrendSource", "crossing_in", "enough_data", "fit", "format_crossing"]

MIN_POINTS = 6  # fewer points than this is not a trend
MIN_COVERAGE = 0.5  # the points must span at least this share of the look-back


@runtime_checkable
class TrendSource(Protocol):
    """A routing history that trend rules read (the durable history store implements it)."""

    def points(
        self, router: str, business_line: str, metric: str, since: float, until: float
    ) -> tuple[list[float], list[float]]:
        """(times, values) of one series within ``[since, until]`` (wall-clock seconds), sorted by time, no NaN.

        ``business_line`` is a line's name, or ``"all"`` (:data:`mla_watch.windows.ALL_LINES`) for
        the series of every line summed (records carry ``business_line`` None for it).
        """
        ...


@dataclass(frozen=True)
class Fit:
    """The least-squares line ``value = intercept + slope * (t - at)`` through one series."""

    slope: float  # metric units per second
    intercept: float  # the line's value at time ``at``
    at: float

    def value_at(self, t: float) -> float:
        return self.intercept + self.slope * (t - self.at)


def enough_data(times: Sequence[float], over: float) -> bool:
    """Whether ``times`` (sorted) are enough to judge a look-back of ``over`` seconds (see the module doc)."""
    return len(times) >= MIN_POINTS and times[-1] - times[0] >= MIN_COVERAGE * over


def fit(times: Sequence[float], values: Sequence[float], at: float) -> Fit:
    """The least-squares line through ``(times, values)``, its intercept taken at ``at``.

    As Prometheus' ``deriv`` / ``predict_linear``. Times are centred first: wall-clock seconds
    are ~1.7e9, and their squares would swamp a double's precision.
    """
    n = len(times)
    if n < 2 or n != len(values):
        raise ValueError(f"a line needs >= 2 points and as many values as times (got {n} and {len(values)})")
    t_mean = math.fsum(times) / n
    v_mean = math.fsum(values) / n
    stt = math.fsum((t - t_mean) ** 2 for t in times)
    stv = math.fsum((t - t_mean) * (v - v_mean) for t, v in zip(times, values, strict=True))
    slope = stv / stt if stt > 0 else 0.0
    return Fit(slope=slope, intercept=v_mean + slope * (at - t_mean), at=at)


def crossing_in(line: Fit, threshold: float, now: float, *, below: bool) -> float | None:
    """Seconds from ``now`` until ``line`` goes below (``below``) or above ``threshold``.

    0 when the line is already past it at ``now``; ``None`` when it never gets there (flat, or
    heading the other way).
    """
    gap = threshold - line.value_at(now)  # below: > 0 means past it already
    if (gap >= 0) if below else (gap <= 0):
        return 0.0
    if (line.slope >= 0) if below else (line.slope <= 0):
        return None
    return gap / line.slope


def format_crossing(seconds: float | None) -> str:
    """A crossing time as people read it: ``"2d 4h"``, ``"3h 20m"``, ``"now"``, or ``"never"``."""
    if seconds is None or not math.isfinite(seconds):
        return "never"
    minutes = round(seconds / 60.0)
    if minutes <= 0:
        return "now"
    days, rest = divmod(minutes, 1440)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    return f"{minutes}m"
