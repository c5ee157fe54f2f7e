"""Reference readings yield to clients beside vLLM: one reference request in flight at most, vLLM's request
priority sent only where asked for, a reading that waits while clients wait longer than usual and a round that
stops early then resumes, and a reading cancelled at a stop that sends nothing more (a twin of vLLM on loopback
answers them)."""

from __future__ import annotations

import json

import pytest

from harness.helpers import FakeClock
from harness.support import serve_app, wait_until
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.vllm_weights import VllmWeights
from mla_watch.references.client_load import ClientLatency
from mla_watch.references.prober import ReferenceProber, ReferenceSettings
from mla_watch.references.prompts import ReferenceSet, ReferenceSets
from mla_watch.references.readers import EngineReader, ReadingAbandoned
from mla_watch.references.readings import ReferenceBaselines
from tests.slow_engine import ReferenceTwin

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
SET = ReferenceSet(
    "default",
    1,
    (
        "where is my order",
        "summarise the report",
        "reverse a linked list",
        "what is the refund policy",
        "translate this to french",
        "explain the error",
    ),
)


@pytest.mark.parametrize("priority", [None, 10])
def test_one_reference_request_in_flight_with_vllms_priority_only_where_asked_for(priority: int | None) -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry, score_seconds=0.05)
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        weights.priority = priority
        try:
            reading = EngineReader(weights, geometry, rate=1000.0).read(SET)
        finally:
            weights.close()
    assert reading.tokens > 0 and twin.scored == len(SET.prompts)
    assert twin.most_scoring == 1  # the engine's batch holds one reference prompt at most: clients come first
    sent = [body.get("priority", "absent") for body in twin.scoring_bodies]
    assert sent == ["absent" if priority is None else priority] * len(SET.prompts), json.dumps(sent)


def test_a_cancelled_reader_sends_no_further_request() -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry)
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        reader = EngineReader(weights, geometry, rate=1000.0)
        reader.read(SET)  # tokenized once per set: what a reading sends is then only its prompts
        scored = twin.scored
        reader.cancel()
        try:
            with pytest.raises(ReadingAbandoned, match="the sidecar is stopping"):
                reader.read(SET)
        finally:
            weights.close()
    assert twin.scored == scored


def test_clients_are_busy_while_their_recent_latency_is_well_above_its_usual_level() -> None:
    clock = FakeClock(0.0)
    latency = ClientLatency(ratio=1.5, quiet_seconds=30.0, clock=clock)
    for _ in range(30):
        latency.observe(0.2)
    assert not latency.busy()
    for _ in range(4):  # the engine is loaded: each answer takes three times as long
        latency.observe(0.6)
    assert latency.busy()
    clock.advance(31.0)  # nobody has asked for a while: nobody waits
    assert not latency.busy()
    clock.advance(-31.0)
    for _ in range(10):
        latency.observe(0.2)
    assert not latency.busy()


def test_a_reading_waits_while_clients_are_busy_then_goes_on() -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry)
    looks = iter([True, True, True])  # busy for three looks, then not
    slept: list[float] = []
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        reader = EngineReader(
            weights, geometry, rate=1000.0, sleep=slept.append, busy=lambda: next(looks, False), yield_seconds=30.0
        )
        try:
            with reader.yielding():
                reader.read(SET)
            unyielding = EngineReader(weights, geometry, rate=1000.0, sleep=slept.append, busy=lambda: True)
            unyielding.read(SET)  # a re-tune gate's reading: outside yielding(), it does not wait
        finally:
            weights.close()
    yields = [seconds for seconds in slept if seconds > 1 / 1000.0]  # the rest paces 1000 prompts/s at most
    assert yields == [0.5, 0.5, 0.5] and reader.yielded_seconds == pytest.approx(1.5)
    assert twin.scored == 2 * len(SET.prompts) and reader.deferred == 0


def test_a_round_stopped_for_clients_is_taken_again_later_and_is_no_failure() -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry)
    lines = ReferenceSets({name: ReferenceSet(name, 1, SET.prompts) for name in ("alpha", "bravo", "default")})
    busy = [True]
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        reader = EngineReader(
            weights, geometry, rate=1000.0, sleep=lambda seconds: None, busy=lambda: busy[0], yield_seconds=2.0
        )
        judge = ReferenceProber(
            lambda: lines,
            reader,
            ReferenceBaselines(),
            settings=ReferenceSettings(interval_seconds=0, retry_seconds=0.2),
        )
        try:
            judge.start()
            assert wait_until(lambda: judge.describe()["rounds_deferred"] >= 1, timeout=20)
            assert twin.scored == 0 and judge.readings() == {}
            assert all(entry["last_failure"] is None for entry in judge.describe()["sets"])
            busy[0] = False  # clients are served as usual again: the round resumes by itself
            assert wait_until(lambda: set(judge.readings()) == {"alpha", "bravo", "default"}, timeout=20)
        finally:
            judge.stop(timeout=10)
            weights.close()
