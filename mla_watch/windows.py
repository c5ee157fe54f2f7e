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

from mla_watch.baselines import BASELINE_FORMAT, Baseline, BaselineError, Baselines, read_baseline_file, write_json
from mla_watch.positions import PositionCounts
from mla_watch.routing import KINDS, Kind, RollingWindow, RoutingStats, WindowTotals, compute_stats

__all__ = ["ALL_LINES", "BASELINE_FORMAT", "NAME_RE", "NAME_RULE", "CountDelta", "RouterInfo", "RouterStats",
           "RouterWindows", "RoutingSnapshot", "parse_zero_slots", "take_snapshot"]

# The business line of statistics summed over every line (``stats(None)``): a label value in the
# metrics, alerts and history, and so a name no policy may take.
ALL_LINES = "all"
DEFAULT_WINDOW_TOKENS = 4096  # the rolling window's length in tokens, wherever one is made without saying
_SERIALS = itertools.count(1)
# A business line's (or a worker's) name: a label value, short and printable (match it whole).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class RouterInfo:
    """What one router is: where it sits and how many slots it chooses from.

    ``zero_slots`` are slots that are zero-compute experts (LongCat-Flash's zero experts, Zaya's skip expert):
    a pick of one is a real routing decision - the token skips expert compute - so it is counted in its own
    slot rather than dropped, and readers can tell those slots apart. ``hash_routed`` marks a router whose choice
    is a fixed lookup of the token id (DeepSeek-V4's first MoE layers), not a learned score: its entropy
    describes the traffic's vocabulary, not the router's health, and may sit below ``log2 top_k`` when the
    lookup table repeats an expert. Both default to the plain learned router and are left out of
    :meth:`as_dict` then, so records of plain routers keep their exact shape.
    """

    name: str
    layer: int
    kind: Kind
    num_slots: int
    top_k: int
    zero_slots: tuple[int, ...] = ()
    hash_routed: bool = False

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"name": self.name, "layer": self.layer, "kind": self.kind,
                                  "num_slots": self.num_slots, "top_k": self.top_k}
        if self.zero_slots:
            record["zero_slots"] = list(self.zero_slots)
        if self.hash_routed:
            record["hash_routed"] = True
        return record

    @classmethod
    def from_dict(cls, data: Any, where: str = "router") -> RouterInfo:
        """Parse a record of :meth:`as_dict`, with errors naming ``where``, the key and the value."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object with name, layer, kind, num_slots, top_k; got {data!r}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name = {name!r}: expected a non-empty string")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}.kind = {kind!r}: expected 'expert' or 'indexer'")
        values = {}
        for key, lowest in (("layer", -1), ("num_slots", 1), ("top_k", 1)):
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"{where}.{key} = {value!r}: expected an integer >= {lowest}")
            values[key] = value
        zero_slots = parse_zero_slots(data.get("zero_slots", []), values["num_slots"], f"{where}.zero_slots")
        hash_routed = data.get("hash_routed", False)
        if not isinstance(hash_routed, bool):
            raise ValueError(f"{where}.hash_routed = {hash_routed!r}: expected true or false")
        return cls(name=name, kind=kind, zero_slots=zero_slots, hash_routed=hash_routed, **values)


def parse_zero_slots(value: Any, num_slots: int, where: str) -> tuple[int, ...]:
    """A list of distinct slot numbers in ``[0, num_slots)``, as :attr:`RouterInfo.zero_slots` keeps them."""
    if not isinstance(value, list | tuple) or not all(
            isinstance(slot, int) and not isinstance(slot, bool) and 0 <= slot < num_slots for slot in value):
        raise ValueError(f"{where} = {value!r}: expected a list of slot numbers in [0, {num_slots})")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} = {value!r}: expected distinct slot numbers")
    return tuple(sorted(value))


@dataclass
class CountDelta:
    """What one router chose for one business line over some tokens: the one shape counts travel in,
    from the probe to the windows, the shipper and the ingestion wire."""

    counts: np.ndarray  # int64, one per slot
    tokens: int
    local_selections: int = 0
    choice_selections: int = 0

    def merge(self, other: CountDelta) -> None:
        """Add ``other`` into this delta (sums of the same router and line)."""
        self.counts = self.counts + other.counts
        self.tokens += other.tokens
        self.local_selections += other.local_selections
        self.choice_selections += other.choice_selections


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
        record = {"name": self.router.name, "layer": self.router.layer, "kind": self.router.kind,
                  "business_line": self.business_line, **self.stats.as_dict(),
                  "baseline": None if self.baseline is None else self.baseline.as_dict()}
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
            self._window(router, business_line).add(delta.counts, delta.tokens,
                                                    local_selections=delta.local_selections,
                                                    choice_selections=delta.choice_selections)
            # After the window took it: a delta the window refuses changes neither.
            total = self._cumulative.get((router, business_line))
            if total is None:
                total = self._cumulative[(router, business_line)] = _Cumulative(
                    np.zeros(self._routers[router].num_slots, dtype=np.int64))
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
                stats = replace(stats, long_context_drift=found.drift, long_context_edge=found.edge)
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

    def set_baselines(self, business_line: str | None = None) -> list[Baseline]:
        """The windows now become the healthy baselines of their series: ``business_line``'s, or every line's and
        all lines summed; what was learned for them is replaced."""
        lines = [business_line] if business_line is not None else [None, *self.business_lines]
        return self._baselines.replace(record for line in lines for record in self.router_stats(line))

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
                raise ValueError(f"baseline {path}: router {name!r} has {counts.size} counts; "
                                 f"expected {info.num_slots} (one per expert)")
        self._baselines.adopt(series, legacy)

    def _window(self, router: str, line: str) -> RollingWindow:
        key = (router, line)
        window = self._windows.get(key)
        if window is None:
            window = RollingWindow(self._routers[router].num_slots, max_tokens=self._window_tokens,
                                   max_seconds=self._window_seconds, clock=self._clock, max_buckets=self._max_buckets)
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
        return _Totals(counts, sum(t.tokens for t in totals), sum(t.local_selections for t in totals),
                       sum(t.choice_selections for t in totals))


def _fits(info: RouterInfo, counts: np.ndarray) -> bool:
    """Whether a baseline's counts can be this router's: one per expert (an indexer's positions may differ)."""
    return info.kind != "expert" or counts.shape == (info.num_slots,)
