"""The durable routing history: tiers and their means, points(), restart, the size bound, bad files, clock steps."""

from __future__ import annotations

import logging
import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from harness.helpers import FakeClock
from harness.helpers import history_record as record
from mla_watch.alerting.vocabulary import METRICS
from mla_watch.common.state_writes import StateWrites
from mla_watch.history.store import HISTORY_METRICS, LIVE_METRICS, HistoryStore, size_bound
from tests.mounts import fill, small_tmpfs

GATE = "model.layers.1.mlp.gate"
T0 = 1_800_000_000.0  # a multiple of 900: buckets start on it


def store_at(tmp_path: Path, clock: FakeClock, **options) -> HistoryStore:
    return HistoryStore(tmp_path / "history.sqlite", clock=clock, **{"interval_seconds": 10.0, **options})


def test_the_metrics_kept_are_the_rules_metrics_and_tokens() -> None:
    # long_context_drift is left out: the file's points have a fixed width (tests/test_positions.py)
    assert (*(metric for metric in METRICS if metric != "long_context_drift"), "tokens") == HISTORY_METRICS


def test_minute_and_quarter_points_are_the_means_of_their_buckets(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock)
    # 10 s samples for 16 minutes: minute m holds six samples of 5 + m/10 (one of them NaN, one too small).
    for step in range(16 * 6 + 1):
        clock.now = T0 + 10 * step
        minute, index = divmod(step, 6)
        bits = None if index == 3 else 5.0 + minute / 10 + (0.06 if index == 5 else 0.0)
        store.record([record(bits=bits, tokens=100 * (index + 1), too_small=index == 0), record(line=None, bits=4.0)])
    times, _values = store.points(GATE, "code", "entropy_bits", T0, clock.now)
    # The full tier holds the last hour: every sample, the NaN ones skipped.
    assert len(times) == 16 * 5 + 1 and times[0] == T0 and times[-1] == clock.now
    minute_tier, quarter_tier = store.tiers[1], store.tiers[2]
    assert minute_tier.live_times().tolist() == [T0 + 60 * m for m in range(16)]  # the 16th closed by the last sample
    column = HISTORY_METRICS.index("entropy_bits")
    for m in range(16):  # (5 values of 5 + m/10, one of them + 0.06) / 5
        assert minute_tier.data[minute_tier.start + m, 0, column] == pytest.approx(5.0 + m / 10 + 0.012, abs=1e-5)
    tokens = minute_tier.data[minute_tier.start, 0, HISTORY_METRICS.index("tokens")]
    assert tokens == pytest.approx(350.0)  # averaged (100..600), not summed: tokens is the window's level
    assert minute_tier.data[minute_tier.start, 0, -1] == pytest.approx(1 / 6)  # the too-small fraction
    # The first quarter closed when the 16th minute point came: the mean of its 15 minute points.
    assert quarter_tier.live_times().tolist() == [T0]
    expected = np.mean([5.0 + m / 10 + 0.012 for m in range(15)])
    assert quarter_tier.data[quarter_tier.start, 0, column] == pytest.approx(expected, abs=1e-5)
    assert quarter_tier.data[quarter_tier.start, 1, column] == pytest.approx(4.0)  # the "all" series
    store.close()


def test_points_serve_the_finest_tier_for_each_part_of_the_range(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock, span_seconds=600)  # the full tier keeps 10 minutes
    for step in range(3 * 360):  # three hours of 10 s samples: entropy = the minute number
        clock.now = T0 + 10 * step
        store.record([record(bits=float(step // 6))])
    now = clock.now
    times, values = store.points(GATE, "code", "entropy_bits", now - 2 * 3600, now)
    full_first = store.tiers[0].first
    assert full_first == now - 600
    coarse = [(t, v) for t, v in zip(times, values, strict=True) if t < full_first]
    fine = [(t, v) for t, v in zip(times, values, strict=True) if t >= full_first]
    assert all(t % 60 == 0 for t, _ in coarse) and [v for t, v in coarse] == [t_ // 60 - T0 // 60 for t_, _ in coarse]
    assert [t for t, _ in fine] == [full_first + 10 * k for k in range(61)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[0] == T0 + 3600  # the first minute point at or after since (now - 2 h = T0 + 3590)
    assert store.points(GATE, "code", "entropy_bits", T0 + 3600, T0 + 3660)[0] == [T0 + 3600, T0 + 3660]  # inclusive
    # Other metrics, an unknown series and an unknown metric.
    assert store.points(GATE, "code", "dead_slots", now - 30, now)[1] == [2.0, 2.0, 2.0, 2.0]
    assert store.points(GATE, "code", "js_divergence", now - 30, now) == ([], [])  # never set: skipped
    assert store.points(GATE, "sql", "entropy_bits", now - 30, now) == ([], [])
    with pytest.raises(ValueError, match="metric = 'entropy': expected one of entropy_bits"):
        store.points(GATE, "code", "entropy", now - 30, now)
    store.close()


def test_a_restart_keeps_every_tier_and_the_open_bucket(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock)
    for step in range(100):
        clock.now = T0 + 10 * step
        store.record([record(bits=5.0 + step / 1000), record(line=None, bits=4.5)])
    before = {metric: store.points(GATE, "code", metric, T0, clock.now) for metric in HISTORY_METRICS}
    minutes = store.tiers[1].live_times().tolist()
    store._db._db.close()  # as a SIGKILL leaves it: no close(), no checkpoint
    again = store_at(tmp_path, clock)
    assert {metric: again.points(GATE, "code", metric, T0, clock.now) for metric in HISTORY_METRICS} == before
    assert again.tiers[1].live_times().tolist() == minutes
    clock.now += 60  # the minute left open by the first process closes in the second, from the stored samples
    again.record([record(bits=6.0)])
    assert again.tiers[1].live_times().tolist() == [*minutes, minutes[-1] + 60]
    again.close()


def test_the_file_stays_within_its_documented_bound(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    series = 24
    store = store_at(tmp_path, clock, interval_seconds=60, span_seconds=600, retention_days=1.5)
    records = [
        record(name=f"model.layers.{layer}.mlp.gate", layer=layer, line=line, bits=5.0)
        for layer in range(4)
        for line in ("a", "b", "c", "d", "e", None)
    ]
    assert len(records) == series
    for step in range(int(2.5 * 1440)):  # 2.5 days of 1-minute samples: every tier full, then expiring
        clock.now = T0 + 60 * step
        store.record(records)
    # span / step + 1 samples; a day of minutes and 1.5 days of quarters, less the bucket still open
    assert [len(tier) for tier in store.tiers] == [11, 1440, 143]
    store.close()
    size = sum(path.stat().st_size for path in tmp_path.glob("history.sqlite*"))
    bound = size_bound(series=series, interval_seconds=60, span_seconds=600, retention_days=1.5)
    assert size <= bound, (size, bound)
    assert size > bound / 4  # the bound is a bound, not a guess ten times too large


def test_series_past_max_series_are_counted_and_logged_once(tmp_path: Path, caplog) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock, max_series=2)
    with caplog.at_level(logging.WARNING, logger="mla_watch.history.store"):
        for step in range(3):
            clock.now = T0 + 10 * step
            store.record([record(line=line) for line in ("a", "b", "c", "d")])
    assert [(s.router, s.business_line) for s in store.series()] == [(GATE, "a"), (GATE, "b")]
    assert store.dropped_series == 6  # two series, three samples
    assert len([r for r in caplog.records if "--history-max-series" in r.getMessage()]) == 1
    assert store.points(GATE, "c", "entropy_bits", T0, clock.now) == ([], [])
    store.close()


def test_a_series_with_no_value_left_gives_its_slot_back(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock, max_series=1, span_seconds=120, retention_days=1)
    store.record([record(line="old")])
    step = 0
    while store.series():  # "old" leaves every tier after a day and a quarter or so
        step += 1
        clock.now = T0 + 900 * step
        store.record([record(line="old", tokens=0)])  # its window is empty: it is not a value
        assert step < 200
    assert step * 900 > 86400
    clock.now += 900
    store.record([record(line="new")])
    assert [s.business_line for s in store.series()] == ["new"] and store.dropped_series == 0
    store.close()


def test_a_wall_clock_stepping_back_drops_the_points_after_it(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock)
    for step in range(30):
        clock.now = T0 + 10 * step
        store.record([record(bits=5.0)])
    clock.now = T0 + 95  # back 195 s: the samples after it, and the minute points their buckets made, go
    store.record([record(bits=4.0)])
    times, values = store.points(GATE, "code", "entropy_bits", 0, math.inf)
    assert times == [T0 + 10 * k for k in range(10)] + [T0 + 95] and values[-1] == 4.0
    assert store.tiers[1].live_times().tolist() == [T0]  # [T0+60, T0+120) reached past T0+95: recomputed later
    clock.now = T0 + 95  # the same second again: not a second point
    store.record([record(bits=3.0)])
    for step in range(10, 20):
        clock.now = T0 + 100 + 10 * step
        store.record([record(bits=4.0)])
    store.close()
    again = store_at(tmp_path, clock)  # the file agrees with memory: in order, nothing from the dropped future
    times, values = again.points(GATE, "code", "entropy_bits", 0, math.inf)
    assert times == sorted(times) and T0 + 100 not in times and values[10] == 4.0
    assert again.tiers[1].live_times().tolist() == [T0, T0 + 60, T0 + 180]  # no sample in [T0+120, T0+180)
    again.close()


def test_an_unreadable_file_is_set_aside_and_the_history_starts_empty(tmp_path: Path, caplog) -> None:
    path = tmp_path / "history.sqlite"
    path.write_bytes(b"this is not an SQLite file at all, and it is long enough to be looked at" * 100)
    clock = FakeClock(T0)
    with caplog.at_level(logging.ERROR, logger="mla_watch.history.store"):
        store = store_at(tmp_path, clock)
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(path) in m and "unreadable" in m and "history.sqlite.corrupt" in m for m in messages), messages
    assert (tmp_path / "history.sqlite.corrupt").read_bytes().startswith(b"this is not")
    store.record([record()])
    assert store.points(GATE, "code", "entropy_bits", 0, math.inf) == ([T0], [5.0])
    store.close()


def test_a_database_with_bad_points_is_set_aside_too(tmp_path: Path, caplog) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock)
    store.record([record()])
    store.close()
    with sqlite3.connect(tmp_path / "history.sqlite") as db:
        db.execute("UPDATE points SET data = x'0102'")  # not a whole number of float32 rows
    with caplog.at_level(logging.ERROR, logger="mla_watch.history.store"):
        again = store_at(tmp_path, clock)
    assert any("expected a packed float32 array" in r.getMessage() for r in caplog.records)
    assert again.series() == [] and (tmp_path / "history.sqlite.corrupt").exists()
    again.close()


def test_the_live_hour_survives_a_restart_with_the_file(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    store = store_at(tmp_path, clock)
    for step in range(30):
        clock.now = T0 + 10 * step
        store.record([record(bits=5.0 + step / 100), record(line=None, bits=4.5, too_small=step % 2 == 0)])
    before = store.recent()
    store._db._db.close()  # as a SIGKILL leaves it
    again = store_at(tmp_path, clock)
    assert again.recent() == before and len(before["times"]) == 30
    assert again.recent(since=before["times"][-2])["times"] == [clock.now]
    again.close()


def test_without_a_file_the_store_is_the_live_hour_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    clock = FakeClock(T0)
    store = HistoryStore(None, interval_seconds=10, span_seconds=120, clock=clock)
    assert not store.durable and [tier.name for tier in store.tiers] == ["full"]
    assert store.metrics == LIVE_METRICS and store.tiers[0].retention == 120  # no 2-minute floor: no minute tier
    for step in range(40):
        clock.now = T0 + 10 * step
        store.record([record(bits=5.0 + step / 100)])
    times, values = store.points(GATE, "code", "entropy_bits", 0, math.inf)
    assert times == [T0 + 10 * k for k in range(27, 40)] and values[-1] == pytest.approx(5.39)
    assert store.points(GATE, "code", "tokens", clock.now, clock.now) == ([clock.now], [200.0])
    with pytest.raises(ValueError, match="metric = 'max_violation': expected one of entropy_bits, tokens"):
        store.points(GATE, "code", "max_violation", 0, math.inf)
    store.close()
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_without_a_file_a_series_gives_its_slot_back_once_it_leaves_the_span() -> None:
    clock = FakeClock(T0)
    store = HistoryStore(None, interval_seconds=10, span_seconds=60, max_series=1, clock=clock)
    store.record([record(line="old")])
    for step in range(1, 7):  # "old" reports empty windows: its one value is within the span for 60 s
        clock.now = T0 + 10 * step
        store.record([record(line="old", tokens=0), record(line="new")])
        assert [s.business_line for s in store.series()] == ["old"]
    clock.now += 10
    store.record([record(line="old", tokens=0), record(line="new")])  # the value left: the slot is free
    clock.now += 10
    store.record([record(line="new")])
    assert [s.business_line for s in store.series()] == ["new"] and store.dropped_series == 7
    assert [s["business_line"] for s in store.recent()["series"]] == ["new"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retention_days": 0.5}, "retention_days = 0.5: expected at least 1"),
        ({"interval_seconds": float("nan")}, "interval_seconds = nan: expected a positive number"),
        ({"max_series": 0}, "max_series = 0: expected a positive integer"),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store_at(tmp_path, FakeClock(T0), **options)


def test_samples_the_disk_refused_are_written_from_memory_once_there_is_room(tmp_path: Path) -> None:
    """A full disk costs the file nothing: the tiers go on in memory, and the first sample the disk takes again
    brings the file level with them (a store opened on it afterwards reads every point memory held)."""
    clock = FakeClock(T0)
    routers = [f"model.layers.{layer}.mlp.gate" for layer in range(1, 61)]  # rows of some KB: the WAL must grow

    def sample() -> None:
        store.record(
            [
                record(name, line=line, bits=5.0 + (clock.now - T0) / 1e4)
                for name in routers
                for line in ("code", "sql", None)
            ]
        )
        clock.now += 10

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        writes = StateWrites(disk)
        store = HistoryStore(disk / "history.sqlite", interval_seconds=10.0, clock=clock, writes=writes)
        for _ in range(3):
            sample()
        filler = fill(disk)
        for _ in range(15):  # across a minute boundary: a minute point is refused too
            sample()
        assert [entry["file"] for entry in writes.failing()] == ["history.sqlite"]
        assert writes.failing()[0]["problem"] == "the disk is full"
        held = {tier.name: tier.live_times().tolist() for tier in store.tiers}
        assert len(held["full"]) == 18 and held["minute"]
        filler.unlink()
        sample()
        assert writes.failing() == []
        expected = store.points(routers[0], "code", "entropy_bits", T0, clock.now)
        kept = {tier.name: tier.live_times().tolist() for tier in store.tiers}
        assert all(set(times) <= set(kept[name]) for name, times in held.items())
        store.close()
        reopened = HistoryStore(disk / "history.sqlite", interval_seconds=10.0, clock=clock)
        assert {tier.name: tier.live_times().tolist() for tier in reopened.tiers} == kept
        times, values = reopened.points(routers[0], "code", "entropy_bits", T0, clock.now)
        assert list(times) == list(expected[0]) and len(times) == 19 and np.allclose(values, expected[1])
        reopened.close()
