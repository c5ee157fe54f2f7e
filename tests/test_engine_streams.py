"""Streams beside vLLM, counted by replay, and counting after the answer: against a vLLM twin on loopback.

The twin (tests/vllm_twin.py) speaks vLLM 0.32's stream and routing formats, with routing a function of
each token and its position, so a replay must count exactly what the unstreamed request counts. The
real vLLM runs the same checks in tests/test_real_vllm_proxy.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.support import get_metrics, metric_value, running_sidecar, serve_app, settled
from mla_watch.engines import answer_reader as answer_reader_module
from mla_watch.engines.count_queue import CountQueue
from mla_watch.engines.formats import RoutingPlan, count_response, encode_vllm
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.replay import MAX_STREAM_TOKENS, ReplayBudget, StreamReplayer, StreamTokens
from mla_watch.engines.watch import EngineMetrics, EngineRouting
from mla_watch.server import proxy as proxy_module
from tests.vllm_twin import SILENT_TOKEN, VllmTwin

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
GEOMETRY = parse_geometry(CONFIG)
ROUTERS = GEOMETRY.router_names


@contextmanager
def beside_twin(tmp_path: Path, **overrides) -> Iterator[tuple[VllmTwin, str, object]]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    twin = VllmTwin(GEOMETRY)
    with (
        serve_app(twin.app) as twin.url,
        running_sidecar(
            upstream=twin.url,
            model_config=config,
            engine="vllm",
            decode_workers=0,
            rules=None,
            window_tokens=None,
            **overrides,
        ) as (url, sidecar),
    ):
        yield twin, url, sidecar


def ask(
    url: str, line: str, *, chat: bool, stream: bool, n: int = 1, prompt: str = "where is my order", **extra
) -> list | dict:
    body: dict = {"max_tokens": 6, "n": n, "stream": stream, **extra}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    answer = httpx.post(
        url + ("/v1/chat/completions" if chat else "/v1/completions"),
        json=body,
        headers={"X-Business-Line": line},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    if not stream:
        return answer.json()
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]


def counted(sidecar, line: str) -> np.ndarray:
    counts = sidecar.engine_routing.counts(line)
    return np.stack([counts[name] for name in ROUTERS])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_request_counts_exactly_what_it_counts_unstreamed(tmp_path, chat, n) -> None:
    with beside_twin(tmp_path) as (twin, url, sidecar):
        ask(url, "code_assistant", chat=chat, stream=False, n=n)
        events = ask(url, "customer_service", chat=chat, stream=True, n=n)
        settled(sidecar, 2)
        unstreamed, streamed = counted(sidecar, "code_assistant"), counted(sidecar, "customer_service")
        assert streamed.sum() > 0 and np.array_equal(streamed, unstreamed)
        tokens = {
            line: sidecar.engine_routing.windows.router_stats(line)[0].stats.tokens
            for line in ("code_assistant", "customer_service")
        }
        assert tokens["customer_service"] == tokens["code_assistant"]
        metrics = get_metrics(url)
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="replayed") == 1
        assert metric_value(metrics, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") == 2
        assert metric_value(metrics, "mla_watch_engine_replay_tokens_total") == sum(
            len(body["prompt"]) for body in twin.replays
        )
        replays = twin.replays
        assert len(replays) == n and all(r["max_tokens"] == 1 and r["temperature"] == 0 for r in replays)
        # The second choice shares the prompt: its replay leaves the prompt rows out.
        assert [r.get("routed_experts_prompt_start", 0) > 0 for r in replays] == [False] + [True] * (n - 1)
        assert events[-1] == "[DONE]" and events[0]["mla_watch"]["policy"].startswith("customer_service/")


def test_the_client_gets_the_stream_the_engine_sends_without_token_ids(tmp_path) -> None:
    with beside_twin(tmp_path) as (twin, url, _):
        for chat in (False, True):
            relayed = ask(url, "customer_service", chat=chat, stream=True, n=2)
            streamed = [body for body in twin.bodies if body.get("stream")][-1]
            assert streamed["return_token_ids"] is True  # asked of the engine, for the replay
            path = "/v1/chat/completions" if chat else "/v1/completions"
            direct_body = {k: v for k, v in streamed.items() if k != "return_token_ids"}
            direct = httpx.post(twin.url + path, json=direct_body, timeout=30).text
            expected = [
                e if e == "[DONE]" else json.loads(e)
                for e in (line[6:] for line in direct.splitlines() if line.startswith("data: "))
            ]
            relayed[0].pop("mla_watch")
            assert relayed == expected  # no ids, and chat's empty step (the silent token) left out again
            assert "token_ids" not in json.dumps(relayed)


def test_a_client_that_asks_for_token_ids_gets_them_and_the_stream_is_still_counted(tmp_path) -> None:
    with beside_twin(tmp_path) as (_, url, sidecar):
        events = ask(url, "customer_service", chat=True, stream=True, return_token_ids=True)
        settled(sidecar, 1)
        assert events[0]["prompt_token_ids"] and any(
            choice.get("token_ids") == [SILENT_TOKEN] and choice["delta"] == {}
            for event in events[1:-1]
            for choice in event["choices"]
        )
        assert counted(sidecar, "customer_service").sum() > 0


def test_replays_past_the_budget_or_refused_are_counted_by_outcome_and_never_touch_the_stream(tmp_path) -> None:
    budget = ReplayBudget(tokens_per_second=1.0)  # the first replay runs the bucket into ~40 s of debt
    with beside_twin(tmp_path, replay=budget) as (twin, url, sidecar):
        ask(url, "customer_service", chat=False, stream=True)
        ask(url, "customer_service", chat=False, stream=True)
        settled(sidecar, 2)
        metrics = get_metrics(url)
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="replayed") == 1
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="over_token_budget") == 1
    with beside_twin(tmp_path) as (twin, url, sidecar):
        twin.replay_status = 500
        events = ask(url, "customer_service", chat=True, stream=True)
        settled(sidecar, 1)
        assert events[-1] == "[DONE]"
        metrics = get_metrics(url)
        assert metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="failed") == 1
        assert metric_value(metrics, "mla_watch_engine_responses_total", engine="vllm", outcome="no_routing") == 1
        assert "customer_service" not in sidecar.engine_routing.windows.business_lines


def test_a_stream_the_client_leaves_is_not_replayed(tmp_path) -> None:
    with beside_twin(tmp_path) as (twin, url, sidecar):
        twin.step_seconds = 0.5
        body = {"prompt": "where is my order", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as answer:
            next(answer.iter_lines())  # one chunk, then the client is gone
        settled(sidecar, 1)
        assert metric_value(get_metrics(url), "mla_watch_engine_stream_replays_total", outcome="incomplete") == 1
        assert twin.replays == []


def test_a_replay_rate_of_zero_asks_for_no_token_ids(tmp_path) -> None:
    with beside_twin(tmp_path, replay=ReplayBudget(rate=0.0)) as (twin, url, sidecar):
        ask(url, "customer_service", chat=False, stream=True)
        settled(sidecar, 1)
        assert "return_token_ids" not in twin.bodies[-1] and twin.replays == []


# ---------------------------------------------------------------------- the pieces, on their own
def chunk(index: int, **fields) -> dict:
    return {"choices": [{"index": index, **fields}]}


def test_stream_tokens_read_each_choices_prompt_and_generated_ids_and_group_shared_prompts() -> None:
    tokens = StreamTokens("completion", strip=True)
    first = chunk(0, text="a", prompt_token_ids=[1, 2, 3], token_ids=[10], finish_reason=None)
    assert tokens.take(first) and "prompt_token_ids" not in first["choices"][0]
    tokens.take(chunk(1, text="b", prompt_token_ids=[1, 2, 3], token_ids=[20], finish_reason=None))
    tokens.take(chunk(0, text="c", token_ids=[11], finish_reason="length"))
    assert tokens.replays() == "incomplete"  # choice 1 has not finished
    tokens.take(chunk(1, text="d", token_ids=[21], finish_reason="stop"))
    assert [(list(ids), start) for ids, start in tokens.replays()] == [([1, 2, 3, 10], 0), ([1, 2, 3, 20], 3)]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"token_ids": ["1"]}, "token ids of a list"),
        ({"token_ids": [-1]}, "token ids of a list"),
        ({"token_ids": 5}, "token ids of 5"),
        ({"index": 99}, "a choice index of 99"),
        ({"token_ids": [1] * (MAX_STREAM_TOKENS + 1)}, "more than"),
    ],
)
def test_ids_that_are_not_token_ids_make_a_stream_unreadable_not_an_error(bad, why) -> None:
    tokens = StreamTokens("completion", strip=False)
    tokens.take(chunk(0, prompt_token_ids=[1], token_ids=[2], finish_reason=None))
    tokens.take({"choices": [{"index": 0, "finish_reason": "length", **bad}]})
    assert tokens.replays() == "unreadable" and why in tokens.unreadable


class SlowDecoder:
    """A decoder whose counting waits for the test: the queue behind it fills."""

    workers = 1

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def count(self, plan, body):
        await self.release.wait()
        return count_response(plan, body)


def test_the_count_queue_is_bounded_and_counts_what_it_drops() -> None:
    from prometheus_client import CollectorRegistry

    async def run() -> tuple[list[bool], EngineRouting]:
        routing = EngineRouting("vllm", GEOMETRY, EngineMetrics(CollectorRegistry()), window_tokens=None)
        decoder = SlowDecoder()
        queue = CountQueue(routing, decoder, max_jobs=2, max_bytes=1 << 20)
        routed = encode_vllm(VllmTwin(GEOMETRY).routing([1, 2, 3]), GEOMETRY.num_experts)
        body = json.dumps({"choices": [{"index": 0, "text": "x", "routed_experts": routed}]}).encode()
        plan = RoutingPlan("vllm", GEOMETRY, keep=False)
        admitted = [queue.submit("a", plan, body, streamed=False) for _ in range(3)]
        await asyncio.sleep(0)  # the consumer takes the first
        admitted.append(queue.submit("a", plan, body, streamed=False))
        decoder.release.set()
        await queue.close()
        return admitted, routing

    admitted, routing = asyncio.run(run())
    assert admitted == [True, True, False, True]
    assert routing.metrics.count_dropped.labels("queue_full")._value.get() == 1
    assert routing.answers == 3 and routing.counts("a")[ROUTERS[0]].sum() == 3 * 3 * 4  # 3 answers of 3 tokens


def test_the_replayer_queue_and_token_bucket_follow_the_injected_clock() -> None:
    from prometheus_client import CollectorRegistry

    now = [0.0]
    sent: list[dict] = []

    async def send(payload: dict, headers: dict) -> bytes:
        sent.append(payload)
        return b'{"choices":[{"index":0,"text":"x","routed_experts":null}]}'

    async def run() -> EngineRouting:
        routing = EngineRouting("vllm", GEOMETRY, EngineMetrics(CollectorRegistry()), window_tokens=None)
        queue = CountQueue(routing, SlowDecoder())
        queue._decoder.release.set()
        replayer = StreamReplayer(send, queue, ReplayBudget(tokens_per_second=10.0), clock=lambda: now[0])
        plan = RoutingPlan("vllm", GEOMETRY, keep=False)

        def finished(length: int) -> StreamTokens:
            tokens = StreamTokens("completion", strip=True)
            tokens.take(chunk(0, prompt_token_ids=list(range(length)), token_ids=[5, 6], finish_reason="length"))
            return tokens

        outcomes = [replayer.after_stream("a", plan, "m", {}, finished(14))]  # 15 tokens: 5 of debt
        outcomes.append(replayer.after_stream("a", plan, "m", {}, finished(4)))
        now[0] = 0.6  # +6 tokens: back in credit
        outcomes.append(replayer.after_stream("a", plan, "m", {}, finished(4)))
        await asyncio.sleep(0.05)
        await replayer.close()
        assert outcomes == ["queued", "over_token_budget", "queued"]
        return routing

    routing = asyncio.run(run())
    replays = routing.metrics.stream_replays
    assert replays.labels("over_token_budget")._value.get() == 1
    assert replays.labels("no_routing")._value.get() == 2  # the engine answered the replays without routing
    assert [len(p["prompt"]) for p in sent] == [15, 5]


def test_a_replay_budget_out_of_range_stops_start_up_naming_the_setting(tmp_path) -> None:
    from mla_watch.server.app import ServerConfigError

    with (
        pytest.raises(ServerConfigError, match=r"replay\.rate = 1\.5: expected a share between 0 and 1"),
        beside_twin(tmp_path, replay=ReplayBudget(rate=1.5)),
    ):
        pass


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_that_carries_its_routing_is_counted_from_its_chunks_without_a_replay(tmp_path, chat, n) -> None:
    """vLLM's stream routing (tests/vllm_twin.py, ``stream_routing``): counted as the unstreamed answer is, the
    prompt rows every choice repeats once; the client's stream has none of it; nothing is replayed."""
    with beside_twin(tmp_path) as (twin, url, sidecar):
        twin.stream_routing = True
        ask(url, "code_assistant", chat=chat, stream=False, n=n)
        events = ask(url, "customer_service", chat=chat, stream=True, n=n)
        settled(sidecar, 2)
        unstreamed, streamed = counted(sidecar, "code_assistant"), counted(sidecar, "customer_service")
        assert streamed.sum() > 0 and np.array_equal(streamed, unstreamed)
        assert twin.replays == [] and "routed_experts" not in json.dumps(events)
        metrics = get_metrics(url)
        assert not metric_value(metrics, "mla_watch_engine_stream_replays_total", outcome="replayed")
        assert metric_value(metrics, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") == 2
        assert events[-1] == "[DONE]" and events[0]["mla_watch"]["policy"].startswith("customer_service/")
        finished = [choice for event in events[1:-1] for choice in event["choices"] if choice["finish_reason"]]
        assert len(finished) == n  # the terminal chunks reach the client, without the routing


def test_a_client_that_asks_for_stream_routing_gets_it_from_the_prompt_start_it_asked(tmp_path) -> None:
    with beside_twin(tmp_path) as (twin, url, sidecar):
        twin.stream_routing = True
        events = ask(
            url, "customer_service", chat=False, stream=True, return_routed_experts=True, routed_experts_prompt_start=3
        )
        settled(sidecar, 1)
        (routed,) = [
            choice["routed_experts"]
            for event in events[1:-1]
            for choice in event["choices"]
            if "routed_experts" in choice
        ]
        prompt = list(b"where is my order")
        generated = twin.generated(prompt, 0, 6)
        expected = twin.routing(prompt + generated[:-1])[3:]
        assert routed == encode_vllm(expected, GEOMETRY.num_experts)
        assert counted(sidecar, "customer_service").sum() == (len(prompt) + 5) * len(ROUTERS) * GEOMETRY.top_k
        assert twin.replays == []


def test_streams_whose_chunks_carry_no_routing_are_still_replayed(tmp_path) -> None:
    """``routed_experts: null`` on every chunk (a model field serialised without exclude_none) is no routing."""
    with beside_twin(tmp_path) as (twin, url, sidecar):
        original = twin._stream

        async def with_nulls(*args, **kwargs):
            async for event in original(*args, **kwargs):
                yield event.replace(b'"logprobs":null', b'"logprobs":null,"routed_experts":null')

        twin._stream = with_nulls
        events = ask(url, "customer_service", chat=True, stream=True)
        settled(sidecar, 1)
        assert len(twin.replays) == 1 and counted(sidecar, "customer_service").sum() > 0
        assert "routed_experts" not in json.dumps(events)


def test_a_routing_chunk_may_be_longer_than_a_stream_line_without_routing(tmp_path) -> None:
    """--upstream-max-line-bytes bounds chunks; the terminal chunk with the routing is bounded as an answer is."""
    # The first chunk carries the prompt's token ids (1.5 KB), the last the routing (8 KB of base64 for this
    # prompt): past the 4 KB a line may have without routing.
    with beside_twin(tmp_path, upstream_max_line_bytes=4096) as (twin, url, sidecar):
        twin.stream_routing = True
        prompt = "where is my order " * 20
        ask(url, "code_assistant", chat=False, stream=False, prompt=prompt)
        events = ask(url, "customer_service", chat=False, stream=True, prompt=prompt)
        settled(sidecar, 2)
        assert events[-1] == "[DONE]" and not any("error" in event for event in events[:-1])
        assert np.array_equal(counted(sidecar, "customer_service"), counted(sidecar, "code_assistant"))


@pytest.mark.parametrize("stream_routing", [False, True], ids=["token_ids", "routing_chunks"])
def test_a_streamed_chunk_runs_down_into_the_engines_reader_and_never_back_up(tmp_path, stream_routing) -> None:
    """Watched running: the proxy (server/) hands each read of a stream to one reader (engines/), which reads,
    strips, marks and counts it and returns what the client gets; nothing it calls on the way runs in server/.
    (A replay, after the stream, sends through the proxy's exchange: not a chunk's path.)"""
    server_dir = str(Path(proxy_module.__file__).parent) + os.sep
    engines_dir = str(Path(answer_reader_module.__file__).parent) + os.sep
    climbs: set[str] = set()  # server/ code run beneath engines/ code on a chunk's path
    entered: set[str] = set()  # what of engines/ server/ calls on a chunk's path: the reader's interface only

    def relayed_below(frame) -> tuple[bool, str | None]:
        """Whether ``frame`` runs under the proxy's stream relay, and the engines/ frame between them, if any."""
        between = None
        caller = frame.f_back
        while caller is not None:
            code = caller.f_code
            if code.co_filename.startswith(server_dir) and code.co_name == "_relay_stream":
                return True, between
            if between is None and code.co_filename.startswith(engines_dir):
                between = f"{Path(code.co_filename).name}:{code.co_name}"
            caller = caller.f_back
        return False, None

    def watch(frame, event, arg) -> None:
        if event != "call":  # a call, or a coroutine resumed
            return
        filename = frame.f_code.co_filename
        if filename.startswith(server_dir):
            relayed, between = relayed_below(frame)
            if relayed and between is not None:
                climbs.add(f"{between} -> {Path(filename).name}:{frame.f_code.co_name}")
        elif (
            filename.startswith(engines_dir)
            and frame.f_back is not None
            and frame.f_back.f_code.co_filename.startswith(server_dir)
            and relayed_below(frame)[0]
        ):
            entered.add(f"{Path(filename).name}:{frame.f_code.co_name}")

    threading.setprofile(watch)  # the threads about to start: the sidecar's server and its decoding thread
    try:
        with beside_twin(tmp_path) as (twin, url, sidecar):
            twin.stream_routing = stream_routing
            events = ask(url, "customer_service", chat=True, stream=True, n=2)
            settled(sidecar, 1)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert events[-1] == "[DONE]" and events[0]["mla_watch"]["policy"].startswith("customer_service/")
    assert counted(sidecar, "customer_service").sum() > 0
    assert entered == {"answer_reader.py:feed", "answer_reader.py:end", "answer_reader.py:finish"}, sorted(entered)
    assert not climbs, sorted(climbs)
