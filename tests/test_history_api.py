"""``GET /v1/history`` on a real sidecar: ranges and steps over the tiers, bounded parameters, and a SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from harness.helpers import DAY, prefill_history
from harness.support import free_port, running_sidecar, sidecar_process, wait_until
from mla_watch.history.store import HISTORY_FILE

GATE = "model.layers.1.mlp.gate"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    end = time.time()
    prefill_history(state, end)
    with running_sidecar(upstream="http://127.0.0.1:9", state_dir=state, history_interval_seconds=60.0) as running:
        yield running[0], end


def test_a_range_is_answered_from_every_tier_one_column_per_step(served) -> None:
    url, end = served
    body = httpx.get(
        url + "/v1/history", params={"since": end - 3 * DAY + 1, "until": end, "step": 3600}, timeout=30
    ).json()
    assert body["metric"] == "entropy_bits" and body["step_seconds"] == 3600 and body["series_dropped"] == 0
    assert [t["name"] for t in body["tiers"]] == ["full", "minute", "quarter"]
    assert all(t % 3600 == 0 for t in body["times"]) and body["times"] == sorted(body["times"])
    assert 70 <= len(body["times"]) <= 74  # three days of hours
    by_line = {s["business_line"]: s for s in body["series"]}
    assert list(by_line) == ["all", "code"]  # "all" first, as in /v1/status
    code = by_line["code"]
    assert code["router"] == GATE and code["floor_bits"] == 2.585 and code["num_slots"] == 64
    assert len(code["values"]) == len(code["too_small"]) == len(body["times"])
    assert code["values"][0] == pytest.approx(5.0) and code["values"][-1] == pytest.approx(5.2)
    assert set(by_line["all"]["values"]) == {4.0}
    assert code["band"]["fire_below"] is not None  # the shipped rules' band, for the page's colours

    tokens = httpx.get(
        url + "/v1/history",
        params={"since": end - 600, "until": end, "metric": "tokens", "business_line": "code", "router": "*.mlp.gate"},
    ).json()
    assert [s["business_line"] for s in tokens["series"]] == ["code"] and set(tokens["series"][0]["values"]) == {500}
    assert tokens["step_seconds"] == 60  # the default: the finest step giving at most 720 columns
    none = httpx.get(url + "/v1/history", params={"since": end - 600, "until": end, "router": "*.indexer"}).json()
    assert none["series"] == [] and none["times"] == []


@pytest.mark.parametrize(
    ("params", "param", "expected"),
    [
        ({"since": "yesterday"}, "since", 'since="yesterday" is invalid: expected a time in seconds since the epoch'),
        ({"since": "nan"}, "since", 'since="nan" is invalid'),
        ({"until": "1e400"}, "until", 'until="1e400" is invalid'),
        ({"since": "2000", "until": "1000"}, "since", 'since="2000" is invalid: expected a time before until'),
        ({"since": "0", "until": "1e9"}, "since", "expected at most 30 days before until"),
        ({"step": "1"}, "step", 'step="1" is invalid: expected seconds per column in [60, 86400]'),
        ({"step": "1e6"}, "step", "expected seconds per column in [60, 86400]"),
        ({"since": "0", "until": str(29 * DAY), "step": "60"}, "step", "at most 2000 columns"),
        ({"metric": "entropy"}, "metric", 'metric="entropy" is invalid: expected one of entropy_bits'),
        ({"business_line": "a b"}, "business_line", 'business_line="a b" is invalid'),
        ({"router": "x" * 201}, "router", "expected a router name or fnmatch pattern of 1 to 200 characters"),
        ({"limit": "5"}, "limit", '"limit" is not a parameter of /v1/history: expected since, until, step'),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(served, params, param, expected) -> None:
    url, _ = served
    response = httpx.get(url + "/v1/history", params=params, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and expected in error["message"], error


def test_the_status_pages_hour_is_the_durable_historys_last_hour(served) -> None:
    url, end = served
    status = httpx.get(url + "/v1/status", timeout=10).json()
    history = status["history"]
    assert history["interval_seconds"] == 60 and history["span_seconds"] == 3600
    times = history["times"]
    assert 55 <= len(times) <= 61 and times == sorted(times)  # the samples written before it started
    assert times[-1] <= end and end - 3600 - 60 <= times[0]
    by_line = {s["business_line"]: s for s in history["series"]}
    assert list(by_line) == ["all", "code"] and set(by_line["all"]["values"]) == {4.0}
    assert set(by_line["code"]["values"]) == {5.2} and by_line["code"]["band"]["fire_below"] is not None
    newer = httpx.get(url + "/v1/status", params={"since": times[-2]}, timeout=10).json()["history"]
    assert newer["times"][0] == times[-1] and all(t > times[-2] for t in newer["times"])


def test_status_says_the_durable_history_is_there_and_can_be_off(served, tmp_path: Path) -> None:
    url, _ = served
    assert httpx.get(url + "/v1/status", timeout=10).json()["history_store"]["retention_days"] == 30.0
    with running_sidecar(
        upstream="http://127.0.0.1:9", state_dir=tmp_path, history_retention_days=0, history_interval_seconds=0.2
    ) as (off, sidecar):
        response = httpx.get(off + "/v1/history", timeout=10)
        assert response.status_code == 404 and "--history-retention 0" in response.json()["error"]["message"]
        assert httpx.get(off + "/v1/status", timeout=10).json()["history_store"] is None
        # The live hour goes on in memory: the sampler's points, served as with the file.
        assert sidecar.history_store is None and not sidecar.history.durable
        assert wait_until(lambda: len(httpx.get(off + "/v1/status", timeout=10).json()["history"]["times"]) >= 2)
    assert not (tmp_path / HISTORY_FILE).exists()


def ingest(url: str, token: str, tokens: int) -> None:
    body = {
        "source": "worker-1",
        "routers": [{"name": GATE, "layer": 1, "kind": "expert", "num_slots": 8, "top_k": 2}],
        "deltas": [
            {
                "router": GATE,
                "business_line": "code",
                "slots": [0, 1, 2, 3],
                "counts": [tokens // 2] * 4,
                "tokens": tokens,
            }
        ],
    }
    response = httpx.post(
        url + "/v1/routing/ingest", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    assert response.status_code == 200, response.text


@pytest.mark.slow  # two sidecar processes start: about 17 s
def test_the_history_survives_a_sigkill(tmp_path: Path) -> None:
    token = "history-ingest-token-0123"
    state, port = tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{port}"
    options = ("--upstream", "http://127.0.0.1:9", "--history-interval", "0.2")
    query = {"since": time.time() - 60, "until": time.time() + 300, "step": 0.2, "business_line": "code"}
    # nothing listens upstream: /readyz says so, and the process is up once /healthz answers
    environ = {"MLA_WATCH_INGEST_TOKEN": token}
    with sidecar_process(port, state, *options, env=environ, ready_path="/healthz") as process:
        ingest(url, token, 40)

        def history() -> list[float]:
            return httpx.get(url + "/v1/history", params=query, timeout=10).json()["times"]

        assert wait_until(lambda: len(history()) >= 10, 60)
        seen = history()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    with sidecar_process(port, state, *options, env=environ, ready_path="/healthz"):
        body = httpx.get(url + "/v1/history", params=query, timeout=10).json()
    kept = set(body["times"])
    assert set(seen[:-1]) <= kept  # what was served before the kill is there, but for the point being written
    (series,) = body["series"]
    assert series["router"] == f"worker-1/{GATE}" and series["values"][0] == pytest.approx(2.0)  # 4 even slots
