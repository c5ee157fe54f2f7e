"""One resolution of the durable routing history, in memory: a ring of points, each a row per series.

A :class:`Tier` holds the points of one step (10 s, 1 min, 15 min) newer than its retention:
``times`` (float64 seconds, increasing) and ``data`` (float32, ``[point, series, value]``, NaN for
none), in preallocated arrays so that appending, expiring and slicing a series' column are
numpy operations, never a Python loop over points. :func:`bucket_mean` is the downsampling rule;
:func:`roll` closes a coarser tier's bucket once the finer tier has left it, :func:`open_buckets` finds the
buckets still open in tiers loaded from the file or cut back by a step back of the clock.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Tier", "bucket_mean", "open_buckets", "roll"]


def bucket_mean(block: np.ndarray) -> np.ndarray:
    """The mean over axis 0 of the finite values (NaN where a column has none): one downsampled row."""
    finite = np.isfinite(block)
    sums = np.where(finite, block, 0.0).sum(axis=0, dtype=np.float64)
    counts = finite.sum(axis=0)
    out = np.full(sums.shape, np.nan, dtype=np.float64)
    np.divide(sums, counts, out=out, where=counts > 0)
    return out.astype(np.float32)


class Tier:
    """Points ``step`` seconds apart kept for ``retention`` seconds; rows grow to at most ``max_series`` columns."""

    def __init__(self, name: str, step: float, retention: float, values: int, max_series: int) -> None:
        self.name = name
        self.step = float(step)
        self.retention = float(retention)
        self.values = values
        self.max_series = max_series
        # Points a full retention holds when they come one per step (a sampler running a little fast
        # may add a few: the arrays then grow by the slack).
        self._expected = math.ceil(self.retention / self.step) + 2
        self._slack = max(8, self._expected // 8)
        self.times = np.empty(0, dtype=np.float64)
        self.data = np.empty((0, 0, values), dtype=np.float32)
        self.start = 0  # live points are [start, end)
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def live_times(self) -> np.ndarray:
        return self.times[self.start : self.end]

    @property
    def first(self) -> float | None:
        return float(self.times[self.start]) if self.end > self.start else None

    @property
    def last(self) -> float | None:
        return float(self.times[self.end - 1]) if self.end > self.start else None

    @property
    def columns(self) -> int:
        return self.data.shape[1]

    def nbytes(self) -> int:
        return self.times.nbytes + self.data.nbytes

    def append(self, t: float, row: np.ndarray) -> None:
        """Add the point at ``t`` (after :attr:`last`); ``row`` is ``[series, value]``, possibly narrower."""
        if self.end == len(self.times):
            self._make_room()
        if row.shape[0] > self.columns:
            self._widen(row.shape[0])
        self.times[self.end] = t
        self.data[self.end, : row.shape[0]] = row
        self.data[self.end, row.shape[0] :] = np.nan
        self.end += 1

    def _make_room(self) -> None:
        live = len(self)
        capacity = max(self._expected + self._slack, live + self._slack)
        if capacity == len(self.times) and self.start > 0:  # move the live points to the front
            self.times[:live] = self.times[self.start : self.end]
            self.data[:live] = self.data[self.start : self.end]
        else:
            times = np.empty(capacity, dtype=np.float64)
            data = np.full((capacity, self.columns, self.values), np.nan, dtype=np.float32)
            times[:live] = self.times[self.start : self.end]
            data[:live] = self.data[self.start : self.end]
            self.times, self.data = times, data
        self.start, self.end = 0, live

    def _widen(self, columns: int) -> None:
        # Doubling keeps the copies rare while series appear one by one; never past max_series.
        width = min(self.max_series, max(columns, 2 * self.columns, 8))
        data = np.full((len(self.times), width, self.values), np.nan, dtype=np.float32)
        data[:, : self.columns] = self.data
        self.data = data

    def expire(self, before: float) -> None:
        """Drop the points older than ``before``."""
        self.start += int(np.searchsorted(self.live_times(), before, side="left"))

    def truncate_after(self, t: float) -> int:
        """Drop the points newer than ``t`` (the wall clock stepped back); how many went."""
        keep = int(np.searchsorted(self.live_times(), t, side="right"))
        dropped = len(self) - keep
        self.end = self.start + keep
        return dropped

    def index(self, since: float, until: float, *, until_inclusive: bool = True) -> tuple[int, int]:
        """The array indices ``[lo, hi)`` of the points in ``[since, until]`` (``[since, until)``)."""
        times = self.live_times()
        lo = int(np.searchsorted(times, since, side="left"))
        hi = int(np.searchsorted(times, until, side="right" if until_inclusive else "left"))
        return self.start + lo, self.start + max(lo, hi)

    def clear_column(self, column: int) -> None:
        if column < self.columns:
            self.data[:, column] = np.nan


def open_buckets(tiers: tuple[Tier, ...]) -> list[float | None]:
    """Per tier but the coarsest, the bucket of the next tier being filled (None: none is)."""
    opened: list[float | None] = []
    # The bucket of the newest finer point is still open unless the coarser tier already holds it.
    for index in range(len(tiers) - 1):
        finer, coarser = tiers[index], tiers[index + 1]
        last = finer.last
        bucket = None if last is None else math.floor(last / coarser.step) * coarser.step
        opened.append(bucket if bucket is not None and (coarser.last is None or coarser.last < bucket) else None)
    return opened


def roll(tiers: tuple[Tier, ...], opened: list[float | None], now: float) -> list[tuple[str, float, np.ndarray]]:
    """Close the minute (and quarter) bucket ``now`` has left: their means, appended to the coarser tiers and
    returned to be written. ``opened`` (as :func:`open_buckets` gives it) is moved on in place."""
    closed: list[tuple[str, float, np.ndarray]] = []
    for index in range(len(tiers) - 1):
        finer, coarser = tiers[index], tiers[index + 1]
        stamp = now if index == 0 else (closed[-1][1] if closed else None)
        if stamp is None:
            break
        bucket = math.floor(stamp / coarser.step) * coarser.step
        bucket_open = opened[index]
        if bucket_open is not None and bucket > bucket_open:
            lo, hi = finer.index(bucket_open, bucket_open + coarser.step, until_inclusive=False)
            if hi > lo:
                mean = bucket_mean(finer.data[lo:hi])
                coarser.append(bucket_open, mean)
                closed.append((coarser.name, bucket_open, mean))
        if bucket_open is None or bucket > bucket_open:
            opened[index] = bucket
        if index == 0 and not closed:
            break
    return closed
