"""Issue 11's attacks, replayed against real sidecars on loopback ports: each gets its documented
answer or has no effect, and monitoring keeps working."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import uuid

import httpx
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from harness.receivers import running_receiver
from harness.support import get_metrics, metric_value, running_sidecar, wait_until
from mla_watch.alerting.causes import Cause
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.common.directory_store import ConfigError
from mla_watch.routing.ingest import IngestError, IngestLimits, RemoteRouting, parse_snapshot
from mla_watch.server.app import ServerConfig, Sidecar, build_sidecar

ADMIN = "hardening-admin-token-0123"
INGEST = "hardening-ingest-token-0123"
UPSTREAM = "http://127.0.0.1:9"  # nothing listens: a proxy sidecar that loads no model


def router(name: str = "model.layers.1.mlp.gate", layer: int = 1, slots: int = 64, top_k: int = 6) -> dict:
    return {"name": name, "layer": layer, "kind": "expert", "num_slots": slots, "top_k": top_k}


def delta(
    name: str = "model.layers.1.mlp.gate", line: str = "code", tokens: int = 10, picks: int = 6, slots: int = 64
) -> dict:
    """``tokens`` tokens, each picking ``picks`` experts: counts spread over every slot (or the first ``picks``)."""
    chosen = list(range(slots if picks == slots else picks))
    per_slot = tokens * picks // len(chosen)
    return {
        "router": name,
        "business_line": line,
        "slots": chosen,
        "counts": [per_slot] * len(chosen),
        "tokens": tokens,
    }


def snapshot(source: str = "worker-1", routers: list | None = None, deltas: list | None = None) -> dict:
    return {"source": source, "routers": routers or [router()], "deltas": deltas if deltas is not None else [delta()]}


def ingest(url: str, body: dict | bytes, token: str = INGEST) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url + "/v1/routing/ingest",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )


def remote_tokens(url: str) -> dict[str, int]:
    return {r["name"]: r["tokens"] for r in httpx.get(url + "/v1/routing", timeout=30).json()["routers"]}


@pytest.fixture(scope="module")
def proxy():
    limits = IngestLimits(max_sources=3, max_lines=4, max_window_slots=2_000, max_slots=512)
    with running_sidecar(
        upstream=UPSTREAM, admin_token=ADMIN, ingest_token=INGEST, ingest_limits=limits, body_timeout_seconds=0.5
    ) as running:
        yield running


# ---------------------------------------------------------------------- 1. reads create nothing
def test_unknown_business_lines_on_reads_store_nothing(sidecar) -> None:
    url, running = sidecar
    httpx.post(
        url + "/v1/completions",
        json={"prompt": "SELECT", "max_tokens": 4},
        timeout=60,
        headers={"X-Business-Line": "code_assistant", "X-Task": "sql"},
    ).raise_for_status()
    httpx.get(url + "/v1/routing", timeout=30).raise_for_status()  # every count of that request collected
    windows = running.probe.windows
    before = (windows.nbytes, windows.business_lines)
    for _ in range(200):
        answer = httpx.get(url + "/v1/routing", params={"business_line": uuid.uuid4().hex}, timeout=30)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["param"] == "business_line" and "code_assistant" in error["message"]
    too_long = httpx.get(url + "/v1/routing", params={"business_line": "x" * 10_000}, timeout=30)
    assert too_long.status_code == 400 and "x" * 100 not in too_long.text
    assert (windows.nbytes, windows.business_lines) == before
    known = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}, timeout=30)
    assert known.status_code == 200 and known.json()["routers"][0]["tokens"] > 0


# ---------------------------------------------------------------------- 2. ingestion
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["routers"][0].update(num_slots=10**12), "routers[0].num_slots"),
        (lambda b: b["routers"][0].update(top_k=65), "routers[0].top_k"),
        (lambda b: b["routers"][0].update(layer="1"), "routers[0].layer"),
        (lambda b: b["deltas"][1].update(counts=[2**64] * 6), "deltas[1].counts"),
        (lambda b: b["deltas"][1].update(counts=[2**62] * 6, tokens=2**62), "deltas[1].tokens"),
        (lambda b: b["deltas"][1].update(counts=[11] * 6), "deltas[1].counts"),  # 66 picks by 10 tokens of top-6
        (lambda b: b["deltas"][1].update(counts=[10.0] * 6), "deltas[1].counts"),
        (lambda b: b["deltas"][1].update(counts=["10"] * 6), "deltas[1].counts"),
        (lambda b: b["deltas"][1].update(counts=[True] * 6), "deltas[1].counts"),
        (lambda b: b["deltas"][1].update(tokens=10.5), "deltas[1].tokens"),
        (lambda b: b["deltas"][1].update(slots=[0, 0, 1, 2, 3, 4]), "deltas[1].slots"),
        (lambda b: b["deltas"][1].update(slots=[0, 1, 2, 3, 4, 64]), "deltas[1].slots"),
        (lambda b: b["deltas"][1].update(business_line="code\n"), "deltas[1].business_line"),
        (lambda b: b["deltas"][1].update(choice_selections=61), "deltas[1].choice_selections"),
        (lambda b: b.update(source="a/b"), "source"),
        (lambda b: b.update(extra=1), "extra"),
    ],
)
def test_a_bad_delta_refuses_the_whole_request(proxy, mutate, field) -> None:
    url, _ = proxy
    assert ingest(url, snapshot(source="atomic", deltas=[delta()])).status_code == 200
    before = remote_tokens(url)
    body = snapshot(source="atomic", deltas=[delta(line="chat"), delta()])  # a good delta, then one made bad
    mutate(body)
    answer = ingest(url, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["message"]
    assert remote_tokens(url) == before  # the good delta before it was not applied either
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200


def test_ingestion_caps_lines_sources_and_memory(proxy) -> None:
    url, running = proxy
    many_lines = snapshot(source="lines", deltas=[delta(line=f"line-{i}") for i in range(2_000)])
    answer = ingest(url, many_lines)
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "too_many_lines"
    for name in ("s1", "s2", "s3", "s4"):
        answer = ingest(url, snapshot(source=name, deltas=[]))
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "too_many_sources"
    wide = snapshot(source="s1", routers=[router(slots=512, top_k=8)], deltas=[])
    assert ingest(url, wide).status_code == 409  # a source cannot change its routers
    assert running.remote.window_slots <= running.remote.limits.max_window_slots
    metrics = get_metrics(url)
    assert "s4" not in metrics and metrics.count("mla_watch_routing_entropy_bits{") < 200


def test_sources_give_their_place_after_silence_and_windows_stay_bounded() -> None:
    now = [0.0]
    remote = RemoteRouting(
        IngestLimits(max_sources=2, max_window_slots=150, source_idle_seconds=60), clock=lambda: now[0]
    )
    limits = remote.limits
    remote.ingest(parse_snapshot(snapshot(source="a"), limits))
    remote.ingest(parse_snapshot(snapshot(source="b"), limits))
    with pytest.raises(IngestError, match="sources are reporting"):
        remote.ingest(parse_snapshot(snapshot(source="c"), limits))
    now[0] = 61.0
    remote.ingest(parse_snapshot(snapshot(source="b"), limits))  # b speaks again; a stays silent
    assert remote.ingest(parse_snapshot(snapshot(source="c"), limits)) == "a"
    names = {info.name for windows in remote.windows() for info in windows.routers}
    assert names == {"b/model.layers.1.mlp.gate", "c/model.layers.1.mlp.gate"}
    assert remote.window_slots == 128
    with pytest.raises(IngestError, match="windows of 64 slots"):  # a third 64-slot window passes 150
        remote.ingest(parse_snapshot(snapshot(source="c", deltas=[delta(line="chat")]), limits))
    assert remote.window_slots == 128


def test_ingestion_has_its_own_token(proxy) -> None:
    url, _ = proxy
    assert ingest(url, snapshot(source="atomic"), token=ADMIN).status_code == 401
    assert ingest(url, snapshot(source="atomic"), token=INGEST).status_code == 200
    reload = httpx.post(url + "/admin/reload", headers={"Authorization": f"Bearer {INGEST}"}, timeout=30)
    assert reload.status_code == 401  # a worker's token opens no admin endpoint


# ---------------------------------------------------------------------- 3, 4. actions and namespaces
RULES = entropy_low_rules(min_tokens=8, actions=("notify", "retune"))


@pytest.mark.slow
def test_remote_routers_never_retune_the_local_model_and_a_failing_action_drops_no_page(tmp_path, monkeypatch) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(RULES)
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        with running_sidecar(
            rules=rules, admin_token=ADMIN, ingest_token=INGEST, alert_interval=0.2, state_dir=tmp_path / "state"
        ) as (url, running):

            def boom(action) -> str:
                raise RuntimeError("a re-tuner that fails")

            running.alerts.on_retune(boom)
            # Two collapsed routers of a worker, named like the sidecar's own: both fire in one evaluation.
            names = ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
            body = snapshot(
                source="w1",
                routers=[router(names[0], 1), router(names[1], 2)],
                deltas=[delta(names[0], tokens=100), delta(names[1], tokens=100)],
            )
            assert ingest(url, body).status_code == 200

            def paged() -> list[dict]:
                return [a for r in list(receiver.requests) for a in r.json()["alerts"] if a["status"] == "firing"]

            assert wait_until(lambda: len({a["labels"]["router"] for a in paged()}) == 2, timeout=60)
            assert {a["labels"]["router"] for a in paged()} == {"w1/" + name for name in names}
            for alert in paged():  # the local reference prompts cannot speak for a worker's routers
                assert alert["labels"]["cause"] == "undetermined", alert
                assert "holds no routing of w1/" in alert["annotations"]["cause"]
                assert "retune" not in alert["annotations"]  # a cause that is not the model re-tunes nothing
            assert httpx.get(url + "/v1/retune/jobs", timeout=30).json()["jobs"] == []
            local = {r["name"]: r for r in running.probe.stats()}
            assert local[names[0]]["tokens"] == 0  # the worker's counts never reached the local router

            # Were such an alert blamed on the model, the local model would still not be re-tuned for it, and a
            # re-tuner that fails would still let its page out.
            running.alerts.judge_causes_with(ModelCause())
            other = "model.layers.3.mlp.gate"
            body = snapshot(source="w2", routers=[router(other, 3)], deltas=[delta(other, tokens=100)])
            assert ingest(url, body).status_code == 200
            assert wait_until(lambda: any(a["labels"]["router"] == "w2/" + other for a in paged()), timeout=60)
            alert = next(a for a in paged() if a["labels"]["router"] == "w2/" + other)
            assert alert["labels"]["cause"] == "model"
            note = alert["annotations"]["retune"]
            assert "is not an expert router of this sidecar's model" in note
            assert "the request failed (RuntimeError)" in note
            assert httpx.get(url + "/v1/retune/jobs", timeout=30).json()["jobs"] == []


class ModelCause:
    """A cause judge that blames the model at once."""

    wait_seconds = 0.0

    def request(self, business_line, since) -> None:
        pass

    def latest(self, business_line):
        return None

    def judge(self, rule, record, since) -> Cause:
        return Cause("model", "the reference prompts route differently now (a judge of the test)")


# ---------------------------------------------------------------------- 7. the event loop
def test_large_prompts_are_refused_before_tokenizing(sidecar) -> None:
    url, _ = sidecar
    prompt = httpx.post(url + "/v1/completions", json={"prompt": "x" * 984_000, "max_tokens": 4}, timeout=60)
    assert prompt.status_code == 400 and prompt.json()["error"]["code"] == "prompt_too_long"
    chat = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}] * 28_000, "max_tokens": 4},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_a_prompt_past_the_context_is_refused_without_the_tokenizers_warning(sidecar) -> None:
    """The answer says the prompt does not fit; the tokenizer's "Token indices sequence length is longer than the
    specified maximum" (logged by transformers on its own handler) would say it again in the log."""
    import logging

    url, _ = sidecar
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transformers_log = logging.getLogger("transformers")
    transformers_log.addHandler(handler)
    try:
        text = "where is my order " * 300  # under the characters read before tokenizing, past 512 tokens
        prompt = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=60)
        chat = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 4},
        )
    finally:
        transformers_log.removeHandler(handler)
    for answer in (prompt, chat):
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    assert not [r.getMessage() for r in records if "sequence length" in r.getMessage()]


def test_a_prompt_over_the_policys_limit_is_counted_as_its_refusal(sidecar, tmp_path) -> None:
    """A prompt over ``max_prompt_tokens`` is the policy's refusal: counted under that parameter, as the status page
    and ``GET /v1/policies`` show a line's refusals."""
    from harness.support import SHIPPED_POLICIES

    url, running = sidecar
    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED_POLICIES, policies)
    path = policies / "code_assistant.yaml"
    path.write_text(
        path.read_text().replace(
            "defaults:\n  on_violation: clamp\n", "defaults:\n  on_violation: clamp\n  max_prompt_tokens: 8\n", 1
        )
    )
    shipped = running.policies.directory
    running.policies.directory = policies  # as `serve --policies` over this directory, reloaded
    try:
        assert running.policies.reload().ok

        def refused() -> dict:
            return httpx.get(url + "/v1/policies", timeout=30).json()["counts"]["code_assistant"]["code"]["refused"]

        before = refused().get("max_prompt_tokens", 0)
        text = "where is my order " * 6
        headers = {"X-Business-Line": "code_assistant"}
        prompt = httpx.post(
            url + "/v1/completions", json={"prompt": text, "max_tokens": 4}, headers=headers, timeout=60
        )
        chat = httpx.post(
            url + "/v1/chat/completions",
            headers=headers,
            timeout=60,
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 4},
        )
        for answer in (prompt, chat):
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "prompt_too_long", answer.text
            assert "allows at most 8" in answer.json()["error"]["message"]
        assert refused().get("max_prompt_tokens", 0) == before + 2
        policy = httpx.get(url + "/v1/policies", timeout=30).json()["business_lines"]["code_assistant"]
        assert policy["tasks"]["code"]["max_prompt_tokens"] == 8
    finally:
        running.policies.directory = shipped
        running.policies.reload()


class _SlowCollector(Collector):
    """A metric whose collection waits until released: a /metrics build that takes long."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def collect(self):
        self.entered.set()
        self.release.wait(30)
        yield GaugeMetricFamily("slow_metric", "waits", value=1)


def test_a_slow_metrics_build_does_not_stall_other_requests(proxy) -> None:
    url, running = proxy
    slow = _SlowCollector()
    running.registry.register(slow)
    try:
        scrape = threading.Thread(target=lambda: httpx.get(url + "/metrics", timeout=60))
        scrape.start()
        assert slow.entered.wait(30)
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200  # answered while /metrics is building
        assert not slow.release.is_set()
    finally:
        slow.release.set()
        scrape.join(60)
        running.registry.unregister(slow)


# ---------------------------------------------------------------------- 8. smaller ones
def test_deeply_nested_json_is_a_counted_bad_request(proxy) -> None:
    url, _ = proxy
    answer = ingest(url, b"[" * 50_000 + b"]" * 50_000)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
    assert (
        metric_value(
            get_metrics(url), "mla_watch_bad_requests_total", endpoint="/v1/routing/ingest", reason="invalid_json"
        )
        >= 1
    )


def test_a_trickling_body_is_cut_off(proxy) -> None:
    url, _ = proxy
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/routing/ingest HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {INGEST}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        answer = ""  # the body never completes: the sidecar answers on its own, then closes
        while chunk := sock.recv(65536):
            answer += chunk.decode()
    assert answer.startswith("HTTP/1.1 408") and "body_timeout" in answer


def test_short_tokens_are_refused_at_start_up(tmp_path) -> None:
    for setting in ("admin_token", "ingest_token"):
        config = ServerConfig(
            upstream=UPSTREAM,
            state_dir=tmp_path,
            policy_poll_seconds=None,
            rules=None,
            **{"admin_token": None, setting: "Z"},
        )
        with pytest.raises(ConfigError, match="at least 16"):
            Sidecar(config)
        with pytest.raises(SystemExit, match="has 1 characters") as exited:
            build_sidecar(config)
        assert "Z" not in str(exited.value)  # the token itself is never echoed


def test_exported_records_are_capped() -> None:
    remote = RemoteRouting(IngestLimits(max_records=6))
    two_routers = [router(), router("model.layers.2.mlp.gate", 2)]
    remote.ingest(parse_snapshot(snapshot(source="a", routers=two_routers), remote.limits))  # 2 x (1 line + all)
    with pytest.raises(IngestError, match="8 router x business line records"):
        remote.ingest(parse_snapshot(snapshot(source="b", routers=two_routers), remote.limits))
    remote.ingest(parse_snapshot(snapshot(source="b"), remote.limits))  # one router: 4 + 2 = 6 records
    assert (
        sum(len(windows.router_stats(line)) for windows in remote.windows() for line in [None, *windows.business_lines])
        == 6
    )


def test_many_tiny_deltas_keep_a_remote_window_small() -> None:
    remote = RemoteRouting(IngestLimits())
    for index in range(500):  # one token a delta, each on other experts: 500 deltas unmerged
        first = index % 58
        tiny = {
            "router": "model.layers.1.mlp.gate",
            "business_line": "code",
            "tokens": 1,
            "slots": list(range(first, first + 6)),
            "counts": [1] * 6,
        }
        remote.ingest(parse_snapshot(snapshot(source="a", deltas=[tiny]), remote.limits))
    (windows,) = remote.windows()
    totals = windows.window_totals("a/model.layers.1.mlp.gate", "code")
    assert totals.tokens == 500 and int(totals.counts.sum()) == 3000  # merged, not lost
    assert totals.buckets <= 8 and windows.nbytes <= 64 * 8 + 8 * 64 * 16


def test_non_ascii_digits_are_refused_not_crashed_on(sidecar) -> None:
    url, _ = sidecar
    jobs = httpx.get(url + "/v1/retune/jobs", params={"limit": "²"}, timeout=30)
    assert jobs.status_code == 400 and jobs.json()["error"]["param"] == "limit"
    assert httpx.get(url + "/v1/retune/jobs", params={"limit": "9" * 5000}, timeout=30).status_code == 400


def test_a_request_is_refused_before_its_dense_counts_are_allocated() -> None:
    limits = IngestLimits(max_slots=4096, max_window_slots=8192, max_lines=4)
    wide = router(slots=4096, top_k=8)
    three_windows = snapshot(routers=[wide], deltas=[delta(line=f"l{i}", slots=4096) for i in range(3)])
    with pytest.raises(IngestError, match="span more than 8192 slots") as refused:
        parse_snapshot(three_windows, limits)  # 3 x 4096 dense slots: refused while parsing, not after
    assert refused.value.status == 429 and refused.value.code == "too_many_slots"
    five_lines = snapshot(deltas=[delta(line=f"l{i}") for i in range(5)])
    with pytest.raises(IngestError, match="more than 4 business lines"):
        parse_snapshot(five_lines, limits)
    twice = snapshot(deltas=[delta(), delta()])  # one router and line twice: one delta, summed
    (merged,) = parse_snapshot(twice, limits).deltas.values()
    assert merged.tokens == 20 and int(merged.counts.sum()) == 120


def test_refusals_are_counted_by_route_not_by_the_path_asked_for(proxy) -> None:
    url, _ = proxy
    for _ in range(20):
        assert httpx.get(url + f"/static/{uuid.uuid4().hex}", timeout=30).status_code == 404
    metrics = get_metrics(url)
    assert metrics.count('mla_watch_bad_requests_total{endpoint="/static/') == 1  # one series, whatever was asked
    assert metric_value(metrics, "mla_watch_bad_requests_total", endpoint="/static/{name}", reason="not_found") == 20


@pytest.mark.parametrize("name", [[], ["model.layers.1.mlp.gate"], {"a": 1}, 7, None])
def test_a_delta_whose_router_is_no_name_is_refused_naming_the_field(name) -> None:
    with pytest.raises(IngestError, match=r"deltas\[0\]\.router=.* is invalid: expected one of the routers listed"):
        parse_snapshot(snapshot(deltas=[{**delta(), "router": name}]), IngestLimits())
