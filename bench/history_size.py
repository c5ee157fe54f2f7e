"""The durable routing history at DeepSeek-V3 scale: file size against its documented bound, write and read costs.

    python -m bench.history_size                 # 30 simulated days, 58 routers x (5 lines + all)
    python -m bench.history_size --routers 128 --lines 7   # 1,024 series: --history-max-series' default
    python -m bench.history_size --json figures.json

The clock is simulated: days 1-29 are sampled every 15 min, the last day every minute and the last
``--fine-hours`` at the 10 s default (the tiers hold the same points either way: the final file is
the steady state of a sidecar sampling every 10 s for 30 days, written in under a minute instead of
259,200 samples). Write time per sample is measured on the 10 s part. Then the file is reopened
(load time), ``points()`` is timed over a day, and the same minute tier is written in the layout
not chosen (one row per series per point) to compare bytes per series-point. Last, the largest
``GET /v1/history`` answer the store can give: for each metric, 30 days of every series at the finest
step ``MAX_CELLS`` allows, with the shipped rules' bands, encoded as the sidecar encodes it; its bytes
against ``MAX_ANSWER_BYTES``. Every statistic moves in its own range, so values carry their 4 decimals:
the widest text a real router writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np
from starlette.responses import JSONResponse

from mla_watch.alerting.rules import load_rules_dir
from mla_watch.history.store import HISTORY_FILE, HISTORY_METRICS, VALUES, HistoryStore, size_bound
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import RoutingStats
from mla_watch.routing.windows import RouterStats
from mla_watch.server.history_api import MAX_ANSWER_BYTES, MAX_CELLS, MAX_POINTS, MAX_RANGE_SECONDS
from mla_watch.server.status import entropy_band

DAY = 86400.0
START = 1_800_000_000.0
RULES = Path(__file__).resolve().parents[1] / "rules"


class SimulatedClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def records_for(routers: int, lines: int, rng: np.random.Generator) -> list[RouterStats]:
    records = []
    for layer in range(3, 3 + routers):
        info = RouterInfo(name=f"model.layers.{layer}.mlp.gate", layer=layer, kind="expert", num_slots=256, top_k=8)
        for line in [None, *(f"line_{index}" for index in range(lines))]:
            records.append(RouterStats(info, line, moved(rng)))
    return records


def moved(rng: np.random.Generator) -> RoutingStats:
    """New statistics, each in the range a 256-expert top-8 router gives it (bits_below_ceiling follows)."""
    bits = float(rng.uniform(5.0, 7.5))
    tokens = int(rng.integers(1024, 4097))
    return RoutingStats(
        kind="expert",
        num_slots=256,
        top_k=8,
        tokens=tokens,
        selections=8 * tokens,
        entropy_bits=bits,
        floor_bits=3.0,
        ceiling_bits=8.0,
        normalized_entropy=(bits - 3.0) / 5.0,
        max_violation=float(rng.uniform(1.0, 3.0)),
        dead_slots=int(rng.integers(0, 9)),
        js_divergence=float(rng.uniform(0.0, 0.1)),
        locality=float(rng.uniform(0.0, 1.0)),
        min_tokens=1024,
        too_small=False,
    )


def largest_answer(store: HistoryStore, until: float) -> tuple[int, str, float]:
    """``(bytes, metric, step)`` of the largest /v1/history answer: every series over 30 days, the finest step."""
    series = len(store.series())
    buckets = min(MAX_CELLS // series, MAX_POINTS + 1)  # the store counts ceil(span / step) + 1 buckets
    step = math.ceil(MAX_RANGE_SECONDS / (buckets - 1) * 1000) / 1000
    rules = list(load_rules_dir(RULES).rules)
    largest = (0, "", step)
    for metric in HISTORY_METRICS:
        body = store.query(since=until - MAX_RANGE_SECONDS, until=until, step=step, metric=metric, max_cells=MAX_CELLS)
        for entry in body["series"]:
            entry["band"] = entropy_band(rules if metric == "entropy_bits" else [], entry)
        largest = max(largest, (len(JSONResponse(body).body), metric, step))
    return largest


def file_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob(HISTORY_FILE + "*"))


def row_layout_bytes(store: HistoryStore, directory: Path) -> float:
    """Bytes per series-point of the minute tier written as one row per (series, point)."""
    tier = store.tiers[1]
    path = directory / "rows.sqlite"
    db = sqlite3.connect(path)
    columns = ", ".join(f"v{index} REAL" for index in range(len(VALUES)))
    db.execute(
        f"CREATE TABLE points (tier TEXT, t REAL, series INTEGER, {columns}, "
        "PRIMARY KEY (tier, t, series)) WITHOUT ROWID"
    )
    cells = 0
    marks = ", ".join("?" * (len(VALUES) + 3))
    for index in range(tier.start, tier.end):
        rows = [
            ("minute", float(tier.times[index]), sid, *map(float, tier.data[index, sid]))
            for sid in range(tier.columns)
            if np.isfinite(tier.data[index, sid]).any()
        ]
        db.executemany(f"INSERT INTO points VALUES ({marks})", rows)
        cells += len(rows)
    db.commit()
    db.close()
    return path.stat().st_size / max(1, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=float, default=30.0, help="retention simulated (default %(default)s)")
    parser.add_argument("--routers", type=int, default=58, help="MoE routers (DeepSeek-V3: 58)")
    parser.add_argument("--lines", type=int, default=5, help="business lines, besides their sum")
    parser.add_argument("--fine-hours", type=float, default=2.0, help="last hours sampled every 10 s")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    records = records_for(args.routers, args.lines, rng)
    series = len(records)
    end = START + args.days * DAY
    clock = SimulatedClock(START)
    with tempfile.TemporaryDirectory(prefix="mla-watch-history-") as tmp:
        directory = Path(tmp)
        store = HistoryStore(directory / HISTORY_FILE, interval_seconds=10.0, retention_days=args.days, clock=clock)
        began = time.perf_counter()
        samples = fine_samples = 0
        fine_seconds = 0.0
        for start, step in ((START, 900.0), (end - DAY, 60.0), (end - args.fine_hours * 3600, 10.0)):
            clock.now = max(clock.now, start)
            stop = end if step == 10.0 else min(end - DAY if step == 900.0 else end - args.fine_hours * 3600, end)
            while clock.now < stop:
                for index in range(int(clock.now // step) % 7, series, 7):  # movement: means carry real floats
                    records[index] = dataclasses.replace(records[index], stats=moved(rng))
                tick = time.perf_counter()
                store.record(records)
                if step == 10.0:
                    fine_seconds += time.perf_counter() - tick
                    fine_samples += 1
                samples += 1
                clock.now += step
        written = time.perf_counter() - began
        memory = store.nbytes()
        points_kept = [len(tier) for tier in store.tiers]
        store.close()
        size = file_bytes(directory)
        bound = size_bound(series=series, interval_seconds=10.0, span_seconds=3600.0, retention_days=args.days)
        tick = time.perf_counter()
        again = HistoryStore(directory / HISTORY_FILE, interval_seconds=10.0, retention_days=args.days, clock=clock)
        load_s = time.perf_counter() - tick
        router = records[0].router.name
        calls = 1000
        tick = time.perf_counter()
        for _ in range(calls):
            times, _ = again.points(router, "all", "entropy_bits", clock.now - DAY, clock.now)
        points_us = (time.perf_counter() - tick) / calls * 1e6
        tick = time.perf_counter()
        body = again.query(since=clock.now - args.days * DAY + 1, until=clock.now, step=3600.0)
        query_ms = (time.perf_counter() - tick) * 1e3
        rows_per_point = row_layout_bytes(again, directory)
        answer_bytes, answer_metric, answer_step = largest_answer(again, clock.now)
        again.close()
    packed_per_point = len(VALUES) * 4
    figures = {
        "series": series,
        "days": args.days,
        "samples": samples,
        "points_kept": points_kept,
        "file_bytes": size,
        "bound_bytes": bound,
        "size_ratio": size / bound,
        "bytes_per_series_day": size / series / args.days,
        "memory_bytes": memory,
        "write_ms_per_sample": fine_seconds / max(1, fine_samples) * 1e3,
        "written_s": written,
        "load_s": load_s,
        "points_us_day": points_us,
        "points_returned": len(times),
        "query_30d_hourly_ms": query_ms,
        "query_columns": len(body["times"]),
        "packed_bytes_per_series_point": packed_per_point,
        "row_layout_bytes_per_series_point": rows_per_point,
        "largest_answer_bytes": answer_bytes,
        "largest_answer_metric": answer_metric,
        "largest_answer_step_seconds": answer_step,
        "answer_bound_bytes": MAX_ANSWER_BYTES,
    }
    print(
        f"{series} series ({args.routers} routers x ({args.lines} lines + all)), {args.days:g} simulated days, "
        f"{samples} samples in {written:.1f} s"
    )
    print(f"points kept per tier (10 s / 1 min / 15 min): {points_kept}")
    print(
        f"file: {size / 2**20:.1f} MiB; documented bound {bound / 2**20:.1f} MiB: ratio {size / bound:.3f}; "
        f"{size / series / args.days / 1024:.1f} KiB per series-day of retention"
    )
    print(f"memory held by the tiers: {memory / 2**20:.1f} MiB")
    print(
        f"write: {figures['write_ms_per_sample']:.2f} ms per 10 s sample of {series} series "
        f"({100 * figures['write_ms_per_sample'] / 10000:.3f}% of a core)"
    )
    print(
        f"restart: {load_s:.2f} s to load; points() over a day ({len(times)} points): {points_us:.0f} us; "
        f"30 days hourly for every series: {query_ms:.0f} ms"
    )
    print(
        f"layout: packed rows {packed_per_point} B per series-point (+ page overhead); one row per series-point "
        f"measured {rows_per_point:.0f} B"
    )
    print(
        f"largest GET /v1/history answer: {answer_bytes:,} bytes ({answer_metric}, {series} series, 30 days at "
        f"step {answer_step:g} s, MAX_CELLS {MAX_CELLS:,}); bound MAX_ANSWER_BYTES {MAX_ANSWER_BYTES:,}: ratio "
        f"{answer_bytes / MAX_ANSWER_BYTES:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
