"""Rolling routing windows for a set of routers, per business line (no torch).

:class:`RouterWindows` is the host side of counting: it receives count deltas per router
and business line - from a local :class:`~mla_watch.probe.Probe`, or shipped over HTTP by
a probe running inside another inference process - keeps them in rolling windows and
turns them into the per-router statistics records of the Python API, ``GET /v1/routing``
and the metrics.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mla_watch.routing.baselines import (
    BASELINE_FORMAT,
    Baseline,
    BaselineError,
    Baselines,
    read_baseline_file,
    write_json,
)
from mla_watch.routing.positions import PositionCounts
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.stats import RollingWindow, RoutingStats, WindowTotals, compute_stats

__all__ = [
    "ALL_LINES",
    "BASELINE_FORMAT",
    "NAME_RE",
    "NAME_RULE",
    "RouterStats",
    "RouterWindows",
    "RoutingSnapshot",
    "take_snapshot",
]

# The business line of statistics summed over every line (``stats(None)``): a label value in the
# metrics, alerts and history, and so a name no policy may take.
ALL_LINES = "all"
DEFAULT_WINDOW_TOKENS = 4096  # the rolling window's length in tokens, wherever one is made without saying
_SERIALS = itertools.count(1)
# A business line's (or a worker's) name: a label value, short and printable (match it whole).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class RouterStats:
    """One router's statistics over one business line's window (``None``: every line summed), with the
    window's counts and the healthy baseline of that router and line when one is known."""

    router: RouterInfo
    business_line: str | None
    stats: RoutingStats
    counts: np.ndarray | None = None
    baseline: Baseline | None = None

    @property
    def line_label(self) -> str:
        """The business line as metrics, alerts and the history label it."""
        return self.business_line or ALL_LINES

    def as_dict(self) -> dict[str, Any]:
        """The JSON record of ``Probe.stats()`` and ``GET /v1/routing``; every other consumer reads the attributes."""
        record = {
            "name": self.router.name,
            "layer": self.router.layer,
            "kind": self.router.kind,
            "business_line": self.business_line,
            **self.stats.as_dict(),
            "baseline": None if self.baseline is None else self.baseline.as_dict(),
        }
        if self.router.hash_routed:  # alert rules skip it unless their selector asks for hash_routed
            record["hash_routed"] = True
        return record


@dataclass(frozen=True)
class RoutingSnapshot:
    """Every router's statistics of every source, for each business line and for all lines summed.

    Taken once per read (:func:`take_snapshot`) and handed to every consumer - metrics, alert
    evaluation, the history, the APIs - so that none recomputes what another just computed.
    """

    taken_at: float
    records: tuple[RouterStats, ...]
    business_lines: tuple[str, ...]

    def for_line(self, business_line: str | None) -> list[RouterStats]:
        return [record for record in self.records if record.business_line == business_line]


def take_snapshot(sources: Iterable[RouterWindows], taken_at: float) -> RoutingSnapshot:
    """The statistics of every window of ``sources``: all lines summed, then each line."""
    records: list[RouterStats] = []
    lines: set[str] = set()
    for windows in sources:
        for line in [None, *windows.business_lines]:
            records.extend(windows.router_stats(line))
        lines.update(windows.business_lines)
    return RoutingSnapshot(taken_at, tuple(records), tuple(sorted(lines)))


@dataclass(frozen=True)
class _Totals:
    counts: np.ndarray
    tokens: int
    local_selections: int
    choice_selections: int


@dataclass
class _Cumulative:
    counts: np.ndarray  # int64, one per slot
    tokens: int = 0


class RouterWindows:
    """Rolling windows of selection counts per (router, business line)."""

    def __init__(
        self,
        routers: Sequence[RouterInfo],
        *,
        window_tokens: int | None = DEFAULT_WINDOW_TOKENS,
        window_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int | None = None,
        baselines: Baselines | None = None,
    ) -> None:
        self._routers = {info.name: info for info in routers}
        self._max_buckets = max_buckets
        self._window_tokens = window_tokens
        self._window_seconds = window_seconds
        self._clock = clock
        self._windows: dict[tuple[str, str], RollingWindow] = {}
        self._lines: dict[str, None] = {}
        # Since these windows were made, per (router, line): what counters summed across replicas read.
        # Never rolled or reset, so a counter built on it only grows; one int64 vector per pair.
        self._cumulative: dict[tuple[str, str], _Cumulative] = {}
        self._baselines = baselines if baselines is not None else Baselines()
        # Where a counter of routing by position feeds these windows (an embedded probe): its records carry the
        # long-context drift of their router and line.
        self.positions: PositionCounts | None = None
        self._lock = threading.Lock()
        self._version = 0
        self.serial = next(_SERIALS)  # unlike id(), never reused: a cache may key on (serial, version)

    @property
    def routers(self) -> list[RouterInfo]:
        return list(self._routers.values())

    @property
    def business_lines(self) -> list[str]:
        """Lines that have reported counts, in the order they first did."""
        return list(self._lines)

    @property
    def version(self) -> int:
        """Changes whenever counts are added, windows reset or a baseline learned or replaced."""
        return self._version + self._baselines.version

    @property
    def baselines(self) -> Baselines:
        """The healthy baselines these windows' statistics carry and measure drift from."""
        return self._baselines

    @baselines.setter
    def baselines(self, baselines: Baselines) -> None:
        with self._lock:
            self._version += 1 + self._baselines.version  # the sum with the new store's version never repeats
            self._baselines = baselines

    @property
    def nbytes(self) -> int:
        return sum(window.nbytes for window in self._windows.values())

    def add(self, router: str, business_line: str, delta: CountDelta) -> None:
        """Add a count delta of one router for one business line."""
        if router not in self._routers:
            raise KeyError(f"router {router!r} is not one of the {len(self._routers)} routers of these windows")
        with self._lock:
            self._version += 1
            self._lines.setdefault(business_line, None)
            self._window(router, business_line).add(
                delta.counts,
                delta.tokens,
                local_selections=delta.local_selections,
                choice_selections=delta.choice_selections,
            )
            # After the window took it: a delta the window refuses changes neither.
            total = self._cumulative.get((router, business_line))
            if total is None:
                total = self._cumulative[(router, business_line)] = _Cumulative(
                    np.zeros(self._routers[router].num_slots, dtype=np.int64)
                )
            total.counts += np.asarray(delta.counts, dtype=np.int64)
            total.tokens += int(delta.tokens)

    def cumulative(self, router: str, business_line: str) -> CountDelta | None:
        """Selections and tokens of one router for one business line since these windows were made (windows
        rolling or :meth:`reset` never lower them); ``None`` where that pair never reported."""
        with self._lock:
            total = self._cumulative.get((router, business_line))
            return None if total is None else CountDelta(total.counts.copy(), total.tokens)

    def cumulative_totals(self) -> dict[tuple[str, str], CountDelta]:
        """:meth:`cumulative` of every (router, business line) pair at one instant, in the order the pairs first
        reported (copies: the caller may keep them)."""
        with self._lock:
            return {key: CountDelta(total.counts.copy(), total.tokens) for key, total in self._cumulative.items()}

    def counts(self, business_line: str | None = None) -> dict[str, np.ndarray]:
        """Selection counts of each router over its current window."""
        return {name: self._totals(name, business_line).counts for name in self._routers}

    def router_stats(self, business_line: str | None = None) -> list[RouterStats]:
        """Each router's statistics over the current window (every line summed when ``None``)."""
        records = []
        line = business_line or ALL_LINES
        baselines = self._baselines
        by_position = self.positions.profiles(business_line) if self.positions is not None else {}
        for info in self._routers.values():
            totals = self._totals(info.name, business_line)
            baseline = baselines.get(info.name, line)
            if baseline is not None and not _fits(info, baseline.counts):
                baseline = None  # taken of another model's router: not this one's health
            reference = baseline.counts if baseline is not None else baselines.legacy_counts(info.name)
            stats = compute_stats(
                totals.counts,
                kind=info.kind,
                top_k=info.top_k,
                tokens=totals.tokens,
                baseline=reference if reference is not None and _fits(info, reference) else None,
                local_selections=totals.local_selections,
                choice_selections=totals.choice_selections,
                distinct_picks=not info.hash_routed,
            )
            found = by_position.get(info.name)
            if found is not None:
                stats = replace(
                    stats,
                    long_context_drift=found.drift,
                    long_context_edge=found.edge,
                    long_context_compared=found.compared() if found.drift is not None else None,
                    long_context_clients=found.senders() if found.shares else None,
                )
            records.append(RouterStats(info, business_line, stats, totals.counts, baseline))
        return records

    def reset(self, routers: Sequence[str] | None = None) -> None:
        """Forget the windows of ``routers`` (default: every router), e.g. after their tensors changed."""
        with self._lock:
            self._version += 1
            if routers is None:
                self._windows.clear()
                return
            names = set(routers)
            for key in [key for key in self._windows if key[0] in names]:
                del self._windows[key]

    def set_baselines(
        self, business_line: str | None = None, *, clients: Callable[[RouterStats], Any] | None = None
    ) -> list[Baseline]:
        """The windows now become the healthy baselines of their series: ``business_line``'s, or every line's and
        all lines summed; what was learned for them is replaced. ``clients(record)``: whose tokens a window holds
        (:meth:`Baselines.replace`)."""
        lines = [business_line] if business_line is not None else [None, *self.business_lines]
        return self._baselines.replace(
            (record for line in lines for record in self.router_stats(line)), clients=clients
        )

    def save_baseline(self, path: str | Path, business_line: str | None = None) -> dict[str, Any]:
        """:meth:`set_baselines`, written to ``path`` as JSON (``mla_watch.baseline/2``); returns the document."""
        taken = self.set_baselines(business_line)
        document = {"format": BASELINE_FORMAT, "series": [baseline.to_json() for baseline in taken]}
        write_json(Path(path), document)
        return document

    def load_baseline(self, path: str | Path) -> None:
        """Measure drift from, and judge rules against, the baselines of a file :meth:`save_baseline` wrote (or
        a ``mla_watch.baseline/1`` file, whose counts serve every line); ``ValueError`` naming the problem."""
        path = Path(path)
        try:
            series, legacy = read_baseline_file(path)
        except BaselineError as error:
            raise ValueError(str(error)) from None
        for name, counts in [*((b.router, b.counts) for b in series), *legacy.items()]:
            info = self._routers.get(name)
            if info is not None and not _fits(info, counts):
                raise ValueError(
                    f"baseline {path}: router {name!r} has {counts.size} counts; "
                    f"expected {info.num_slots} (one per expert)"
                )
        self._baselines.adopt(series, legacy)

    def _window(self, router: str, line: str) -> RollingWindow:
        key = (router, line)
        window = self._windows.get(key)
        if window is None:
            window = RollingWindow(
                self._routers[router].num_slots,
                max_tokens=self._window_tokens,
                max_seconds=self._window_seconds,
                clock=self._clock,
                max_buckets=self._max_buckets,
            )
            self._windows[key] = window
        return window

    def window_totals(self, router: str, business_line: str) -> WindowTotals | None:
        """The sums of one window, or ``None`` where that router has no counts for that line."""
        with self._lock:
            window = self._windows.get((router, business_line))
            return None if window is None else window.totals()

    def _totals(self, router: str, business_line: str | None) -> _Totals:
        """Sums over ``business_line`` (every line for ``None``); reading never creates a window."""
        with self._lock:
            lines = list(self._lines) if business_line is None else [business_line]
            windows = [self._windows.get((router, line)) for line in lines]
            totals = [window.totals() for window in windows if window is not None]
        counts = np.zeros(self._routers[router].num_slots, dtype=np.int64)
        for total in totals:
            counts += total.counts
        return _Totals(
            counts,
            sum(t.tokens for t in totals),
            sum(t.local_selections for t in totals),
            sum(t.choice_selections for t in totals),
        )


def _fits(info: RouterInfo, counts: np.ndarray) -> bool:
    """Whether a baseline's counts can be this router's: one per expert (an indexer's positions may differ)."""
    return info.kind != "expert" or counts.shape == (info.num_slots,)
