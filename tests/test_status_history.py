"""The status page's data: the live hour (the history store's full tier, with or without a file), its sampler, the
bands from the rules, the policy counts."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from harness.helpers import FakeClock
from harness.helpers import history_record as record
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.history.store import HISTORY_FILE, HistoryStore
from mla_watch.routing.windows import RoutingSnapshot
from mla_watch.server.history import HistorySampler
from mla_watch.server.status import counter_values, entropy_band, policies_view, static_file

GATE = "model.layers.1.mlp.gate"
INDEXER = "model.layers.1.self_attn.indexer"
T0 = 1_800_000_000.0

Factory = Callable[..., HistoryStore]


@pytest.fixture(params=["memory", "file"])
def live(request: pytest.FixtureRequest, tmp_path: Path) -> Factory:
    """Makes the store the status page reads: in memory only (``--history-retention 0``), or the durable one."""
    stores: list[HistoryStore] = []

    def make(**options) -> HistoryStore:
        path = None if request.param == "memory" else tmp_path / HISTORY_FILE
        stores.append(HistoryStore(path, **options))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


def test_points_are_aligned_per_series_and_expire_after_the_span(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=30, interval_seconds=10, clock=clock)
    history.record([record(bits=5.91234), record(line=None, bits=5.95)])
    clock.now += 10
    history.record([record(bits=4.2, too_small=True), record(name=INDEXER, kind="indexer", bits=6.1)])
    clock.now += 10
    history.record([record(bits=3.0, tokens=0)])  # an empty window is no value, whatever it reads
    snap = history.recent()
    assert snap["interval_seconds"] == 10 and snap["span_seconds"] == 30
    assert snap["times"] == [clock.now - 20, clock.now - 10, clock.now]
    by_key = {(s["business_line"], s["router"]): s for s in snap["series"]}
    assert list(by_key) == [("all", GATE), ("code", GATE), ("code", INDEXER)]  # "all" first, then by line, layer
    assert by_key[("code", GATE)]["values"] == [5.9123, 4.2, None]
    assert by_key[("code", GATE)]["too_small"] == [False, True, False]
    assert by_key[("all", GATE)]["values"] == [5.95, None, None]
    assert by_key[("code", INDEXER)] == {
        "router": INDEXER,
        "layer": 1,
        "kind": "indexer",
        "business_line": "code",
        "floor_bits": 2.585,
        "ceiling_bits": 6.0,
        "num_slots": 64,
        "values": [None, 6.1, None],
        "too_small": [False, False, False],
    }

    clock.now += 25  # the first two points leave the 30 s span, and with them the "all" and indexer series
    history.record([record(bits=5.5)])
    snap = history.recent()
    assert len(snap["times"]) == 2
    assert [(s["business_line"], s["router"], s["values"]) for s in snap["series"]] == [("code", GATE, [None, 5.5])]
    assert json.loads(json.dumps(snap)) == snap  # plain JSON types throughout


def test_a_series_appears_with_its_first_token_and_a_reading_without_value_is_null(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=100, interval_seconds=1, clock=clock)
    history.record([record(bits=5.0, tokens=0)])
    assert history.recent()["series"] == [] and history.recent()["times"] == [T0]
    clock.now += 1
    history.record([record(bits=None, too_small=True)])  # tokens, but a NaN reading: nothing to draw yet
    assert history.recent()["series"] == []
    clock.now += 1
    history.record([record(bits=5.25)])
    (series,) = history.recent()["series"]
    assert series["values"] == [None, None, 5.25] and series["too_small"] == [False, False, False]


def test_since_returns_only_newer_points(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=100, interval_seconds=1, clock=clock)
    for bits in (5.1, 5.2, 5.3):
        clock.now += 1
        history.record([record(bits=bits)])
    shown = history.recent()["times"][-2]
    newer = history.recent(since=shown)
    assert newer["times"] == [clock.now] and newer["series"][0]["values"] == [5.3]
    assert history.recent(since=clock.now)["times"] == []
    assert history.recent(since=clock.now)["series"][0]["values"] == []  # the series, with nothing new


def test_a_page_passing_back_its_last_time_sees_every_point_once(live: Factory) -> None:
    # Samples come at uneven, sub-millisecond times, twice in one millisecond, several between two polls or none;
    # the page passes back the last time it has shown, through JSON, as status.js does.
    clock = FakeClock(T0)
    history = live(span_seconds=60, interval_seconds=1, clock=clock)
    steps = [0.3, 1.0004, 0.0003, 2.5, 0.7777, 1.2, 0.0004, 3.1, 0.9]
    shown: list[float] = []
    values: list[float] = []
    since = None
    for index in range(300):
        clock.now += steps[index % len(steps)]
        history.record([record(bits=5.0 + index / 1000)])
        if index % 4 == 3:
            continue  # no poll this time: the next one brings two samples
        reply = json.loads(json.dumps(history.recent(since=since)))
        shown += reply["times"]
        values += reply["series"][0]["values"] if reply["series"] else []
        if reply["times"]:
            since = reply["times"][-1]
    held = history.recent()["times"]
    assert shown == sorted(set(shown))  # never the same point twice, always in order
    assert held == shown[-len(held) :] and len(held) > 20  # none skipped: what is held was all shown
    assert len(shown) == len(values) and values == sorted(values)


def test_a_wall_clock_stepping_back_drops_the_points_after_it(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=100, interval_seconds=1, clock=clock)
    for bits in (5.1, 5.2, 5.3):
        history.record([record(bits=bits)])
        clock.now += 10
    clock.now = T0 + 5  # back 25 s: the points at T0 + 10 and T0 + 20 go, the one at T0 stays
    history.record([record(bits=4.0)])
    snap = history.recent()
    assert snap["times"] == [T0, T0 + 5] and snap["series"][0]["values"] == [5.1, 4.0]


def test_memory_is_bounded_by_the_span(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=60, interval_seconds=1, clock=clock)
    held = []
    for step in range(1000):
        clock.now += 1
        history.record([record(bits=5.0 + step % 7 / 10, line=f"line{step % 3}")])
        if step in (200, 999):
            held.append(history.tiers[0].nbytes())
    assert len(history.recent()["times"]) == 61  # points within [now - 60, now]
    assert held[0] == held[1]  # the arrays were made once, for the span


def test_the_live_hour_is_bounded_in_series_too(live: Factory) -> None:
    clock = FakeClock(T0)
    history = live(span_seconds=60, interval_seconds=10, max_series=2, clock=clock)
    history.record([record(line=line) for line in ("a", "b", "c")])
    assert [s["business_line"] for s in history.recent()["series"]] == ["a", "b"]
    assert history.dropped_series == 1


@pytest.mark.parametrize(
    ("span", "interval", "message"),
    [
        (0, 1, "span_seconds = 0: expected a positive number"),
        (60, float("nan"), "interval_seconds = nan: expected a positive number"),
        (60, True, "interval_seconds = True"),
        (60, 120, "interval_seconds = 120: expected at most span_seconds (60)"),
    ],
)
def test_bad_settings_are_refused_by_name(live: Factory, span, interval, message) -> None:
    with pytest.raises(ValueError) as info:
        live(span_seconds=span, interval_seconds=interval)
    assert message in str(info.value)


def test_the_sampler_records_on_its_thread_and_survives_a_failing_source() -> None:
    history = HistoryStore(None, span_seconds=10, interval_seconds=0.05)
    calls = []
    two = threading.Event()

    def snapshot() -> RoutingSnapshot:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the windows were busy")
        if len(calls) >= 3:
            two.set()
        return RoutingSnapshot(taken_at=0.0, records=(record(), record(line=None)), business_lines=("code",))

    sampler = HistorySampler(history, snapshot)
    sampler.start()
    try:
        assert two.wait(10)
    finally:
        sampler.stop()
    recent = history.recent()
    assert len(recent["times"]) >= 2  # the failure cost one point, not the history
    assert [s["business_line"] for s in recent["series"]] == ["all", "code"]
    assert sampler._thread is None


def test_the_sampler_takes_records_as_well_as_a_snapshot() -> None:
    clock = FakeClock(T0)
    history = HistoryStore(None, span_seconds=60, interval_seconds=10, clock=clock)
    HistorySampler(history, lambda: [record(bits=5.5)]).sample()
    assert history.recent()["series"][0]["values"] == [5.5]


SHIPPED_RULES = Path(__file__).resolve().parents[1] / "rules"


def test_the_band_comes_from_the_rules_that_watch_the_series() -> None:
    rules = load_rules_dir(SHIPPED_RULES).rules
    gate = {
        "router": GATE,
        "layer": 1,
        "kind": "expert",
        "business_line": "code",
        "num_slots": 64,
        "floor_bits": 2.585,
        "ceiling_bits": 6.0,
    }
    band = entropy_band(rules, gate)
    sides = ("fire_below", "resolve_above", "fire_above", "resolve_below")
    assert [band[side] for side in sides] == [5.0, 5.2, 6.5, 6.3]
    assert band["rules"] == ["RoutingEntropyLow", "RoutingEntropyHigh"] and band["inherited"] is False
    # An 8-expert top-2 router (1-3 bits): the relative rules, drawn in bits.
    mixtral = entropy_band(rules, {**gate, "num_slots": 8, "floor_bits": 1.0, "ceiling_bits": 3.0})
    assert [mixtral[side] for side in sides] == [2.4, 2.5, 2.99, 2.98]
    assert mixtral["rules"] == ["RoutingCollapse", "RoutingEntropyNearCeiling"]
    # The shipped rules watch each line, not their sum: the sum shows the band they give the router.
    summed = entropy_band(rules, {**gate, "business_line": "all"})
    assert summed["fire_below"] == 5.0 and summed["inherited"] is True
    # No entropy rule watches an indexer: no band, the page shows floor..ceiling.
    indexer = entropy_band(rules, {"router": INDEXER, "layer": 1, "kind": "indexer", "business_line": "code"})
    assert indexer == {
        "fire_below": None,
        "resolve_above": None,
        "fire_above": None,
        "resolve_below": None,
        "rules": [],
        "inherited": False,
    }


def test_of_several_rules_the_first_to_fire_sets_each_side(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("""
receivers: [{name: oncall, type: alertmanager_webhook, url: "http://127.0.0.1:9/hook"}]
rules:
  - {alert: Low, metric: entropy_bits, select: {kind: expert}, below: 4.5, resolve_above: 4.8}
  - {alert: LowerForCode, metric: entropy_bits, select: {business_line: code}, below: 5.1}
  - {alert: Dead, metric: dead_slots, select: {}, above: 3}
""")
    band = entropy_band(
        load_rules_dir(tmp_path).rules, {"router": GATE, "layer": 1, "kind": "expert", "business_line": "code"}
    )
    assert band["fire_below"] == 5.1 and band["resolve_above"] == 5.1 and band["fire_above"] is None
    assert band["rules"] == ["Low", "LowerForCode"]


def test_policy_counts_come_from_the_labelled_counters() -> None:
    registry = CollectorRegistry()
    adjustments = Counter("adj", "x", ["business_line", "task", "param"], registry=registry)
    rejections = Counter("rej", "x", ["business_line", "task", "param"], registry=registry)
    adjustments.labels("code_assistant", "code", "temperature").inc(3)
    adjustments.labels("code_assistant", "code", "top_p").inc()
    adjustments.labels("code_assistant", "chat", "temperature").inc()
    rejections.labels("code_assistant", "sql", "temperature").inc(2)
    defaults = Counter("dflt", "x", ["business_line", "task", "param"], registry=registry)
    defaults.labels("code_assistant", "code", "repetition_penalty").inc(5)
    assert counter_values(adjustments) == {
        ("code_assistant", "code", "temperature"): 3.0,
        ("code_assistant", "code", "top_p"): 1.0,
        ("code_assistant", "chat", "temperature"): 1.0,
    }
    policies = {
        "business_lines": {
            "code_assistant": {
                "description": "code",
                "default_task": "code",
                "source": "p.yaml",
                "tasks": {
                    "code": {"on_violation": "clamp", "params": {}},
                    "sql": {"on_violation": "reject", "params": {}},
                    "chat": {"on_violation": "clamp", "params": {}},
                },
            }
        }
    }
    view = policies_view(policies, counter_values(adjustments), counter_values(rejections), counter_values(defaults))
    tasks = {task["task"]: task for task in view[0]["tasks"]}
    assert tasks["code"]["adjustments"] == {"temperature": 3, "top_p": 1} and tasks["code"]["rejections"] == {}
    assert tasks["sql"]["rejections"] == {"temperature": 2} and tasks["chat"]["adjustments"] == {"temperature": 1}
    assert tasks["code"]["defaults"] == {"repetition_penalty": 5} and tasks["chat"]["defaults"] == {}
    assert view[0]["business_line"] == "code_assistant" and view[0]["default_task"] == "code"


def test_the_page_files_ship_in_the_package() -> None:
    html, media_type = static_file("index.html")
    assert media_type.startswith("text/html")
    assert b'src="static/status.js"' in html and b'href="static/status.css"' in html
    # No CDN: every file the page loads is a relative path to this sidecar, and so is what it fetches.
    assert b"://" not in html and b'="//' not in html
    for name in ("status.js", "status.css"):
        assert b"://" not in static_file(name)[0]
    assert b"fetch(url" in static_file("status.js")[0]
    with pytest.raises(KeyError):
        static_file("../app.py")
