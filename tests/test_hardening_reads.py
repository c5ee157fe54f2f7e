"""Finding 10, replayed on real sidecars on loopback: heavy public reads are bounded and never hold up monitoring,
and the largest ``/v1/history`` answer of a full store stays under its documented bound."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness.helpers import FakeClock, router_stats
from harness.support import metric_value, running_sidecar, wait_until
from mla_watch.history.store import HISTORY_FILE, HistoryStore
from mla_watch.server.history_api import (
    MAX_ANSWER_BYTES,
    MAX_CELLS,
    MAX_POINTS,
    MAX_RANGE_SECONDS,
    encode_history,
)
from mla_watch.server.requests import ApiError

UPSTREAM = "http://127.0.0.1:9"  # nothing listens: a proxy sidecar that loads no model
DAY = 86400.0
QUARTER = 900.0
ROUTERS, LINES = 128, 7  # x (7 lines + all) = 1,024 series: --history-max-series' default


class BlockedHistory(HistoryStore):
    """The durable history, whose queries each wait until the test lets them go."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self._entered_lock = threading.Lock()
        self.entered = 0

    def query(self, **kwargs: Any) -> dict[str, Any]:
        with self._entered_lock:
            self.entered += 1
        self.release.wait(60)
        return super().query(**kwargs)


def get_all(url: str, path: str, count: int) -> tuple[list[threading.Thread], list[httpx.Response]]:
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(httpx.get(url + path, timeout=60))) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, answers


def test_heavy_reads_are_bounded_and_monitoring_answers_while_they_are_stuck(tmp_path: Path) -> None:
    with running_sidecar(
        upstream=UPSTREAM, state_dir=tmp_path / "state", sidecar_options={"open_history": BlockedHistory}
    ) as (url, sidecar):
        reads = sidecar.heavy_reads
        blocked = sidecar.history_store
        assert isinstance(blocked, BlockedHistory)
        threads, answers = get_all(url, "/v1/history", reads.admitted)
        try:
            # Every worker holds a read and the rest wait in the queue: the bound is reached.
            assert wait_until(lambda: reads.in_flight == reads.admitted and blocked.entered == reads.workers)
            for path in ("/v1/history", "/v1/status"):
                refused = httpx.get(url + path, timeout=10)
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == str(reads.retry_after)
                error = refused.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == "too_many_reads" and error["type"] == "rate_limit_error"
                assert f"GET {path} refused" in error["message"] and "retry after" in error["message"]
            metrics = httpx.get(url + "/metrics", timeout=10)
            assert metrics.status_code == 200
            assert (
                metric_value(
                    metrics.text, "mla_watch_bad_requests_total", endpoint="/v1/history", reason="too_many_reads"
                )
                == 1
            )
            assert httpx.get(url + "/v1/routing", timeout=10).status_code == 200
            assert httpx.get(url + "/healthz", timeout=10).status_code == 200
            # Answered while every admitted read was still blocked: nothing above waited behind them.
            assert not blocked.release.is_set() and blocked.entered == reads.workers
            assert all(thread.is_alive() for thread in threads) and not answers
        finally:
            blocked.release.set()
            for thread in threads:
                thread.join(60)
        assert [answer.status_code for answer in answers] == [200] * reads.admitted
        assert wait_until(lambda: reads.in_flight == 0)  # each place given back once its read is done
        assert httpx.get(url + "/v1/status", timeout=10).status_code == 200
    with pytest.raises(RuntimeError):  # shut down with the sidecar
        asyncio.run(reads.run("GET /v1/history", lambda: None))


def fill(path: Path, end: float, variants: int = 32) -> None:
    """1,024 series over 30 days up to ``end``, a sample every 15 min; tokens move (each sample one of ``variants``
    drawn at random), so means carry decimals."""
    rng = np.random.default_rng(0)
    clock = FakeClock(end - MAX_RANGE_SECONDS - QUARTER)
    store = HistoryStore(path, interval_seconds=60.0, clock=clock)
    series = [
        (f"model.layers.{layer}.mlp.gate", layer, line, float(rng.uniform(5.0, 7.5)))
        for layer in range(3, 3 + ROUTERS)
        for line in [None, *(f"line_{i}" for i in range(LINES))]
    ]
    # bits_below_ceiling follows: 8 - bits
    samples = [
        [
            router_stats(
                name=name,
                layer=layer,
                line=line,
                num_slots=256,
                top_k=8,
                tokens=int(count),
                entropy_bits=bits,
                normalized_entropy=(bits - 3.0) / 5.0,
                max_violation=1.0 + bits / 7.0,
                js_divergence=bits / 75.0,
                locality=bits / 7.5,
                dead_slots=0,
                too_small=False,
                floor_bits=3.0,
                ceiling_bits=8.0,
            )
            for (name, layer, line, bits), count in zip(series, rng.integers(1024, 4097, size=len(series)), strict=True)
        ]
        for _ in range(variants)
    ]
    for pick in rng.integers(0, variants, size=math.ceil((end - clock.now) / QUARTER) + 1):
        store.record(samples[pick])
        clock.now += QUARTER
    store.close()


@pytest.fixture(scope="module")
def full_store(tmp_path_factory) -> tuple[str, Any, float]:
    state = tmp_path_factory.mktemp("full-history")
    end = time.time()
    fill(state / HISTORY_FILE, end)
    with running_sidecar(upstream=UPSTREAM, state_dir=state, history_interval_seconds=60.0) as (url, sidecar):
        yield url, sidecar, end


def largest_query(series: int, end: float, metric: str, extra_buckets: int = 0) -> dict[str, Any]:
    """30 days of every series at the finest step MAX_CELLS allows (``extra_buckets`` past it)."""
    buckets = min(MAX_CELLS // series, MAX_POINTS + 1) + extra_buckets  # the store counts ceil(span / step) + 1
    step = math.ceil(MAX_RANGE_SECONDS / (buckets - 1) * 1000) / 1000
    return {"since": end - MAX_RANGE_SECONDS, "until": end, "step": step, "metric": metric}


@pytest.mark.parametrize("metric", ["tokens", "entropy_bits"])  # the widest values; the one with bands
def test_the_largest_history_answer_of_a_full_store_is_within_its_bound(full_store, metric: str) -> None:
    url, sidecar, end = full_store
    series = len(sidecar.history_store.series())
    assert series == ROUTERS * (LINES + 1)
    answer = httpx.get(url + "/v1/history", params=largest_query(series, end, metric), timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["series"]) == series and len(body["times"]) * series > 0.99 * MAX_CELLS  # really the largest
    assert len(answer.content) <= MAX_ANSWER_BYTES
    past = httpx.get(url + "/v1/history", params=largest_query(series, end, metric, extra_buckets=1), timeout=60)
    assert past.status_code == 400
    error = past.json()["error"]
    assert error["param"] == "step" and f"exceed {MAX_CELLS} values" in error["message"]


def test_an_answer_past_its_byte_bound_is_the_same_400(full_store) -> None:
    # Under MAX_CELLS no answer of this store reaches MAX_ANSWER_BYTES: the bound is given smaller, to the encoder
    # the endpoint sends every answer through.
    url, sidecar, end = full_store
    params = largest_query(len(sidecar.history_store.series()), end, "tokens")
    answer = httpx.get(url + "/v1/history", params=params, timeout=60)
    assert answer.status_code == 200 and 100_000 < len(answer.content) <= MAX_ANSWER_BYTES
    assert encode_history(answer.json()) == answer.content  # what was sent is what the encoder makes
    with pytest.raises(ApiError) as refused:
        encode_history(answer.json(), max_bytes=100_000)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "step", "invalid_value")
    assert f"{len(answer.content)} bytes of JSON exceed 100000" in str(error)
    assert "expected a larger step" in str(error)
    narrow = httpx.get(url + "/v1/history", params={**params, "router": "model.layers.3.*"}, timeout=60)
    assert narrow.status_code == 200 and encode_history(narrow.json(), max_bytes=100_000) == narrow.content
