"""Fake engines that answer at once with canned bodies (``engine_app("plain" | "vllm")``), and the DeepSeek-V3
routing they carry: what bench/proxy_hop.py measures the proxy's hop against, and tests/test_proxy_hop.py runs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mla_watch.engines.formats import encode_vllm, every_layer
from mla_watch.engines.geometry import EngineGeometry, parse_geometry

__all__ = [
    "DEEPSEEK_V3",
    "GENERATED",
    "PROMPT_IDS",
    "ROUTED_TOKENS",
    "answers",
    "engine_app",
    "routing_ids",
    "stream_events",
]

# DeepSeek-V3's config.json, the keys that place its routers: layers 3..60 are MoE.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
}
ROUTED_TOKENS = 2000  # routing rows in every answer of the vLLM engine
GENERATED = 16  # tokens in every answer (and chunks in every stream)
PROMPT_IDS = ROUTED_TOKENS - GENERATED + 1  # the vLLM engine's prompt: prompt + generated - 1 routing rows


def routing_ids(rng: np.random.Generator, tokens: int, geometry: EngineGeometry) -> np.ndarray:
    """``[tokens, moe_layers, top_k]`` distinct experts per token, skewed per layer (Gumbel top-k of a bias)."""
    moe, experts, top_k = len(geometry.moe_layers), geometry.num_experts, geometry.top_k
    bias = rng.normal(0.0, 1.0, (moe, experts))
    parts = []
    for start in range(0, tokens, 250):  # chunks: [250, 58, 256] keys at a time
        keys = bias[None] + rng.gumbel(size=(min(250, tokens - start), moe, experts))
        parts.append(np.argpartition(-keys, top_k, axis=2)[..., :top_k])
    return np.concatenate(parts).astype(np.int32)


def answers(routed: bool) -> dict[str, Any]:
    """The canned answers of one fake engine: built once, served as they are."""
    text = " tok" * GENERATED
    usage = {
        "prompt_tokens": PROMPT_IDS if routed else 8,
        "completion_tokens": GENERATED,
        "total_tokens": (PROMPT_IDS if routed else 8) + GENERATED,
    }
    completion = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": usage,
    }
    chat = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": usage,
    }
    canned: dict[str, Any] = {}
    if routed:
        geometry = parse_geometry(DEEPSEEK_V3)
        rows = routing_ids(np.random.default_rng(0), ROUTED_TOKENS, geometry)
        field_value = encode_vllm(
            every_layer(rows, list(geometry.moe_layers), geometry.num_hidden_layers), geometry.num_experts
        )
        completion["choices"][0]["routed_experts"] = field_value
        chat["choices"][0]["routed_experts"] = field_value
        # A stream's replay: its prompt ids plus the generated ones but the last, one token generated.
        replay = {
            **completion,
            "choices": [{**completion["choices"][0], "text": " tok"}],
            "usage": {"prompt_tokens": ROUTED_TOKENS, "completion_tokens": 1, "total_tokens": ROUTED_TOKENS + 1},
        }
        canned["replay"] = json.dumps(replay).encode()
    canned["completion"] = json.dumps(completion).encode()
    canned["chat"] = json.dumps(chat).encode()
    return canned


def stream_events(routed: bool, token_ids: bool) -> list[bytes]:
    """A streamed chat as vLLM sends it: the role, one chunk per token, the last one finishing, ``[DONE]``."""

    def event(chunk: dict[str, Any]) -> bytes:
        document = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "bench",
            **chunk,
        }
        return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"

    first: dict[str, Any] = {
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]
    }
    if routed and token_ids:
        first["prompt_token_ids"] = [(7 * i) % 50000 + 100 for i in range(PROMPT_IDS)]
    events = [event(first)]
    for step in range(GENERATED):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": " tok"},
            "logprobs": None,
            "finish_reason": "length" if step == GENERATED - 1 else None,
        }
        if routed and token_ids:
            choice["token_ids"] = [1000 + step]
        events.append(event({"choices": [choice]}))
    return [*events, b"data: [DONE]\n\n"]


def engine_app(kind: str) -> Any:
    """A fake engine, ``plain`` or ``vllm`` (a Starlette app): answers at once with canned bodies."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    routed = kind == "vllm"
    canned = answers(routed)
    streams = {ids: stream_events(routed, ids) for ids in (False, True)}

    async def relay(events: list[bytes]) -> Any:
        for event in events:
            yield event

    async def completions(request: Request) -> Response:
        asked = await request.json()
        if routed and isinstance(asked.get("prompt"), list):  # a stream's replay: its token ids
            return Response(canned["replay"], media_type="application/json")
        return Response(canned["completion"], media_type="application/json")

    async def chat(request: Request) -> Response:
        asked = await request.json()
        if asked.get("stream"):
            return StreamingResponse(
                relay(streams[asked.get("return_token_ids") is True]), media_type="text/event-stream"
            )
        return Response(canned["chat"], media_type="application/json")

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": "bench", "object": "model", "created": 1700000000, "owned_by": "vllm" if routed else "bench"}
                ],
            }
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )
