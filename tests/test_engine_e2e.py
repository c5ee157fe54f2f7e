"""A proxy sidecar in front of an embedded sidecar, both live `mla-watch serve` processes on loopback.

The upstream serves the bundled model with ``--return-routed-experts`` (vLLM's and SGLang's fields,
as pinned in tests/test_engine_formats.py); one proxy reads it as vLLM (``--engine vllm``), one as
SGLang (``--engine sglang``), each with ``--model-config`` of the bundled model. Mixed business
lines, streamed and not: the proxies' per-line statistics equal the upstream probe's own, exactly;
vLLM's streams (which carry no routing) are counted as responses without routing. The upstream's
model has a collapsed router, and the proxy's rules page on-call about it, saying that re-tuning
is not available for an engine's routers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from harness.broken_deploy import collapsed_checkpoint
from harness.receivers import running_receiver
from harness.support import free_port, metric_value, settled_over_http, sidecar_process, wait_until
from mla_watch.alerting.examples import entropy_low_rules
from tests.client import post, sse_events

pytestmark = pytest.mark.slow

COLLAPSED = "model.layers.1.mlp.gate"
COMPARED = ("tokens", "selections", "entropy_bits", "max_violation", "dead_slots", "normalized_entropy")


@contextmanager
def serving(state: Path, args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``mla-watch serve ARGS`` as a ready process on a free loopback port: its URL."""
    port = free_port()
    with sidecar_process(port, state, *args, env=env, log=log):
        yield f"http://127.0.0.1:{port}"


def experts(url: str, line: str) -> dict[str, dict]:
    body = httpx.get(url + "/v1/routing", params={"business_line": line}, timeout=30).json()
    return {r["name"]: {key: r[key] for key in COMPARED} for r in body["routers"] if r["kind"] == "expert"}


def completion(url: str, line: str, prompt: str, *, stream: bool, chat: bool) -> None:
    body: dict = {"max_tokens": 12, "temperature": 0.8, "seed": len(prompt)}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-Business-Line": line}
    if stream:
        answer = post(url, path, {**body, "stream": True}, headers)
        assert answer.status_code == 200, answer.text
        events = sse_events(answer.text)
        assert events[-1] == "[DONE]" and events[0]["mla_watch"]["policy"]
        assert "routed_experts" not in answer.text  # stripped: the client did not ask for it
    else:
        answer = post(url, path, body, headers)
        assert answer.status_code == 200, answer.text
        document = answer.json()
        # Stripped: the client did not ask for the routing.
        assert "prompt_routed_experts" not in document and "sglext" not in document
        assert document["mla_watch"]["policy"]


def test_proxies_count_exactly_what_the_upstream_probe_counted_and_page_on_its_collapse(tmp_path: Path) -> None:
    model = collapsed_checkpoint(tmp_path / "collapsed")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(
        entropy_low_rules(
            below=5.0, resolve_above=5.2, min_tokens=64, actions=("notify", "retune"), business_line="all"
        )
    )
    common = ["--history-interval", "1"]  # sidecar_process adds --device cpu and eager attention
    with ExitStack() as stack, running_receiver() as receiver:
        upstream = stack.enter_context(
            serving(
                tmp_path / "up", [*common, "--model", str(model), "--return-routed-experts"], tmp_path / "upstream.log"
            )
        )
        proxy_args = [
            *common,
            "--upstream",
            upstream,
            "--model-config",
            str(model / "config.json"),
            "--rules",
            str(rules),
            "--alert-interval",
            "0.5",
        ]
        oncall = {"MLA_WATCH_ONCALL_URL": receiver.url + "/hook"}
        vllm = stack.enter_context(
            serving(tmp_path / "v", [*proxy_args, "--engine", "vllm"], tmp_path / "vllm.log", oncall)
        )
        sglang = stack.enter_context(
            serving(tmp_path / "s", [*proxy_args, "--engine", "sglang"], tmp_path / "sglang.log", oncall)
        )

        prompts = ["SELECT name FROM", "def parse(", "Summarise the report", "Where is my order?"]
        for index, prompt in enumerate(prompts):
            completion(vllm, "code_assistant", prompt, stream=False, chat=index % 2 == 0)
            completion(vllm, "customer_service", prompt, stream=True, chat=index % 2 == 1)  # vLLM: no routing
            completion(sglang, "doc_summary", prompt, stream=index % 2 == 0, chat=index % 2 == 1)
            completion(sglang, "default", prompt, stream=index % 2 == 1, chat=index % 2 == 0)
        settled_over_http(vllm, 8)  # counted after each client had its answer
        settled_over_http(sglang, 8)

        for proxy, line in ((vllm, "code_assistant"), (sglang, "doc_summary"), (sglang, "default")):
            counted, truth = experts(proxy, line), experts(upstream, line)
            assert counted == truth and len(counted) == 3, (line, counted, truth)
            assert counted[COLLAPSED]["tokens"] > 0
        # vLLM never sends routing in a stream: nothing counted for that line, each response said so.
        assert "customer_service" not in httpx.get(vllm + "/v1/routing", timeout=10).json()["business_lines"]
        text = httpx.get(vllm + "/metrics", timeout=10).text
        assert metric_value(text, "mla_watch_engine_responses_total", engine="vllm", outcome="no_routing") == 4
        assert metric_value(text, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") == 4
        text = httpx.get(sglang + "/metrics", timeout=10).text
        assert metric_value(text, "mla_watch_engine_responses_total", engine="sglang", outcome="counted") == 8
        assert metric_value(text, "mla_watch_routing_entropy_bits", router=COLLAPSED, business_line="all") < 3.0

        def paged() -> bool:
            return any(
                alert["labels"].get("router") == COLLAPSED and body.get("status") == "firing"
                for body in (r.json() for r in list(receiver.requests))
                for alert in body.get("alerts", [])
            )

        assert wait_until(paged, timeout=60, interval=0.25), (tmp_path / "sglang.log").read_text()[-3000:]
        alerts = [alert for body in (r.json() for r in list(receiver.requests)) for alert in body["alerts"]]
        assert {alert["labels"]["router"] for alert in alerts} == {COLLAPSED}  # healthy layers never page
        # The upstream here is no vLLM: it cannot tokenize nor score the reference prompts, so the cause cannot be
        # told, the page says so, and no router is re-tuned on a page whose cause is not the model.
        assert all(
            alert["labels"]["cause"] == "undetermined" and "retune" not in alert["annotations"] for alert in alerts
        ), alerts
        assert all("could not be read through" in alert["annotations"]["cause"] for alert in alerts), alerts
        # --model-config names the checkpoint's config.json: the routers' tensors are read beside it, so re-tuning
        # is available (proposals: the default) and waits for a page whose cause is the model
        status = httpx.get(sglang + "/v1/status", timeout=10).json()
        assert status["engine"]["engine"] == "sglang" and status["engine"]["retune"].startswith(
            "re-tuning the engine's routers: propose"
        ), status["engine"]
        assert httpx.get(sglang + "/v1/retune/jobs", timeout=10).json()["jobs"] == []
