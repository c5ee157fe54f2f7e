"""Traffic or damage, in parts: reference prompt files, readings against their baselines, the cause of an alert
(as the alert engine asks for it and holds the firing for it), clients and their shares, fair capture.

The reader here is a stand-in for the model (its routing of each set is set by the test); the real model and
the real vLLM read them in tests/test_traffic_or_damage.py and tests/test_real_vllm_causes.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from harness.helpers import FakeClock, engine_record
from mla_watch.alerting.alert_engine import AlertEngine
from mla_watch.alerting.causes import Cause
from mla_watch.alerting.vocabulary import Rule, RuleSet, Selector
from mla_watch.quality.band import Band
from mla_watch.quality.score import ModelScore
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.prober import ReferenceProber, ReferenceSettings
from mla_watch.references.prompts import ReferenceSet, ReferenceSetError, ReferenceSets, load_reference_dir
from mla_watch.references.readers import ReferenceReader
from mla_watch.references.readings import ReferenceBaselines
from mla_watch.retune.capture import TrafficCapture
from mla_watch.routing.clients import OTHER, UNKNOWN, ClientShares, client_id, parse_client_id_sources
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import compute_stats
from mla_watch.routing.windows import RouterStats
from mla_watch.shipped import SHIPPED_REFERENCES

GATE = RouterInfo("model.layers.1.mlp.gate", 1, "expert", 64, 6)
BALANCED = np.full(64, 96, dtype=np.int64)  # 1024 tokens x top-6, every expert alike: 6 bits
COLLAPSED = np.concatenate([np.full(6, 1024, dtype=np.int64), np.zeros(58, dtype=np.int64)])  # 2.585 bits


def score(counts: np.ndarray, losses: tuple[float, ...] = (10.0,) * 8) -> ModelScore:
    tokens = int(counts.sum()) // GATE.top_k
    stats = compute_stats(counts, kind="expert", top_k=GATE.top_k, tokens=tokens)
    return ModelScore(
        perplexity=2.0,
        tokens=tokens,
        routers={GATE.name: RouterStats(GATE, "set", stats, counts)},
        losses=list(losses),
        counts=[60] * len(losses),
    )


class Routed(ReferenceReader):
    """The model: it routes every set as ``counts`` says (a test changes them to damage the router)."""

    where = "the test's model"

    def __init__(self) -> None:
        self.counts = BALANCED
        self.reads: list[str] = []
        self.fail: str | None = None
        self.go = threading.Event()  # cleared: a reading under way, not ended yet
        self.go.set()

    def read(self, reference: ReferenceSet) -> ModelScore:
        assert self.go.wait(20)
        if self.fail:
            raise RuntimeError(self.fail)
        self.reads.append(reference.name)
        return score(self.counts)


def sets(*names: str) -> ReferenceSets:
    return ReferenceSets(
        {name: ReferenceSet(name, 1, (f"{name} a", f"{name} b", f"{name} c", f"{name} d")) for name in names}
    )


LOW = Rule(
    name="RoutingEntropyLow",
    metric="entropy_bits",
    selector=Selector(kind="expert", business_line="*"),
    below=5.0,
    resolve_above=5.2,
    severity="critical",
    actions=("notify", "retune"),
    annotations={"summary": "{value:.2f} bits"},
    traffic_receivers=("owners",),
)


# --------------------------------------------------------------------------- files
def test_the_shipped_sets_load_one_per_line_a_mixed_default_and_a_long_set() -> None:
    loaded = load_reference_dir(SHIPPED_REFERENCES)
    assert set(loaded.sets) == {"code_assistant", "customer_service", "doc_summary", "default", "long_documents"}
    assert all(len(reference.prompts) == 32 for reference in loaded.for_line(None))
    assert [r.name for r in loaded.for_line("code_assistant")] == ["code_assistant"]
    assert [r.name for r in loaded.for_line("sql_reports")] == ["default"]  # a line without a set of its own
    assert len(loaded.for_line(None)) == len(loaded.for_line("all")) == 4  # a long set describes no line
    (long,) = loaded.long_sets()
    assert long.name == "long_documents" and long.generate is not None and long.count == 4


def test_a_set_is_kept_apart_by_its_version_and_prompts() -> None:
    one = ReferenceSet("code_assistant", 1, ("a", "b", "c", "d"))
    assert one.digest != ReferenceSet("code_assistant", 2, ("a", "b", "c", "d")).digest
    assert one.digest != ReferenceSet("code_assistant", 1, ("a", "b", "c", "e")).digest


def test_bad_reference_files_name_the_file_the_key_the_value_and_the_expectation(tmp_path: Path) -> None:
    (tmp_path / "code_assistant.yaml").write_text("business_line: code\nversion: 0\nprompts: [a, b]\nextra: 1\n")
    (tmp_path / "default.yaml").write_text("business_line: default\nversion: 1\nprompts: [a, a, b, c]\n")
    with pytest.raises(ReferenceSetError) as raised:
        load_reference_dir(tmp_path)
    errors = raised.value.errors
    assert any(
        "code_assistant.yaml: business_line = 'code': expected the file name stem 'code_assistant'" in e for e in errors
    ), errors
    assert any("code_assistant.yaml: version = 0: expected an integer >= 1" in e for e in errors), errors
    assert any("code_assistant.yaml: prompts = " in e and "expected a list of 4 to 256 texts" in e for e in errors)
    assert any("unknown key 'extra'" in e for e in errors)
    assert any("default.yaml: prompts = '<1 repeated>': expected distinct texts" in e for e in errors), errors
    secret = "token-abcdef-do-not-show" * 400  # a prompt refused is named by its size, not shown
    (tmp_path / "code_assistant.yaml").write_text(
        f"business_line: code_assistant\nversion: 1\nprompts: [a, b, c, '{secret}', '   ']\nmax_tokens: 10\n"
    )
    with pytest.raises(ReferenceSetError) as raised:
        load_reference_dir(tmp_path)
    assert "token-abcdef" not in str(
        raised.value
    ) and "prompts[4] = '<text of 3 characters>': expected a non-empty text" in str(raised.value)
    assert "max_tokens = 10: expected an integer from 16 to 1048576" in str(raised.value)


# --------------------------------------------------------------------------- readings and causes
def prober(reader: Routed, clock=time.time, **settings: float) -> ReferenceProber:
    clients = ClientShares(window_tokens=1000)
    clients.add("code_assistant", "app-1", 300)
    clients.add("code_assistant", "flood-1", 2000)
    return ReferenceProber(
        lambda: sets("code_assistant", "default"),
        reader,
        ReferenceBaselines(),
        settings=ReferenceSettings(**settings),
        clients=clients,
        clock=clock,
    )


def record(line: str | None = "code_assistant", bits: float = 4.2) -> RouterStats:
    return engine_record(bits, name=GATE.name, line=line, num_slots=64)


def test_the_same_reference_routing_says_traffic_and_names_the_flooding_client() -> None:
    reader = Routed()
    judge = prober(reader)
    judge.read_now()  # healthy: each set's baseline
    since = time.time()
    judge.read_now(["code_assistant"])
    cause = judge.judge(LOW, record(), since)
    assert cause is not None and cause.name == "traffic"
    assert "route as while healthy" in cause.summary and "0.0000 bits (Jensen-Shannon)" in cause.summary
    assert "client flood-1 sent" in cause.summary
    assert cause.details["clients"][0]["client"] == "flood-1" and cause.details["clients"][0]["share"] > 0.8


def test_reference_routing_that_moved_says_model_and_one_that_breaks_the_rule_without_a_baseline_too() -> None:
    reader = Routed()
    judge = prober(reader)
    judge.read_now()
    reader.counts = COLLAPSED  # the router damaged in place: no version changed, its reading did
    since = time.time()
    judge.read_now(["code_assistant"])
    cause = judge.judge(LOW, record(), since)
    assert cause is not None and cause.name == "model" and "route differently now" in cause.summary
    assert cause.details["js_bits"] > 0.5 and cause.details["rule_breached"] is True

    unlearned = ReferenceProber(
        lambda: sets("code_assistant"),
        reader,
        ReferenceBaselines(),
        trusted=lambda reading: "version 0 failed its health check",
    )
    unlearned.read_now()  # deployed broken: nothing learned, and the rule itself breaches on the prompts
    cause = unlearned.judge(LOW, record(), 0.0)
    assert cause is not None and cause.name == "model" and "breach RoutingEntropyLow too" in cause.summary
    assert "no healthy baseline of them yet" in cause.summary


def test_a_reading_older_than_the_alert_is_not_used_one_is_asked_for_and_a_failure_is_said() -> None:
    reader, clock = Routed(), FakeClock(1000.0)
    judge = prober(reader, clock)
    judge.read_now()
    since = 1001.0  # the alert went pending after the last reading
    assert judge.judge(LOW, record(), since) == undetermined_because("no reference prompts are being read")
    clock.advance(5.0)
    reader.go.clear()
    judge.start()
    try:
        assert judge.judge(LOW, record(), since) is None  # coming: the engine holds the alert pending
        reader.go.set()
        assert wait(lambda: judge.latest("code_assistant") is not None and judge.latest("code_assistant") >= since)
        assert judge.judge(LOW, record(), since).name == "traffic"
        reader.fail = "the engine is restarting"
        later = clock.now + 1.0
        clock.advance(5.0)
        assert judge.judge(LOW, record(), later) is None
        assert wait(lambda: (c := judge.judge(LOW, record(), later)) is not None and c.name == "undetermined")
        assert (
            "could not be read through the test's model: RuntimeError: the engine is restarting"
            in judge.judge(LOW, record(), later).summary
        )
    finally:
        judge.stop()


def undetermined_because(text: str) -> Cause:
    return Cause("undetermined", text)


def wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_all_lines_are_judged_on_every_set_and_a_line_without_sets_is_undetermined() -> None:
    reader = Routed()
    judge = prober(reader)
    judge.read_now()
    assert judge.judge(LOW, record(line=None), 0.0).name == "traffic"
    assert set(judge.judge(LOW, record(line=None), 0.0).details["sets"][i]["set"] for i in range(2)) == {
        "code_assistant",
        "default",
    }
    bare = ReferenceProber(lambda: sets("code_assistant"), reader, ReferenceBaselines())
    cause = bare.judge(LOW, record(line="sql_reports"), 0.0)
    assert cause.name == "undetermined" and "add sql_reports.yaml, or default.yaml" in cause.summary


def test_a_baseline_is_learned_again_only_when_another_known_good_router_version_serves(tmp_path: Path) -> None:
    reader, version, good = Routed(), [0], [True]
    baselines = ReferenceBaselines(tmp_path / "reference_baseline.json")
    judge = ReferenceProber(
        lambda: sets("code_assistant"),
        reader,
        baselines,
        router_version=lambda: version[0],
        trusted=lambda reading: None if good[0] else "not known good",
    )
    judge.read_now()
    reader.counts = COLLAPSED
    judge.read_now()  # same version: the damage is compared with the healthy baseline, never learned
    assert baselines.all()[0].router_version == 0 and baselines.all()[0].counts[GATE.name].tolist() == BALANCED.tolist()
    version[0], good[0] = 1, False
    judge.read_now()  # a version not known good: not learned either
    assert baselines.all()[0].router_version == 0
    good[0] = True
    judge.read_now()
    assert baselines.all()[0].router_version == 1
    again = ReferenceBaselines(tmp_path / "reference_baseline.json")  # kept across a restart
    assert again.all()[0].router_version == 1 and again.all()[0].counts[GATE.name].tolist() == COLLAPSED.tolist()


def test_a_corrupt_baseline_file_is_set_aside_and_said(tmp_path: Path) -> None:
    path = tmp_path / "reference_baseline.json"
    path.write_text('{"format": "something else"}')
    baselines = ReferenceBaselines(path)
    assert baselines.all() == [] and "format" in baselines.load_error
    assert (tmp_path / "reference_baseline.json.corrupt").exists()


# --------------------------------------------------------------------------- the alert engine asks
class Judge:
    """A cause judge whose answer the test sets (``None``: a reading is coming)."""

    def __init__(self, answer: Cause | None, wait_seconds: float = 30.0) -> None:
        self.answer = answer
        self.wait_seconds = wait_seconds
        self.requested: list[tuple[str | None, float]] = []
        self.reading_at: float | None = None

    def request(self, business_line: str | None, since: float) -> None:
        self.requested.append((business_line, since))

    def latest(self, business_line: str | None) -> float | None:
        return self.reading_at

    def judge(self, rule, record, since):
        return self.answer


def engine(judge: Judge, clock: FakeClock) -> AlertEngine:
    return AlertEngine(RuleSet((LOW,), {}), clock=clock, causes=judge)


def test_an_alert_waits_pending_for_its_cause_and_a_traffic_one_never_asks_for_a_re_tune() -> None:
    clock, judge = FakeClock(), Judge(None)
    alerts = engine(judge, clock)
    assert alerts.evaluate([record()]) == []  # due (for: 0 s) but its reading is coming: pending
    assert judge.requested == [("code_assistant", clock.now)] and alerts.alerts()[0].state == "pending"
    judge.answer = Cause("traffic", "the reference prompts route as while healthy", clock.now)
    actions = alerts.evaluate([record()])
    assert [action.kind for action in actions] == ["notify"]  # no retune: the model did not change
    labels = actions[0].alert.labels
    assert labels["cause"] == "traffic" and labels["severity"] == "warning"  # the rule's critical is for the model
    assert actions[0].alert.annotations["summary"].startswith("TRAFFIC CHANGED")
    assert actions[0].alert.annotations["cause"] == "the reference prompts route as while healthy"
    assert LOW.receivers_for(labels["cause"]) == ("owners",)
    assert alerts.firing_causes() == {("RoutingEntropyLow", "traffic"): 1}


def test_a_model_cause_pages_critical_and_asks_for_the_re_tune() -> None:
    clock, judge = FakeClock(), Judge(Cause("model", "the reference prompts route differently now", 0.0))
    actions = engine(judge, clock).evaluate([record()])
    assert [action.kind for action in actions] == ["notify", "retune"]
    assert actions[0].alert.labels["cause"] == "model" and actions[0].alert.labels["severity"] == "critical"
    assert actions[0].alert.annotations["summary"] == "MODEL CHANGED: 4.20 bits"
    assert LOW.receivers_for("model") == ("oncall",)


def test_no_reading_within_the_wait_fires_undetermined_without_a_re_tune() -> None:
    clock, judge = FakeClock(), Judge(None, wait_seconds=30.0)
    alerts = engine(judge, clock)
    assert alerts.evaluate([record()]) == []
    clock.advance(29.0)
    assert alerts.evaluate([record()]) == []
    clock.advance(2.0)
    actions = alerts.evaluate([record()])
    assert [action.kind for action in actions] == ["notify"]
    assert actions[0].alert.labels["cause"] == "undetermined"
    assert "within 30 s" in actions[0].alert.annotations["cause"]


def test_a_traffic_alert_becomes_a_model_page_when_a_newer_reading_shows_the_model_changed(tmp_path: Path) -> None:
    clock, judge = FakeClock(), Judge(Cause("traffic", "healthy reference", 1.0))
    judge.reading_at = 1.0
    alerts = AlertEngine(RuleSet((LOW,), {}), clock=clock, causes=judge, state_path=tmp_path / "alerts.json")
    (first,) = alerts.evaluate([record()])
    assert first.alert.labels["cause"] == "traffic"
    clock.advance(60)
    judge.answer, judge.reading_at = Cause("model", "the reference prompts route differently now", 2.0), 2.0
    actions = alerts.evaluate([record()])
    assert [(a.kind, a.alert.status, a.alert.labels["cause"]) for a in actions] == [
        ("notify", "resolved", "traffic"),
        ("notify", "firing", "model"),
        ("retune", "firing", "model"),
    ]
    assert actions[1].alert.fingerprint != first.alert.fingerprint
    judge.answer, judge.reading_at = Cause("traffic", "healthy again", 3.0), 3.0
    assert alerts.evaluate([record()]) == []  # a model cause stays until the alert resolves
    restored = AlertEngine(RuleSet((LOW,), {}), clock=clock, causes=judge, state_path=tmp_path / "alerts.json")
    (inst,) = restored.alerts()
    assert inst.labels["cause"] == "model" and inst.cause["summary"].startswith("the reference prompts route")


# --------------------------------------------------------------------------- clients
def test_a_client_is_named_by_the_first_source_a_request_carries_and_never_by_a_raw_key() -> None:
    sources = parse_client_id_sources("header:X-Client-Id,user,api-key,remote")
    assert client_id(sources, {"x-client-id": "team-7"}, {"user": "bob"}, "10.0.0.1") == "team-7"
    assert client_id(sources, {}, {"user": "bob"}, "10.0.0.1") == "user:bob"
    keyed = client_id(sources, {"authorization": "Bearer sk-secret-123"}, {}, "10.0.0.1")
    assert keyed.startswith("key:") and "secret" not in keyed and len(keyed) == 20
    assert client_id(sources, {}, {}, "10.0.0.1") == "addr:10.0.0.1"
    assert client_id(("user",), {}, {}, None) == UNKNOWN
    odd = client_id(sources, {"x-client-id": "evil\n<script>" * 50}, {}, None)
    assert odd.startswith("sha256:") and "<" not in odd  # what a client chose to put there never shows
    with pytest.raises(ValueError, match="'cookie' is not a source"):
        parse_client_id_sources("header:X-Client-Id,cookie")


def test_shares_are_kept_per_line_bounded_and_the_mover_comes_first() -> None:
    shares = ClientShares(window_tokens=1000, long_run_tokens=100_000, max_clients=3)
    for _ in range(50):
        shares.add("code", "app-1", 100)  # the long run: app-1 alone
    for index in range(20):
        shares.add("code", "flood-1", 100)
        shares.add("code", f"one-off-{index}", 1)  # past max_clients: counted as other
    now = shares.shares("code")
    assert {entry["client"] for entry in now["clients"]} <= {"app-1", "flood-1", "one-off-0", OTHER}
    assert now["tokens"] <= 1000 + 101
    (mover, *_) = shares.movers("code")
    assert mover.client == "flood-1" and mover.share > 0.9 and mover.long_run_share < 0.5
    assert shares.movers("another line") == []


def test_capture_is_fair_one_client_fills_at_most_its_share(tmp_path: Path) -> None:
    capture = TrafficCapture(tmp_path / "capture.sqlite", max_samples_per_line=20, max_client_share=0.25)
    for index in range(40):
        capture.add("code", [1, 2, 3, index], prompt_tokens=3, client="flood-1")
    for index in range(10):
        capture.add("code", [4, 5, 6, index], prompt_tokens=3, client="app-1")
    assert capture.clients("code") == {"flood-1": 5, "app-1": 5}
    assert [sample[-1] for sample in capture.samples("code")][:5] == [35, 36, 37, 38, 39]  # its newest kept
    capture.close()


# --------------------------------------------------------------------------- the re-tune gate
def test_the_reference_gate_refuses_a_candidate_that_routes_the_reference_prompts_badly() -> None:
    reader = Routed()
    judge = prober(reader)
    judge.read_now()
    gate = ReferenceGate(lambda: sets("code_assistant", "default"), judge.baselines)
    live = {"code_assistant": score(BALANCED)}
    good = gate.checks(
        "code_assistant",
        live,
        {"code_assistant": score(BALANCED)},
        routers=[GATE.name],
        band=Band("entropy_bits", low=5.2),
        margin="2%",
        confidence=0.95,
        min_tokens=100,
        min_samples=4,
    )
    assert {check["gate"]: check["decision"] for check in good} == {
        "reference_band": "pass",
        "reference_drift": "pass",
        "reference_perplexity": "pass",
    }
    worse = score(COLLAPSED, losses=(14.0,) * 8)
    bad = gate.checks(
        "code_assistant",
        live,
        {"code_assistant": worse},
        routers=[GATE.name],
        band=Band("entropy_bits", low=5.2),
        margin="2%",
        confidence=0.95,
        min_tokens=100,
        min_samples=4,
    )
    assert {check["gate"]: check["decision"] for check in bad} == {
        "reference_band": "reject",
        "reference_drift": "reject",
        "reference_perplexity": "reject",
    }
    assert "outside the band" in bad[0]["message"]


def test_the_prober_runs_on_its_own_thread_and_stops() -> None:
    reader = Routed()
    judge = prober(reader, interval_seconds=0.05)
    judge.start()
    try:
        assert wait(lambda: len(reader.reads) >= 6)  # at start, then every interval
    finally:
        judge.stop()
    assert not any(thread.name == "mla-watch-reference" for thread in threading.enumerate())


class Held(Routed):
    """Each reading waits for the test to let it end (``release``); ``started`` lists the sets begun, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []
        self.release = threading.Semaphore(0)

    def read(self, reference: ReferenceSet) -> ModelScore:
        self.started.append(reference.name)
        assert self.release.acquire(timeout=20)
        return super().read(reference)


def test_a_pending_alerts_line_is_read_next_ahead_of_the_rest_of_a_round() -> None:
    reader = Held()
    lines = sets("alpha", "bravo", "charlie", "default")
    judge = ReferenceProber(lambda: lines, reader, ReferenceBaselines(), settings=ReferenceSettings(interval_seconds=0))
    judge.start()
    try:
        assert wait(lambda: reader.started == ["alpha"])  # the round at start, in flight
        judge.request("charlie", since=0.0)  # an alert on charlie went pending
        for _ in range(4):
            reader.release.release()
        assert wait(lambda: len(reader.reads) == 4)
        assert reader.started == ["alpha", "charlie", "bravo", "default"]  # charlie's page waited for one set
    finally:
        for _ in range(4):
            reader.release.release()
        judge.stop()


def test_a_reading_that_ends_after_the_stop_began_is_neither_recorded_nor_learned() -> None:
    reader = Held()
    baselines = ReferenceBaselines()
    judge = ReferenceProber(
        lambda: sets("alpha", "default"), reader, baselines, settings=ReferenceSettings(interval_seconds=0)
    )
    judge.start()
    try:
        assert wait(lambda: reader.started == ["alpha"])
        judge.abandon()  # the stop began while alpha was read
        reader.release.release()
        assert wait(lambda: reader.reads == ["alpha"])
    finally:
        judge.stop(timeout=20)
    assert reader.started == ["alpha"]  # nothing read after the stop
    assert judge.readings() == {} and judge.readings_taken == 0
    assert baselines.get("alpha", sets("alpha").sets["alpha"].digest) is None


def test_a_set_whose_reading_failed_is_read_again_without_waiting_for_the_schedule() -> None:
    reader = Routed()
    reader.fail = "the engine is restarting"
    judge = prober(reader, interval_seconds=0, retry_seconds=0.05)  # no schedule: at start and on demand only
    judge.start()
    try:

        def failed() -> list:
            return [entry["last_failure"] for entry in judge.describe()["sets"] if entry["last_failure"]]

        assert wait(lambda: len(failed()) == 2)
        reader.fail = None
        assert wait(lambda: judge.latest("code_assistant") is not None)  # read again, unasked
        assert failed() == []
    finally:
        judge.stop()


def test_reference_prompts_that_come_back_without_routing_leave_the_band_unjudged_and_perplexity_decides() -> None:
    gate = ReferenceGate(lambda: sets("code_assistant"), ReferenceBaselines())
    unrouted = ModelScore(perplexity=2.0, tokens=480, routers={}, losses=[10.0] * 8, counts=[60] * 8)
    checks = gate.checks(
        "code_assistant",
        {"code_assistant": unrouted},
        {"code_assistant": unrouted},
        routers=[GATE.name],
        band=Band("entropy_bits", low=5.2),
        margin="2%",
        confidence=0.95,
        min_tokens=100,
        min_samples=4,
    )
    assert [(check["gate"], check["decision"], check.get("binding", True)) for check in checks] == [
        ("reference_band", "insufficient", False),
        ("reference_perplexity", "pass", True),
    ]
    assert "without routing" in checks[0]["message"]
