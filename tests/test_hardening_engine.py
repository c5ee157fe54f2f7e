"""A hostile or broken engine behind a live sidecar on loopback: each answer it can send gets the documented
reply, counts nothing wrong, keeps memory within the caps and leaves /healthz answering.

The engine is our own server (it must send what no real engine would); the routing it returns has
the shapes pinned in tests/test_engine_formats.py. During each attack a thread samples /healthz and
the process's resident memory: the latency figures are printed (`pytest -s`), never asserted; the
memory bound is asserted, derived from the caps the sidecar runs with.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from harness.hostile_engine import CONFIG, GEOMETRY, HostileEngine, ids, vllm_routing
from harness.support import (
    answers_counted,
    get_metrics,
    metric_value,
    running_sidecar,
    serve_app,
    settled_over_http,
)

MAX_BYTES = 4 << 20  # --upstream-max-bytes of the sidecars here
TIMEOUT = 2.0  # --request-timeout
# What one attack may add to the process, at most: a few copies of an answer at the cap, and the
# interpreter's own churn. Unbounded, each attack below would add 100 MB and more.
RSS_BOUND = 6 * MAX_BYTES + (48 << 20)
PASSWORD = "s3cr3t-Pa55word"


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


@contextmanager
def watched(url: str, what: str) -> Iterator[dict]:
    """Samples /healthz and resident memory while the block runs; prints latency at rest and during."""
    client = httpx.Client(base_url=url, timeout=30)

    def healthz() -> float:
        started = time.perf_counter()
        client.get("/healthz").raise_for_status()
        return time.perf_counter() - started

    at_rest = sorted(healthz() for _ in range(20))[10]
    figures: dict = {"peak_rss": 0, "latencies": []}
    start = rss()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            figures["peak_rss"] = max(figures["peak_rss"], rss())
            figures["latencies"].append(healthz())
            stop.wait(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield figures
    finally:
        stop.set()
        thread.join(30)
        client.close()
        figures["rss_growth"] = max(0, figures["peak_rss"] - start)
        worst = max(figures["latencies"], default=0.0)
        print(
            f"[{what}] /healthz at rest {at_rest * 1e3:.1f} ms, worst during {worst * 1e3:.1f} ms over "
            f"{len(figures['latencies'])} probes; RSS +{figures['rss_growth'] >> 20} MiB (bound "
            f"{RSS_BOUND >> 20} MiB)"
        )


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[HostileEngine, str]]:
    hostile = HostileEngine()
    with serve_app(hostile.app) as url:
        yield hostile, url


def beside_settings(hostile: tuple[HostileEngine, str], tmp_path: Path, **overrides) -> dict:
    """The ``ServerConfig`` overrides of a sidecar in front of the hostile engine (its config written to
    ``tmp_path``)."""
    _, engine_url = hostile
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    return {
        "upstream": engine_url,
        "model_config": config,
        "decode_workers": 0,
        "rules": None,
        "window_tokens": None,
        "engine": "vllm",
        "upstream_max_bytes": MAX_BYTES,
        "request_timeout": TIMEOUT,
        **overrides,
    }


@contextmanager
def beside(hostile: tuple[HostileEngine, str], tmp_path: Path, **overrides) -> Iterator[tuple[str, object]]:
    with running_sidecar(**beside_settings(hostile, tmp_path, **overrides)) as running:
        yield running


@pytest.fixture(scope="module")
def sidecar(engine, make_sidecar, tmp_path_factory) -> tuple[str, object]:
    # engine first: set up before the sidecar factory, so torn down after the sidecar stops
    return make_sidecar(**beside_settings(engine, tmp_path_factory.mktemp("hostile")))


def complete(url: str, *, counted: bool = True, **extra) -> httpx.Response:
    """One completion; an answer relayed (200) returns once its routing is counted, which follows it
    (``counted``: the sidecar reads the engine's routing)."""
    before = answers_counted(url)
    answer = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, **extra},
        timeout=60,
        headers={"X-Business-Line": "code_assistant"},
    )
    if answer.status_code == 200 and counted:
        settled_over_http(url, before + 1)
    return answer


def counted_tokens(sidecar: object) -> int:
    """Tokens counted on the first MoE router (every router counts every token)."""
    return int(sidecar.engine_routing.counts()[GEOMETRY.router_names[0]].sum()) // GEOMETRY.top_k


def stream_events(url: str) -> list[bytes]:
    """The ``data:`` payloads of a streamed completion, as the client receives them."""
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": "x", "stream": True},
        timeout=60,
        headers={"X-Business-Line": "code_assistant"},
    ) as stream:
        assert stream.status_code == 200
        raw = b"".join(stream.iter_bytes())
    return [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("mode", "status", "code"),
    [
        ("gzip_bomb", 502, "upstream_too_large"),  # 400 KB of gzip inflating to 400 MB
        ("huge_json", 502, "upstream_too_large"),  # 40 MB of JSON
        ("huge_error", 500, "upstream_error"),  # 40 MB of an HTML error page
    ],
)
def test_an_engine_answer_is_bounded_after_decompression(engine, sidecar, mode, status, code) -> None:
    hostile, _ = engine
    url, running = sidecar
    hostile.mode = mode
    before = counted_tokens(running)
    with watched(url, mode) as figures:
        answer = complete(url)
    assert answer.status_code == status and error_of(answer)["code"] == code
    assert str(MAX_BYTES) in error_of(answer)["message"] or mode == "huge_error"
    assert len(answer.content) < 4096 and counted_tokens(running) == before
    assert figures["rss_growth"] < RSS_BOUND


def test_a_stream_line_without_an_end_is_cut_at_the_cap_with_an_error_event(engine, sidecar) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = "endless_line"
    with watched(url, "endless SSE line") as figures:
        (event,) = stream_events(url)
    assert json.loads(event)["error"]["code"] == "upstream_too_large"
    assert figures["rss_growth"] < RSS_BOUND


def test_a_stream_line_is_bounded_by_its_own_limit_far_below_the_answers(engine, tmp_path) -> None:
    """A chunk is not an answer: a line without routing is cut at --upstream-max-line-bytes, named."""
    hostile, _ = engine
    hostile.mode = "endless_line"
    with (
        beside(engine, tmp_path, upstream_max_line_bytes=64 << 10) as (url, _),
        watched(url, "endless SSE line, line limit 64K") as figures,
    ):
        (event,) = stream_events(url)
    error = json.loads(event)["error"]
    assert error["code"] == "upstream_too_large" and error["message"].endswith(
        f"is larger than {64 << 10} bytes (--upstream-max-line-bytes)"
    ), error
    assert figures["rss_growth"] < RSS_BOUND


def test_legal_json_in_a_stream_is_never_split_and_odd_chunks_do_not_cut_it(engine, sidecar) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = "odd_stream"
    events = stream_events(url)
    assert events[0] == b"[1, 2]"  # not an object: relayed as it came, the stream goes on
    chunk = json.loads(events[1])
    assert chunk["choices"][0]["text"] == "line\u2028sep\u0085next" and "policy" in chunk["mla_watch"]
    assert events[2] == b"[DONE]"


def test_an_answer_dripped_slowly_ends_at_the_total_deadline(engine, sidecar) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = "drip"  # 31 bytes, one every 0.5 s: each read is quick, the whole takes 15 s
    started = time.monotonic()
    answer = complete(url)
    assert answer.status_code == 504 and error_of(answer)["code"] == "upstream_timeout"
    assert "--request-timeout" in error_of(answer)["message"]
    assert time.monotonic() - started < 15  # it did not wait for the whole drip


def test_a_stream_line_dripped_slowly_ends_at_the_deadline_with_an_error_event(engine, sidecar) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = "stream_drip"  # a first event, then a line a byte every 0.5 s: each read is quick
    started = time.monotonic()
    events = stream_events(url)
    assert json.loads(events[0])["choices"][0]["text"] == "a" and "mla_watch" in json.loads(events[0])
    assert json.loads(events[-1])["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 20  # not the whole drip of 25 s


def test_a_large_first_chunk_is_parsed_off_the_event_loop_and_carries_the_object(engine, sidecar) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = "big_first_chunk"
    events = stream_events(url)
    first = json.loads(events[0])
    assert first["choices"][0]["text"] == "w" * 300_000 and first["mla_watch"]["policy"] == "code_assistant/code"


# ---------------------------------------------------------------------- odd answers
@pytest.mark.parametrize(("mode", "status"), [("not_json", 502), ("json_array", 502), ("html_error", 503)])
def test_every_upstream_oddity_gets_an_openai_error_naming_it(engine, sidecar, caplog, mode, status) -> None:
    hostile, _ = engine
    url, _ = sidecar
    hostile.mode = mode
    with caplog.at_level(logging.INFO):
        answer = complete(url)
    assert answer.status_code == status
    error = error_of(answer)
    assert error["code"] == "upstream_error" and "<script>" not in answer.text
    assert "JSON" in error["message"]
    assert not [r for r in caplog.records if r.exc_info], "no traceback is logged"


@contextmanager
def raw_engine(answer: bytes) -> Iterator[str]:
    """A TCP server that answers every request with ``answer`` as it is (what no HTTP framework would send)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                received = b""
                while b"\r\n\r\n" not in received:
                    received += connection.recv(65536) or b"\r\n\r\n"
                head, _, rest = received.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(rest) < length:
                    rest += connection.recv(65536) or b" " * length
                connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def test_a_status_no_client_expects_is_a_502_naming_it(tmp_path) -> None:
    answer = b"HTTP/1.1 999 Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    with (
        raw_engine(answer) as engine_url,
        running_sidecar(
            upstream=engine_url,
            model_config=config,
            decode_workers=0,
            rules=None,
            engine="vllm",
            request_timeout=TIMEOUT,
        ) as (url, _),
    ):
        relayed = complete(url)
    assert relayed.status_code == 502 and "HTTP 999" in error_of(relayed)["message"]


@pytest.mark.parametrize("engine_setting", ["none", "vllm"])
def test_the_plain_proxy_and_the_engine_proxy_refuse_a_non_json_200(engine, tmp_path, engine_setting) -> None:
    hostile, _ = engine
    hostile.mode = "json_array"
    with beside(engine, tmp_path, engine=engine_setting) as (url, _):
        answer = complete(url)
    assert answer.status_code == 502 and "not a JSON object" in error_of(answer)["message"]


def test_auto_with_a_deeply_nested_models_answer_still_serves(engine, tmp_path) -> None:
    hostile, _ = engine
    hostile.mode, hostile.nested_models = "ok", True
    try:
        with beside(engine, tmp_path, engine="auto") as (url, _):
            answer = complete(url, counted=False)  # an engine that does not say what it is: none read
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"
            models = httpx.get(url + "/v1/models", timeout=30)
            assert models.status_code == 502 and error_of(models)["code"] == "upstream_error"
    finally:
        hostile.nested_models = False


# ---------------------------------------------------------------------- routing that must not be counted
def test_a_lying_npy_header_is_a_data_error_and_the_client_gets_the_answer(engine, sidecar) -> None:
    hostile, _ = engine
    url, running = sidecar
    hostile.mode = "lying_npy"
    before = counted_tokens(running)
    with watched(url, "lying .npy header") as figures:
        answer = complete(url)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "still here"
    assert "routed_experts" not in answer.json()["choices"][0]
    assert (
        metric_value(get_metrics(url), "mla_watch_engine_routing_data_errors_total", engine="vllm", reason="encoding")
        >= 1
    )
    assert counted_tokens(running) == before and figures["rss_growth"] < RSS_BOUND


def test_all_zero_routing_is_never_counted_and_the_page_names_the_cause(engine, tmp_path, caplog) -> None:
    hostile, _ = engine
    hostile.mode = "all_zero"
    with beside(engine, tmp_path) as (url, running), caplog.at_level(logging.WARNING, "mla_watch"):
        for _ in range(5):
            assert complete(url).status_code == 200
        assert counted_tokens(running) == 0
        metrics = get_metrics(url)
        assert (
            metric_value(metrics, "mla_watch_engine_routing_data_errors_total", engine="vllm", reason="duplicate_ids")
            == 5
        )
        problems = httpx.get(url + "/v1/status", timeout=30).json()["engine"]["problems"]
        assert any("--enforce-eager" in problem for problem in problems)
        hostile.mode = "ok"  # the engine mended: the warning goes
        assert complete(url).status_code == 200
        assert httpx.get(url + "/v1/status", timeout=30).json()["engine"]["problems"] == []
    lines = [r for r in caplog.records if "duplicate_ids" in r.getMessage()]
    assert len(lines) == 1


def test_an_engine_without_its_routing_flag_is_named_once_in_the_log_and_on_the_page(engine, tmp_path, caplog) -> None:
    hostile, _ = engine
    hostile.mode = "no_routing"
    with beside(engine, tmp_path) as (url, _), caplog.at_level(logging.WARNING, "mla_watch"):
        for _ in range(6):
            assert complete(url).status_code == 200
        problems = httpx.get(url + "/v1/status", timeout=30).json()["engine"]["problems"]
    assert any("--enable-return-routed-experts" in problem for problem in problems)
    assert len([r for r in caplog.records if "--enable-return-routed-experts" in r.getMessage()]) == 1


def test_with_two_choices_the_prompt_is_counted_once(engine, tmp_path) -> None:
    hostile, _ = engine
    hostile.mode = "two_choices"
    with beside(engine, tmp_path) as (url, running):
        assert complete(url, n=2).status_code == 200
        assert counted_tokens(running) == 6 + 3 + 3


def test_the_proxy_not_the_client_decides_the_prompt_start(engine, tmp_path) -> None:
    hostile, _ = engine
    hostile.mode = "ok"
    with beside(engine, tmp_path) as (url, running):
        answer = complete(url, routed_experts_prompt_start=5)
        assert answer.status_code == 200
        assert "routed_experts_prompt_start" not in hostile.bodies[-1]
        assert counted_tokens(running) == 9  # every row, not the 4 the client's start would leave
        kept = answer.json()["choices"][0]["routed_experts"]
        assert kept == vllm_routing(ids(9)[5:])  # the client still gets the rows it asked for
        refused = complete(url, routed_experts_prompt_start=-1)
        assert refused.status_code == 400 and error_of(refused)["param"] == "routed_experts_prompt_start"


# ---------------------------------------------------------------------- credentials
def test_upstream_credentials_are_sent_as_basic_auth_and_never_shown(engine, tmp_path, caplog) -> None:
    hostile, engine_url = engine
    hostile.mode = "ok"
    with_password = engine_url.replace("http://", f"http://watch:{PASSWORD}@")
    dead = "http://watch:" + PASSWORD + "@127.0.0.1:9"
    with caplog.at_level(logging.DEBUG):
        with beside(engine, tmp_path, upstream=with_password) as (url, _):
            assert complete(url).status_code == 200
            shown = [
                httpx.get(url + path, timeout=30).text
                for path in ("/v1/status", "/v1/retune/jobs", "/v1/retune/versions", "/v1/routing", "/metrics", "/")
            ]
        with beside(engine, tmp_path, upstream=dead) as (url, _):
            failed = complete(url)
            shown.append(failed.text)
    assert failed.status_code == 502 and "127.0.0.1:9" in failed.text
    expected = "Basic " + base64.b64encode(f"watch:{PASSWORD}".encode()).decode()
    assert hostile.headers[-1]["authorization"] == expected
    for text in [*shown, caplog.text]:
        assert PASSWORD not in text
    assert any(r.name == "mla_watch.server.upstream" for r in caplog.records), "the upstream request log was captured"


def test_a_bad_upstream_url_is_refused_without_repeating_it(capsys) -> None:
    from mla_watch.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--upstream", f"ftp://watch:{PASSWORD}@host:99999"])
    error = capsys.readouterr().err
    assert "--upstream" in error and PASSWORD not in error
