"""Rolling windows of routing counts.

:class:`RollingWindow` keeps the sum of the most recent count deltas, bounded by a
token budget and/or an age limit; :meth:`RollingWindow.totals` returns them as
:class:`WindowTotals`.  Both are re-exported by :mod:`mla_watch.routing.stats`.

This module depends on numpy only (no torch): it is imported by processes that never
load a model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from mla_watch.routing.checks import (
    as_int_counts,
    check_local_choice,
    check_nonnegative_int,
    check_positive_int,
)

__all__ = ["RollingWindow", "WindowTotals"]


@dataclass(frozen=True)
class WindowTotals:
    """Sums over the buckets a :class:`RollingWindow` currently keeps."""

    counts: np.ndarray  # int64, length num_slots
    tokens: int
    local_selections: int
    choice_selections: int
    buckets: int
    oldest: float | None  # clock time of the oldest bucket kept
    newest: float | None


@dataclass(frozen=True)
class _Bucket:
    timestamp: float
    slots: np.ndarray  # the slots this delta touched; deltas are sparse for indexers over long contexts
    counts: np.ndarray  # their counts
    tokens: int
    local_selections: int
    choice_selections: int


class RollingWindow:
    """Sum of the most recent count deltas, bounded by tokens and/or by age.

    Each :meth:`add` makes one bucket stamped with ``clock()``.  Eviction:

    * by tokens: while more than one bucket is kept and the tokens without the oldest
      bucket still reach ``max_tokens``, the oldest is dropped (so the window holds at
      least ``max_tokens`` when history allows, at bucket granularity);
    * by time: buckets stamped before ``clock() - max_seconds`` are dropped.

    Both apply when both are given; with neither the window is cumulative.  A running
    sum is kept, so :meth:`totals` costs O(evicted + num_slots).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        max_tokens: int | None = None,
        max_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int | None = None,
    ) -> None:
        self._num_slots = check_positive_int(num_slots, "num_slots")
        # Past this many buckets the two oldest merge: memory stays bounded however small the deltas,
        # and only the oldest part of the window loses its granularity.
        self._max_buckets = None if max_buckets is None else max(2, check_positive_int(max_buckets, "max_buckets"))
        if max_tokens is not None:
            max_tokens = check_positive_int(max_tokens, "max_tokens")
        if max_seconds is not None:
            seconds = float(max_seconds)
            if not (seconds > 0.0):
                raise ValueError(f"max_seconds must be > 0, got {max_seconds!r}")
            max_seconds = seconds
        self._max_tokens = max_tokens
        self._max_seconds = max_seconds
        self._clock = clock
        self._buckets: deque[_Bucket] = deque()
        self._counts = np.zeros(self._num_slots, dtype=np.int64)
        self._tokens = 0
        self._local = 0
        self._choice = 0
        self._cumulative_adds = 0
        self._cumulative_span: tuple[float, float] | None = None

    @property
    def num_slots(self) -> int:
        """Number of slots each count delta covers."""
        return self._num_slots

    def add(
        self,
        counts: ArrayLike,
        tokens: int,
        *,
        local_selections: int = 0,
        choice_selections: int = 0,
    ) -> None:
        """Add one bucket: a count delta of length ``num_slots`` over ``tokens`` tokens."""
        delta = as_int_counts(counts, self._num_slots)
        n_tokens = check_nonnegative_int(tokens, "tokens")
        local, choice = check_local_choice(local_selections, choice_selections)
        if n_tokens == 0 and local == 0 and choice == 0 and not np.any(delta):
            return
        self._counts += delta
        self._tokens += n_tokens
        self._local += local
        self._choice += choice
        stamp = float(self._clock())
        if self._max_tokens is None and self._max_seconds is None:
            # Cumulative: nothing is ever evicted, so the running sums are the whole window.
            self._cumulative_adds += 1
            self._cumulative_span = (self._cumulative_span[0] if self._cumulative_span else stamp, stamp)
            return
        slots = np.flatnonzero(delta)
        self._buckets.append(_Bucket(stamp, slots, delta[slots], n_tokens, local, choice))
        self._evict()
        while self._max_buckets is not None and len(self._buckets) > self._max_buckets:
            self._merge_oldest()

    def totals(self) -> WindowTotals:
        """Evict stale buckets, then return the sums over the buckets kept."""
        self._evict()
        if self._cumulative_span is not None:
            buckets, (oldest, newest) = self._cumulative_adds, self._cumulative_span
        elif self._buckets:
            buckets, oldest, newest = len(self._buckets), self._buckets[0].timestamp, self._buckets[-1].timestamp
        else:
            buckets, oldest, newest = 0, None, None
        return WindowTotals(
            counts=self._counts.copy(),
            tokens=self._tokens,
            local_selections=self._local,
            choice_selections=self._choice,
            buckets=buckets,
            oldest=oldest,
            newest=newest,
        )

    @property
    def nbytes(self) -> int:
        """Memory held by the running sums and the buckets' arrays."""
        return self._counts.nbytes + sum(b.slots.nbytes + b.counts.nbytes for b in self._buckets)

    def clear(self) -> None:
        """Drop every bucket."""
        self._buckets.clear()
        self._cumulative_adds = 0
        self._cumulative_span = None
        self._counts[:] = 0
        self._tokens = 0
        self._local = 0
        self._choice = 0

    def _drop_oldest(self) -> None:
        bucket = self._buckets.popleft()
        self._counts[bucket.slots] -= bucket.counts
        self._tokens -= bucket.tokens
        self._local -= bucket.local_selections
        self._choice -= bucket.choice_selections

    def _merge_oldest(self) -> None:
        first, second = self._buckets.popleft(), self._buckets.popleft()
        dense = np.zeros(self._num_slots, dtype=np.int64)
        dense[first.slots] += first.counts
        dense[second.slots] += second.counts
        slots = np.flatnonzero(dense)
        self._buckets.appendleft(
            _Bucket(
                second.timestamp,
                slots,
                dense[slots],
                first.tokens + second.tokens,
                first.local_selections + second.local_selections,
                first.choice_selections + second.choice_selections,
            )
        )

    def _evict(self) -> None:
        if self._max_seconds is not None:
            cutoff = float(self._clock()) - self._max_seconds
            while self._buckets and self._buckets[0].timestamp < cutoff:
                self._drop_oldest()
        if self._max_tokens is not None:
            while len(self._buckets) > 1 and self._tokens - self._buckets[0].tokens >= self._max_tokens:
                self._drop_oldest()
