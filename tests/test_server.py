"""The sidecar over real HTTP on loopback: serving, policies, streaming, routing, metrics, bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.support import get_metrics, metric_value, wait_until
from tests.client import SQL, post, sse_events

pytestmark = pytest.mark.slow

CODE = {"X-Business-Line": "code_assistant", "X-Task": "code"}


def test_health_readiness_models(sidecar) -> None:
    url, _ = sidecar
    assert httpx.get(url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(url + "/readyz").json()
    assert ready["ready"] is True and ready["attention"]["used"] in ("sdpa", "eager")
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "bundled"


def test_code_request_is_clamped_and_says_so(sidecar) -> None:
    url, _ = sidecar
    response = post(
        url, "/v1/completions", {"prompt": "def parse_invoice(", "max_tokens": 8, "temperature": 0.9, "seed": 1}, CODE
    )
    assert response.status_code == 200
    assert response.headers["X-MLA-Policy"] == "code_assistant/code"
    body = response.json()
    adjustments = {a["param"]: a for a in body["mla_watch"]["adjustments"]}
    assert adjustments["temperature"] == {"param": "temperature", "requested": 0.9, "applied": 0.3}
    assert adjustments["repetition_penalty"] == {"param": "repetition_penalty", "requested": None, "applied": 1.2}
    assert body["usage"]["completion_tokens"] == len(body["choices"]) * 8 or body["choices"][0]["finish_reason"]
    assert body["object"] == "text_completion"


def test_explicit_zero_temperature_is_a_value(sidecar) -> None:
    url, _ = sidecar
    body = post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2, "temperature": 0}, CODE).json()
    adjustments = {a["param"]: a for a in body["mla_watch"]["adjustments"]}
    assert adjustments["temperature"]["requested"] == 0 and adjustments["temperature"]["applied"] == 0.1


def test_a_clamped_request_generates_exactly_what_the_clamped_values_generate(sidecar) -> None:
    url, _ = sidecar
    prompt = {"prompt": "def count_active_users(", "max_tokens": 24, "seed": 11}
    clamped = post(url, "/v1/completions", {**prompt, "temperature": 1.7, "top_p": 0.01}, CODE).json()
    applied = {a["param"]: a["applied"] for a in clamped["mla_watch"]["adjustments"]}
    assert applied["temperature"] == 0.3 and applied["top_p"] == 0.05
    # The permissive default policy keeps these values as they are, so the sampler sees the same numbers.
    direct = post(
        url,
        "/v1/completions",
        {**prompt, "temperature": 0.3, "top_p": 0.05, "repetition_penalty": 1.2},
        {"X-Business-Line": "default"},
    ).json()
    assert direct["mla_watch"]["adjustments"] == [{"param": "n", "requested": None, "applied": 1}]
    assert clamped["choices"][0]["text"] == direct["choices"][0]["text"]
    other_seed = post(
        url, "/v1/completions", {**prompt, "seed": 12, "temperature": 1.0, "top_p": 1.0}, {"X-Business-Line": "default"}
    ).json()
    assert other_seed["choices"][0]["text"] != clamped["choices"][0]["text"]


def test_sql_rejects_and_names_parameter_value_and_range(sidecar) -> None:
    url, _ = sidecar
    before = get_metrics(url)
    response = post(url, "/v1/completions", {"prompt": "SELECT", "temperature": 0.9}, SQL)
    assert response.status_code == 400
    assert response.headers["X-MLA-Policy"] == "code_assistant/sql"  # the policy that refused it
    error = response.json()["error"]
    assert error["param"] == "temperature" and error["code"] == "policy_violation"
    assert "0.9" in error["message"] and "[0.1, 0.3]" in error["message"]
    after = get_metrics(url)
    labels = {"business_line": "code_assistant", "task": "sql", "param": "temperature"}
    assert (
        metric_value(after, "mla_watch_policy_rejections_total", **labels)
        == metric_value(before, "mla_watch_policy_rejections_total", **labels) + 1
    )


def test_metadata_carries_the_business_line_and_must_not_contradict_headers(sidecar) -> None:
    url, _ = sidecar
    body = {"prompt": "SELECT", "max_tokens": 2, "metadata": {"business_line": "code_assistant", "task": "sql"}}
    assert post(url, "/v1/completions", body).headers["X-MLA-Policy"] == "code_assistant/sql"
    conflict = post(url, "/v1/completions", body, {"X-Business-Line": "doc_summary"})
    assert conflict.status_code == 400 and conflict.json()["error"]["code"] == "conflict"


def test_streaming_matches_the_non_streamed_text(sidecar) -> None:
    url, _ = sidecar
    request = {
        "messages": [{"role": "user", "content": "Where is my order ORD-2023-11111?"}],
        "max_tokens": 20,
        "seed": 5,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Business-Line": "customer_service"}
    whole = post(url, "/v1/chat/completions", request, headers).json()
    streamed = post(url, "/v1/chat/completions", {**request, "stream": True}, headers)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["X-MLA-Policy"] == "customer_service/chat"
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert events[0]["mla_watch"] == whole["mla_watch"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["delta"].get("content", "") for e in events[1:-1] for c in e.get("choices", []))
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["usage"] == whole["usage"]
    finishes = [c["finish_reason"] for e in events[1:-1] for c in e.get("choices", []) if c["finish_reason"]]
    assert finishes == [whole["choices"][0]["finish_reason"]]


def test_n_and_stop(sidecar) -> None:
    url, _ = sidecar
    body = post(
        url,
        "/v1/completions",
        {"prompt": "SELECT", "max_tokens": 30, "n": 3, "seed": 2, "temperature": 0.3, "stop": ["\n"]},
        SQL,
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert "\n" not in choice["text"]
        assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 90


def test_the_official_openai_client_works_unchanged(sidecar) -> None:
    url, _ = sidecar
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(
        model="bundled", prompt="def add_numbers(", max_tokens=6, temperature=0.8, seed=3, extra_headers=CODE
    )
    assert completion.choices[0].text and completion.usage.completion_tokens <= 6
    assert completion.model_extra["mla_watch"]["policy"] == "code_assistant/code"
    chat = client.chat.completions.create(
        model="bundled",
        max_tokens=8,
        seed=3,
        messages=[{"role": "user", "content": "I need a refund"}],
        extra_body={"metadata": {"business_line": "customer_service"}},
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="bundled",
        max_tokens=8,
        seed=3,
        stream=True,
        messages=[{"role": "user", "content": "I need a refund"}],
        extra_body={"metadata": {"business_line": "customer_service"}},
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="bundled", prompt="SELECT", temperature=0.9, extra_headers=SQL)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_prompts_longer_than_the_model_allows_get_a_clear_400(sidecar) -> None:
    url, sidecar_object = sidecar
    limit = sidecar_object.model_worker.model.config.max_position_embeddings
    response = post(
        url, "/v1/completions", {"prompt": "SELECT a FROM t; " * 400, "max_tokens": 8}, {"X-Business-Line": "default"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
    assert httpx.get(url + "/healthz").status_code == 200


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", {}, "invalid_json", None),
    ("a JSON array", b"[1, 2]", {}, "invalid_json", None),
    ("temperature as text", {"prompt": "x", "temperature": "hot"}, {}, "invalid_value", "temperature"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -5}, {}, "invalid_value", "max_tokens"),
    ("absurd max_tokens", {"prompt": "x", "max_tokens": 10**12}, {}, "invalid_value", "max_tokens"),
    ("boolean n", {"prompt": "x", "n": True}, {}, "invalid_value", "n"),
    (
        "unknown business line",
        {"prompt": "x"},
        {"X-Business-Line": "marketing"},
        "unknown_business_line",
        "X-Business-Line",
    ),
    (
        "unknown task",
        {"prompt": "x"},
        {"X-Business-Line": "code_assistant", "X-Task": "poetry"},
        "unknown_task",
        "X-Task",
    ),
    ("missing prompt", {"max_tokens": 3}, {}, "invalid_value", "prompt"),
]


@pytest.mark.parametrize(("label", "body", "headers", "code", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_a_clear_4xx_and_is_counted(sidecar, label, body, headers, code, param) -> None:
    url, _ = sidecar
    before = metric_value(get_metrics(url), "mla_watch_bad_requests_total", endpoint="/v1/completions", reason=code)
    if isinstance(body, bytes):
        response = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=30)
    else:
        response = post(url, "/v1/completions", body, headers)
    assert 400 <= response.status_code < 500, label
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"]
    after = metric_value(get_metrics(url), "mla_watch_bad_requests_total", endpoint="/v1/completions", reason=code)
    assert after == before + 1


def test_empty_messages_and_a_10_mb_body_are_refused(sidecar) -> None:
    url, _ = sidecar
    empty = post(url, "/v1/chat/completions", {"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    huge = httpx.post(url + "/v1/completions", content=b"x" * (10 * 1024 * 1024), timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    assert post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 1}).status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_the_model(sidecar) -> None:
    url, _ = sidecar
    before = metric_value(get_metrics(url), "mla_watch_client_disconnects_total")
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": "def f(", "max_tokens": 200, "stream": True},
            headers={"X-Business-Line": "default"},
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    assert wait_until(lambda: metric_value(get_metrics(url), "mla_watch_client_disconnects_total") > before, 30)
    assert post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2}).status_code == 200


def test_routing_and_metrics_attribute_traffic_to_business_lines(sidecar) -> None:
    url, _ = sidecar
    for _ in range(2):
        post(
            url,
            "/v1/completions",
            {"prompt": "Document:\nRevenue rose 12% in Q3.\n\nSummary:\n", "max_tokens": 8},
            {"X-Business-Line": "doc_summary"},
        )
    routing = httpx.get(url + "/v1/routing", params={"business_line": "doc_summary"}).json()
    assert "doc_summary" in routing["business_lines"]
    experts = [r for r in routing["routers"] if r["kind"] == "expert"]
    assert len(experts) == 3 and all(r["tokens"] > 0 for r in experts)
    assert all(r["floor_bits"] <= r["entropy_bits"] <= r["ceiling_bits"] for r in experts)
    text = get_metrics(url)
    name = experts[0]["name"]
    entropy = metric_value(
        text,
        "mla_watch_routing_entropy_bits",
        router=name,
        business_line="doc_summary",
        kind="expert",
        layer=str(experts[0]["layer"]),
    )
    assert entropy == pytest.approx(experts[0]["entropy_bits"], abs=0.2)
    assert metric_value(text, "mla_watch_routing_entropy_ceiling_bits", router=name, business_line="all") == 6.0
    # The requests sent no temperature: the policy's default was filled in, which is not a clamp.
    assert (
        metric_value(
            text, "mla_watch_policy_defaults_total", business_line="doc_summary", task="summarize", param="temperature"
        )
        >= 2
    )
    assert (
        metric_value(
            text,
            "mla_watch_policy_adjustments_total",
            business_line="doc_summary",
            task="summarize",
            param="temperature",
        )
        == 0
    )
    counts = httpx.get(url + "/v1/policies").json()["counts"]["doc_summary"]["summarize"]
    assert counts["defaulted"]["temperature"] >= 2 and "temperature" not in counts["clamped"]
    for family in (
        "routing_normalized_entropy",
        "routing_max_violation",
        "routing_dead_slots",
        "routing_window_tokens",
        "routing_entropy_floor_bits",
        "requests_total",
    ):
        assert f"mla_watch_{family}" in text


def test_policies_endpoint_lists_what_is_in_force(sidecar) -> None:
    url, _ = sidecar
    body = httpx.get(url + "/v1/policies").json()
    lines = body["business_lines"]
    assert {"customer_service", "code_assistant", "doc_summary", "default"} <= set(lines)
    assert body["last_reload_error"] is None
