"""The routing history: every rule statistic per router and business line, for 30 days, in STATE_DIR.

Three tiers, each the mean of the finer one over its bucket (NaN values skipped):

* ``full``: every sample (``--history-interval``, 10 s) for ``--history-span`` (1 h, at least 2 min);
* ``minute``: 1-minute points for 24 h;
* ``quarter``: 15-minute points for ``--history-retention`` days (30).

Why these: a trend rule over minutes wants the samples themselves; over hours, 1-minute points
(1440 a day) keep a step change sharp to the minute; over days and weeks 96 points a day draw a
month in 2880 columns, which is what a screen shows. ``tokens`` is averaged like the statistics,
not summed: each sample's ``tokens`` is the token count of the routing window at that moment (a
level, not a flow), so a sum would count the same tokens once per sample. ``too_small`` is kept as
the fraction of samples whose window was below the router's trusted minimum.

The ``full`` tier is also the status page's live hour (:meth:`HistoryStore.recent`, ``GET /v1/status``
-> ``history``): the last hour is held once. Without a file (``path=None``: ``serve --history-retention
0``, or a state directory the store cannot open) the store is the live hour alone: the ``full`` tier for
exactly the span, holding what the page draws (``entropy_bits``, ``tokens``, ``too_small``), nothing
written anywhere.

A point is stamped with its bucket's start (a minute point at 12:03:00 is the mean of the
samples in [12:03:00, 12:04:00)) and written once its bucket is over: the first sample of the
next bucket closes it. A sample is stamped to the millisecond; a second sample in the same
millisecond is not a point.

Storage (:mod:`mla_watch.history.file`): one SQLite row per (tier, time) holding the point of every series as one packed
little-endian float32 array ``[series id, value]`` (NaN: no value), the series' names in a
side table. One row per series per point repeats the key and a row header per value: 89 bytes a
series-point measured by bench/history_size.py, against 36 here. Each sample
is one transaction (WAL, synchronous=NORMAL: a SIGKILL loses at most the sample being written).

Bounds: at most ``max_series`` series (a series past it is not kept; counted and logged once);
rows per tier ``retention / step + 2``, so the file holds at most

    rows = (span / interval + 2) + (86400 / 60 + 2) + (retention_days * 96 + 2)
    bytes <= 1.25 * rows * (max(S) * 9 * 4 + 64) + 1 MiB

(``S``: series kept, at most ``max_series``; 1.25 for the SQLite pages a row's overflow chain
leaves part-empty, 1 MiB for the schema, the series table and the WAL, whose size is limited).

Memory: each tier preallocates ``retention / step + 2`` rows plus an eighth (at least 8) of slack for a
sampler running a little fast, times the series seen (at most ``max_series``), times 4 bytes per value
kept: 9 values with a file (all three tiers, for :meth:`HistoryStore.points` to answer without a query:
about 190 KB per series at the defaults, 63 MiB for 348 series), 3 without one (about 4.9 KB per series
for an hour at 10 s: 2.8 MiB for DeepSeek-V3.2's 119 routers x (4 lines + all)). A series with no statistic left
in any tier gives its slot back (with a file: once its last value has left the quarter tier; without one:
once it has left the span).

Wall clock: a sample stamped before the newest point (the clock stepped back) first drops every
point newer than it, from memory and from the file, so each tier stays in time order. A file
that cannot be read is moved aside (``history.sqlite.corrupt``, logged with the reason) and the
history starts empty: serving never depends on it.

A write the disk refuses (full, read-only) costs the file nothing and memory nothing: the tiers go on in
memory, and the first sample the disk takes again rewrites, in one transaction, every point since the
earliest one refused (per tier) and the series table, so that the file holds what memory holds. The
state directory's writes (``writes``) say it once per change.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from operator import attrgetter
from pathlib import Path
from typing import Any, cast

import numpy as np

from mla_watch.alerting.vocabulary import TREND_METRICS
from mla_watch.common.sqlite import PrivateDatabase
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.values import is_integer, is_number
from mla_watch.history.file import HISTORY_FILE, open_database, rewrite_since, set_aside, write_sample
from mla_watch.history.queries import (
    chosen_series,
    column_blocks,
    downsample,
    history_entries,
    live_entries,
    live_hour,
    series_points,
    tier_parts,
)
from mla_watch.history.series_info import SeriesInfo, series_info
from mla_watch.history.tiers import Tier, open_buckets, roll
from mla_watch.routing.windows import ALL_LINES, RouterStats

__all__ = [
    "HISTORY_FILE",
    "HISTORY_METRICS",
    "LIVE_METRICS",
    "VALUES",
    "HistoryStore",
    "HistoryStoreError",
    "SeriesInfo",
    "size_bound",
]

log = logging.getLogger(__name__)

# What a point holds per series: the statistics rules watch, the window's tokens, the too-small fraction.
# Attributes of RoutingStats; "tokens" last: the columns before it are the statistics, a series' values.
HISTORY_METRICS: tuple[str, ...] = (*TREND_METRICS, "tokens")
VALUES: tuple[str, ...] = (*HISTORY_METRICS, "too_small")
# What a store without a file keeps: what the status page's live hour draws.
LIVE_METRICS: tuple[str, ...] = ("entropy_bits", "tokens")
MINUTE, QUARTER = 60.0, 900.0
MINUTE_RETENTION = 86400.0
MIN_FULL_SPAN = 2 * MINUTE  # a minute's samples must still be there when the next minute closes it


class HistoryStoreError(RuntimeError):
    """The history file cannot be opened, read or written."""


def size_bound(*, series: int, interval_seconds: float, span_seconds: float, retention_days: float) -> int:
    """The documented upper bound of the file's bytes (see the module docstring)."""
    rows = (
        (max(span_seconds, MIN_FULL_SPAN) / interval_seconds + 2)
        + (MINUTE_RETENTION / MINUTE + 2)
        + (retention_days * 86400.0 / QUARTER + 2)
    )
    return int(1.25 * rows * (series * len(VALUES) * 4 + 64) + (1 << 20))


class HistoryStore:
    """Tiered routing statistics in ``path`` (SQLite), fed by :meth:`record`, read by :meth:`points`, :meth:`query`
    and :meth:`recent`; ``path=None``: the live hour alone, in memory (see the module docstring).

    ``clock`` gives wall-clock seconds (injectable: tests and the bench simulate days).
    """

    def __init__(
        self,
        path: Path | None,
        *,
        interval_seconds: float = 10.0,
        span_seconds: float = 3600.0,
        retention_days: float = 30.0,
        max_series: int = 1024,
        clock: Callable[[], float] = time.time,
        writes: StateWrites | None = None,
    ) -> None:
        checked = (
            ("interval_seconds", interval_seconds),
            ("span_seconds", span_seconds),
            *((("retention_days", retention_days),) if path is not None else ()),
        )
        for name, value in checked:
            if not is_number(value, finite=True) or value <= 0:
                raise ValueError(f"{name} = {value!r}: expected a positive number")
        if interval_seconds > span_seconds:
            raise ValueError(
                f"interval_seconds = {interval_seconds!r}: expected at most span_seconds ({span_seconds!r})"
            )
        if path is not None and retention_days < 1:
            raise ValueError(f"retention_days = {retention_days!r}: expected at least 1 (the minute tier keeps a day)")
        if not is_integer(max_series) or max_series < 1:
            raise ValueError(f"max_series = {max_series!r}: expected a positive integer")
        self.path = None if path is None else Path(path)
        self.interval_seconds = float(interval_seconds)
        self.span_seconds = float(span_seconds)
        # Without a file nothing outlives the span.
        self.retention_days = float(retention_days) if path is not None else self.span_seconds / 86400.0
        self.max_series = max_series
        self.clock = clock
        self.metrics = HISTORY_METRICS if path is not None else LIVE_METRICS
        self.values: tuple[str, ...] = (*self.metrics, "too_small")
        self._tokens = self.values.index("tokens")  # the columns before it are the statistics
        self._too_small = self.values.index("too_small")
        self._read = attrgetter(*self.metrics)  # a RoutingStats' kept values, in one call
        self.tiers = self._new_tiers()
        # A statistic at t is gone from every tier once t is older than this (with a file: the quarter point of
        # its bucket has expired too).
        self._kept_seconds = self.tiers[-1].retention + (QUARTER if len(self.tiers) > 1 else 0.0)
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str], int] = {}
        self._info: dict[int, SeriesInfo] = {}
        self._meta: dict[int, tuple] = {}  # what record() compares: (layer, kind, floor, ceiling, slots)
        self._free: list[int] = []  # ids of series dropped for having no value left, reused first
        self._next_id = 0
        # Per series id, the newest sample with a statistic: a series none is left of gives its id back.
        self._last_value = np.full(max_series, -np.inf)
        self._open: list[float | None] = [None] * (len(self.tiers) - 1)  # the minute / quarter bucket being filled
        self.dropped_series = 0  # samples of series past max_series that were not kept
        self._warned_full = False
        self._last_write_error: str | None = None
        self.writes = writes
        # Per tier, the stamp of the earliest point the disk refused since the file last held everything.
        self._unsynced: dict[str, float] = {}
        self._db = self._open_file() if self.path is not None else None

    @property
    def durable(self) -> bool:
        """Whether the history is kept in a file (and for the retention), not for the span in memory only."""
        return self.path is not None

    def _new_tiers(self) -> tuple[Tier, ...]:
        width = len(self.values)
        if self.path is None:
            return (Tier("full", self.interval_seconds, self.span_seconds, width, self.max_series),)
        return (
            Tier("full", self.interval_seconds, max(self.span_seconds, MIN_FULL_SPAN), width, self.max_series),
            Tier("minute", MINUTE, MINUTE_RETENTION, width, self.max_series),
            Tier("quarter", QUARTER, self.retention_days * 86400.0, width, self.max_series),
        )

    # ------------------------------------------------------------------ the file
    def _open_file(self) -> PrivateDatabase:
        assert self.path is not None
        try:
            db = open_database(self.path, HistoryStoreError, self.writes)
        except HistoryStoreError as error:
            if not self.path.exists() or self.path.stat().st_size == 0:
                raise  # not a bad file: a state directory that cannot be written, said as such
            set_aside(self.path, str(error))
            return open_database(self.path, HistoryStoreError, self.writes)
        try:
            self._load(db)
        except (HistoryStoreError, ValueError) as error:
            db.close()
            self._reset_memory()
            set_aside(self.path, str(error))
            return open_database(self.path, HistoryStoreError, self.writes)
        return db

    def _reset_memory(self) -> None:
        self.tiers = self._new_tiers()
        self._ids.clear()
        self._info.clear()
        self._meta.clear()
        self._free.clear()
        self._next_id = 0
        self._last_value[:] = -np.inf
        self._open = [None] * (len(self.tiers) - 1)

    def _load(self, db: PrivateDatabase) -> None:
        series = db.execute(
            "SELECT id, router, business_line, layer, kind, floor_bits, ceiling_bits, num_slots FROM series ORDER BY id"
        )
        for sid, router, line, layer, kind, floor_bits, ceiling_bits, num_slots in series:
            if not isinstance(sid, int) or not 0 <= sid < self.max_series:
                if isinstance(sid, int) and sid >= self.max_series:  # --history-max-series was lowered
                    continue
                raise ValueError(f"series id {sid!r}: expected an integer in [0, {self.max_series})")
            self._ids[(str(router), str(line))] = sid
            self._info[sid] = SeriesInfo(
                str(router), str(line), int(layer), str(kind), floor_bits, ceiling_bits, num_slots
            )
            self._meta[sid] = (layer, kind, floor_bits, ceiling_bits, num_slots)
        self._next_id = max(self._info, default=-1) + 1
        self._free = [sid for sid in range(self._next_id) if sid not in self._info]
        width = len(self.values) * 4
        for tier in self.tiers:
            rows = db.execute("SELECT t, data FROM points WHERE tier = ? ORDER BY t", (tier.name,))
            for t, blob in rows:
                if not isinstance(blob, bytes) or len(blob) % width or not isinstance(t, float | int):
                    raise ValueError(
                        f"{tier.name} point at {t!r}: expected a packed float32 array of "
                        f"{len(self.values)} values per series"
                    )
                row = np.frombuffer(blob, dtype="<f4").reshape(-1, len(self.values))[: self.max_series]
                tier.append(float(t), row.astype(np.float32))
        for tier in self.tiers:
            # [point, series]; any() over an axis of a 3-D array is an array (numpy's types allow a scalar)
            has = cast(np.ndarray, np.isfinite(tier.data[tier.start : tier.end, :, : self._tokens]).any(axis=2))
            if has.size:
                newest = has.shape[0] - 1 - np.argmax(has[::-1], axis=0)
                seen = np.where(has.any(axis=0), tier.times[tier.start + newest], -np.inf)
                width = min(len(seen), self.max_series)
                self._last_value[:width] = np.maximum(self._last_value[:width], seen[:width])
        self._open = open_buckets(self.tiers)
        loaded = sum(len(tier) for tier in self.tiers)
        if loaded:
            log.info(
                "routing history %s: %d series, %s points",
                self.path,
                len(self._info),
                " / ".join(f"{len(tier)} {tier.name}" for tier in self.tiers),
            )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    # ------------------------------------------------------------------ writing
    def record(self, records: Iterable[RouterStats]) -> None:
        """One sample of routing records (a :class:`~mla_watch.windows.RoutingSnapshot`'s: every line and all lines
        summed), stamped ``clock()`` to the millisecond: a time shown is a time a client can pass back exactly."""
        now = round(float(self.clock()), 3)
        if not math.isfinite(now):
            return
        read = self._read
        keys: list[tuple[str, str]] = []
        metas: list[tuple] = []
        rows: list[tuple] = []
        for record in records:  # the one Python loop over series per sample: attribute reads only
            router, stats = record.router, record.stats
            keys.append((router.name, record.business_line or ALL_LINES))
            metas.append((router.layer, router.kind, stats.floor_bits, stats.ceiling_bits, stats.num_slots))
            rows.append((*read(stats), stats.too_small))
        matrix = _matrix(rows, len(self.values))
        empty = ~(matrix[:, self._tokens] > 0)  # a window without tokens has statistics of nothing
        matrix[empty, : self._tokens] = np.nan
        matrix[empty, self._too_small] = np.nan
        values = {key: (meta, matrix[index]) for index, (key, meta) in enumerate(zip(keys, metas, strict=True))}
        with self._lock:
            writes = self._record(now, values)
        self._persist(*writes)

    def _record(self, now: float, values: dict[tuple[str, str], tuple[tuple, np.ndarray]]) -> tuple:
        truncate = None
        last = max((tier.last for tier in self.tiers if tier.last is not None), default=None)
        if last is not None and now <= last:
            if now == last:
                return None, [], [], [], []
            # A coarser point whose bucket reaches past the new time is dropped too: it would be recomputed.
            truncate = [(tier.name, now if tier is self.tiers[0] else now - tier.step) for tier in self.tiers]
            dropped = sum(tier.truncate_after(after) for tier, (_, after) in zip(self.tiers, truncate, strict=True))
            log.warning(
                "routing history: the wall clock stepped back %.1f s; dropped the %d point(s) stamped after it",
                last - now,
                dropped,
            )
            self._open = open_buckets(self.tiers)
        new_series: list[tuple[int, SeriesInfo]] = []
        width = len(self.values)
        row = np.full((self._next_id, width), np.nan, dtype=np.float32)
        pending: list[tuple[int, np.ndarray]] = []
        for key, (meta, point) in values.items():
            sid = self._ids.get(key)
            if sid is None:
                if not point[self._tokens] > 0:  # a series starts with its first token, as on the heat map
                    continue
                sid = self._new_id(key)
                if sid is None:
                    continue
            if self._meta.get(sid) != meta:  # new, or its geometry changed (a re-tune, a new config)
                info = series_info(key, meta)
                self._meta[sid] = meta
                self._info[sid] = info
                new_series.append((sid, info))
            pending.append((sid, point))
        if self._next_id > row.shape[0]:
            row = np.vstack([row, np.full((self._next_id - row.shape[0], width), np.nan, dtype=np.float32)])
        for sid, point in pending:
            row[sid] = point
        if self._next_id:
            self._last_value[: self._next_id][np.isfinite(row[:, : self._tokens]).any(axis=1)] = now
        points = [*roll(self.tiers, self._open, now), ("full", now, row)]
        self.tiers[0].append(now, row)
        expired = [(tier.name, now - tier.retention) for tier in self.tiers]
        for tier in self.tiers:
            tier.expire(now - tier.retention)
        # Values leave the store when the coarsest tier moves on: a point there (every sample without a file).
        freed = self._reap(now) if any(name == self.tiers[-1].name for name, _, _ in points) else []
        return truncate, new_series, points, expired, freed

    def _new_id(self, key: tuple[str, str]) -> int | None:
        if self._free:
            sid = self._free.pop(0)
        elif self._next_id < self.max_series:
            sid = self._next_id
            self._next_id += 1
        else:
            self.dropped_series += 1
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "routing history %s: %d series kept, the most --history-max-series allows; %s on %s and "
                    "any further series are not kept (counted in series_dropped)",
                    self.path or "(in memory)",
                    self.max_series,
                    key[0],
                    key[1],
                )
            return None
        self._ids[key] = sid
        self._last_value[sid] = self.clock()  # a new series is not reaped before its first statistic could age out
        return sid

    def _reap(self, now: float) -> list[int]:
        """Free the ids of series with no statistic left in any tier (their line or router is gone, or has had no
        token for the whole retention): a bounded number of series slots serves lines that come and go."""
        stale = np.flatnonzero(self._last_value[: self._next_id] < now - self._kept_seconds).tolist()
        freed = [sid for sid in stale if sid in self._info]
        for sid in freed:
            info = self._info.pop(sid)
            self._meta.pop(sid, None)
            del self._ids[(info.router, info.business_line)]
            for tier in self.tiers:
                tier.clear_column(sid)
        self._free = sorted(set(self._free) | set(freed))
        return freed

    def _persist(self, truncate: list | None, new_series: list, points: list, expired: list, freed: list[int]) -> None:
        db = self._db
        if db is None or (truncate is None and not points):
            return
        try:
            if self._unsynced:  # the disk refused earlier samples: write what memory holds since then
                since, series, held = self._since_unsynced()
                db.run(lambda connection: rewrite_since(connection, since, series, held, expired))
                log.info(
                    "routing history %s: the %d point(s) kept in memory while the disk refused them are written",
                    self.path,
                    len(held),
                )
                self._unsynced = {}
            else:
                db.run(lambda connection: write_sample(connection, truncate, new_series, points, expired, freed))
            self._last_write_error = None
        except HistoryStoreError as error:  # a full disk: the history goes on in memory, said once per cause
            for tier, t, _ in points:
                self._unsynced[tier] = min(self._unsynced.get(tier, t), t)
            for tier, after in truncate or ():  # points the file still holds past a step back of the clock
                self._unsynced[tier] = min(self._unsynced.get(tier, after), after)
            if self.writes is None and str(error) != self._last_write_error:
                log.error("routing history: writing a point failed (kept in memory only): %s", error)
            self._last_write_error = str(error)

    def _since_unsynced(self) -> tuple[dict[str, float], list[tuple[int, SeriesInfo]], list]:
        """What memory holds that the file may not: per tier, the points since the earliest refused."""
        with self._lock:
            series = sorted(self._info.items())
            held = []
            for tier in self.tiers:
                since = self._unsynced.get(tier.name)
                if since is None:
                    continue
                lo, hi = tier.index(since, math.inf)
                held += [(tier.name, float(tier.times[i]), tier.data[i].copy()) for i in range(lo, hi)]
            return dict(self._unsynced), series, held

    # ------------------------------------------------------------------ reading
    def series(self) -> list[SeriesInfo]:
        with self._lock:
            return list(self._info.values())

    def nbytes(self) -> int:
        """Memory held by the tiers' arrays."""
        return sum(tier.nbytes() for tier in self.tiers)

    def points(
        self, router: str, business_line: str, metric: str, since: float, until: float
    ) -> tuple[list[float], list[float]]:
        """``(times, values)`` of one series in ``[since, until]``, finest resolution first, NaN skipped, by time.

        ``business_line`` is ``"all"`` for every line summed; ``metric`` one of :attr:`metrics`
        (:data:`HISTORY_METRICS` with a file). From memory: a dict lookup, three binary searches and a numpy
        slice per tier (about 20 us plus 1 us per 100 points returned). Values are float32 (7 significant digits).
        """
        column = self._column(metric)
        with self._lock:
            sid = self._ids.get((router, business_line))
            if sid is None:
                return [], []
            return series_points(tier_parts(self.tiers, since, until), sid, column)

    def recent(self, since: float | None = None) -> dict[str, Any]:
        """The status page's live hour (``GET /v1/status`` -> ``history``): the entropy of every series at each point
        of the ``full`` tier within the last ``span_seconds``, as ``{"interval_seconds", "span_seconds", "times",
        "series": [...]}``.

        ``since``: only the points stamped after it (the last time a client has shown; times are stamped as shown, so
        it is passed back exactly): each point is returned once and none is skipped. A series is listed while it has
        an entropy value within the span, even with no new point. Each series: ``router, layer, kind, business_line,
        floor_bits, ceiling_bits, num_slots``, ``values`` (entropy bits to 4 decimals, or ``None``: no value, or a
        window without tokens) and ``too_small`` (the window held fewer tokens than the router's trusted minimum),
        sorted by business line (``all`` first), layer and router.
        """
        entropy = self.values.index("entropy_bits")
        tier = self.tiers[0]
        with self._lock:
            newest = max(tier.last if tier.last is not None else -math.inf, float(self.clock()))
            times, chosen, values, flags = live_hour(
                tier,
                self._info,
                newest=newest,
                span=self.span_seconds,
                since=since,
                entropy=entropy,
                too_small=self._too_small,
            )
        return {
            "interval_seconds": self.interval_seconds,
            "span_seconds": self.span_seconds,
            "times": times,
            "series": live_entries(chosen, values, flags),
        }

    def _column(self, metric: str) -> int:
        if metric not in self.metrics:
            raise ValueError(f"metric = {metric!r}: expected one of {', '.join(self.metrics)}")
        return self.metrics.index(metric)

    def query(
        self,
        *,
        since: float,
        until: float,
        step: float,
        metric: str = "entropy_bits",
        business_line: str | None = None,
        router: str | None = None,
        max_cells: int | None = None,
    ) -> dict[str, Any]:
        """``GET /v1/history``: the matching series over ``[since, until]``, each bucket of ``step`` seconds the mean of
        the finest points in it (a coarser point than ``step`` keeps its own bucket). Buckets with no value in any
        series are left out. Raises :class:`ValueError` naming ``max_cells`` when the answer would be larger."""
        column = self._column(metric)
        with self._lock:
            chosen = chosen_series(self._info, business_line, router)
            buckets = math.ceil((until - since) / step) + 1
            if max_cells is not None and buckets * len(chosen) > max_cells:
                raise ValueError(f"{buckets} buckets x {len(chosen)} series exceed {max_cells} values")
            ids = np.array([sid for sid, _ in chosen], dtype=np.int64)
            parts = tier_parts(self.tiers, since, until)
            times_parts, value_parts, small_parts = column_blocks(parts, ids, (column, self._too_small))
            dropped = self.dropped_series
        times_out, means, small = downsample(times_parts, value_parts, small_parts, step, len(chosen))
        return {
            "metric": metric,
            "since": since,
            "until": until,
            "step_seconds": step,
            "interval_seconds": step,
            "span_seconds": until - since,
            "times": times_out,
            "series": history_entries(chosen, means, small),
            "series_dropped": dropped,
            "tiers": [
                {"name": tier.name, "step_seconds": tier.step, "retention_seconds": tier.retention}
                for tier in self.tiers
            ],
        }


def _matrix(rows: list[tuple], width: int) -> np.ndarray:
    """Records' values as float32 ``[series, value]``: NaN for None (no baseline, no locality) and infinities."""
    cells = np.array(rows, dtype=object).reshape(len(rows), width)
    # numpy's types leave None out of what a ufunc takes; on an object array it compares each cell
    cells[np.equal(cells, None)] = np.nan  # type: ignore[call-overload]
    matrix = cells.astype(np.float32)
    matrix[~np.isfinite(matrix)] = np.nan
    return matrix
