"""What the history's reads take from its tiers, and how they downsample it: the parts of the tiers that serve a span,
one series' points, the status page's live hour, and ``GET /v1/history``'s buckets of ``step`` seconds.

Functions over :class:`~mla_watch.history.tiers.Tier` arrays and the series' :class:`SeriesInfo`, with no lock of
their own: :class:`mla_watch.history.store.HistoryStore` calls those that read the tiers under its lock, and those
that shape an answer from the copies they made after it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import numpy as np

from mla_watch.history.series_info import SeriesInfo, series_entry, shown_order
from mla_watch.history.tiers import Tier

__all__ = [
    "Part",
    "chosen_series",
    "column_blocks",
    "downsample",
    "history_entries",
    "live_entries",
    "live_hour",
    "series_points",
    "tier_parts",
]

Part = tuple[Tier, int, int]  # a tier and the indices [lo, hi) of its points that serve a span


def tier_parts(tiers: tuple[Tier, ...], since: float, until: float) -> list[Part]:
    """Per tier, the indices that serve ``[since, until]``: the finest tier where it has points, then coarser
    ones for the time before a finer tier's first point. Oldest part first."""
    parts = []
    bound, inclusive = until, True
    for tier in tiers:
        if not len(tier):
            continue
        lo, hi = tier.index(since, bound, until_inclusive=inclusive)
        if hi > lo:
            parts.append((tier, lo, hi))
        first = tier.first
        if first is not None and first < bound:
            bound, inclusive = first, False
        if bound <= since:
            break
    return parts[::-1]


def series_points(parts: list[Part], sid: int, column: int) -> tuple[list[float], list[float]]:
    """``(times, values)`` of the series ``sid``'s value ``column`` in ``parts``, NaN skipped."""
    times: list[float] = []
    values: list[float] = []
    for tier, lo, hi in parts:
        if sid >= tier.columns:
            continue
        column_values = tier.data[lo:hi, sid, column]
        keep = np.isfinite(column_values)
        times.extend(tier.times[lo:hi][keep].tolist())
        values.extend(column_values[keep].tolist())
    return times, values


def live_hour(
    tier: Tier,
    info: Mapping[int, SeriesInfo],
    *,
    newest: float,
    span: float,
    since: float | None,
    entropy: int,
    too_small: int,
) -> tuple[list[float], list[tuple[int, SeriesInfo]], np.ndarray, np.ndarray]:
    """The live hour of ``tier`` up to ``newest``: the times after ``since``, the series with an entropy value
    within ``span`` (in the order shown), and copies of their entropy and too-small flags ``[series, point]``."""
    lo, hi = tier.index(newest - span, math.inf)
    shown = lo if since is None else lo + int(np.searchsorted(tier.times[lo:hi], since, side="right"))
    alive = np.flatnonzero(np.isfinite(tier.data[lo:hi, :, entropy]).any(axis=0)).tolist()
    chosen = sorted(((sid, info[sid]) for sid in alive if sid in info), key=shown_order)
    ids = [sid for sid, _ in chosen]
    values = tier.data[shown:hi, ids, entropy].T.astype(np.float64)  # [series, point], copies
    flags = tier.data[shown:hi, ids, too_small].T == 1.0
    return tier.times[shown:hi].tolist(), chosen, values, flags


def live_entries(chosen: list[tuple[int, SeriesInfo]], values: np.ndarray, flags: np.ndarray) -> list[dict]:
    """The live hour's series: entropy bits to 4 decimals (``None``: no value), too small where it was a reading."""
    missing = np.isnan(values)
    cells = np.round(values, 4).astype(object)
    cells[missing] = None
    flags &= ~missing  # a point with no value was not too small: it was not a reading
    return [series_entry(info, cells[index].tolist(), flags[index].tolist()) for index, (_, info) in enumerate(chosen)]


def chosen_series(
    info: Mapping[int, SeriesInfo], business_line: str | None, router: str | None
) -> list[tuple[int, SeriesInfo]]:
    """The series of ``business_line`` (any: None) whose router matches the glob ``router`` (any: None), as shown."""
    return sorted(
        (
            (sid, series)
            for sid, series in info.items()
            if (business_line is None or series.business_line == business_line)
            and (router is None or fnmatch.fnmatchcase(series.router, router))
        ),
        key=shown_order,
    )


def column_blocks(
    parts: list[Part], ids: np.ndarray, columns: tuple[int, int]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The times of ``parts`` and copies of the two value ``columns`` of the series ``ids``, ``[point, series]``
    (NaN for a series a tier's rows were made before)."""
    times_parts: list[np.ndarray] = []
    blocks: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for tier, lo, hi in parts:
        if not tier.columns:  # points taken before any series had a token
            continue
        width = np.minimum(ids, tier.columns - 1)
        outside = ids >= tier.columns  # series that appeared after this tier's rows were made
        for found, index in zip(blocks, columns, strict=True):
            block = tier.data[lo:hi, :, index][:, width]  # [point, series]
            block[:, outside] = np.nan
            found.append(block)
        times_parts.append(tier.times[lo:hi])
    return times_parts, *blocks


def downsample(
    times_parts: list[np.ndarray], value_parts: list[np.ndarray], small_parts: list[np.ndarray], step: float, count: int
) -> tuple[list[float], np.ndarray, np.ndarray]:
    """Each bucket of ``step`` seconds the mean of the points in it, of ``count`` series' values and too-small flags;
    buckets with no value in any series are left out. The buckets' starts, the means and the flags' means."""
    if not times_parts or not count:
        means = np.empty((0, count), dtype=np.float32)
        return [], means, means
    times = np.concatenate(times_parts)
    starts_of = np.floor(times / step) * step
    starts = np.flatnonzero(np.r_[True, np.diff(starts_of) != 0])
    means = _reduce_mean(np.concatenate(value_parts), starts)
    small = _reduce_mean(np.concatenate(small_parts), starts)
    has = np.isfinite(means).any(axis=1)
    return starts_of[starts][has].tolist(), means[has], small[has]


def history_entries(chosen: list[tuple[int, SeriesInfo]], means: np.ndarray, small: np.ndarray) -> list[dict]:
    """``GET /v1/history``'s series, those with a value: the means to 4 decimals, too small where half the samples
    were."""
    series = []
    for index, (_, info) in enumerate(chosen):
        column_values = means[:, index]
        if not np.isfinite(column_values).any():
            continue
        series.append(
            series_entry(
                info,
                [round(float(v), 4) if math.isfinite(v) else None for v in column_values],
                [bool(f >= 0.5) for f in small[:, index]],
            )
        )
    return series


def _reduce_mean(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    finite = np.isfinite(values)
    sums = np.add.reduceat(np.where(finite, values, 0.0).astype(np.float64), starts, axis=0)
    counts = np.add.reduceat(finite.astype(np.int64), starts, axis=0)
    out = np.full(sums.shape, np.nan)
    np.divide(sums, counts, out=out, where=counts > 0)
    return out
