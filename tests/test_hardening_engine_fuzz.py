"""Generated engine answers, streams and compressed bodies: the sidecar answers each, counts only routing a
router could have produced, and holds no more than its caps.

The parts are fuzzed on their own (many cases, fast) and through a live sidecar beside a scripted
engine on loopback (fewer cases, every layer of the proxy)."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from harness.support import running_sidecar, serve_app
from mla_watch.engines.formats import RoutingPlan, decode_chunk, decode_response, encode_sglang, encode_vllm
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.stream_lines import AnswerTooLarge, EventLines
from mla_watch.server.upstream_io import BoundedInflater

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
GEOMETRY = parse_geometry(CONFIG)


@st.composite
def routing_arrays(draw: st.DrawFn) -> np.ndarray:
    """Ids of any shape near the model's, valid or not: repeats, out-of-range ids, wrong axes."""
    tokens = draw(st.integers(0, 6))
    layers = draw(st.sampled_from([GEOMETRY.num_hidden_layers, len(GEOMETRY.moe_layers), 2]))
    top_k = draw(st.sampled_from([GEOMETRY.top_k, 3]))
    values = draw(st.lists(st.integers(0, 20), min_size=tokens * layers * top_k, max_size=tokens * layers * top_k))
    return np.array(values, dtype=np.int64).reshape(tokens, layers, top_k)


def valid(ids: np.ndarray) -> bool:
    """Whether a router could have picked ``ids`` (at the MoE layers of the model)."""
    if ids.ndim != 3 or ids.shape[2] != GEOMETRY.top_k:
        return False
    if ids.shape[1] == GEOMETRY.num_hidden_layers:
        ids = ids[:, list(GEOMETRY.moe_layers)]
    elif ids.shape[1] != len(GEOMETRY.moe_layers):
        return False
    return bool(
        ids.size == 0
        or (
            ids.max() < GEOMETRY.num_experts
            and all(len(set(token_layer)) == GEOMETRY.top_k for token_layer in ids.reshape(-1, GEOMETRY.top_k).tolist())
        )
    )


def as_sglang_reads_it(ids: np.ndarray) -> np.ndarray | None:
    """SGLang's bytes carry no shape: the model config gives it (every layer first, else the MoE layers)."""
    for layers in (GEOMETRY.num_hidden_layers, len(GEOMETRY.moe_layers)):
        if ids.size % (layers * GEOMETRY.top_k) == 0:
            return ids.reshape(-1, layers, GEOMETRY.top_k)
    return None


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def engine_bodies(draw: st.DrawFn) -> tuple[bytes, np.ndarray | None, str]:
    """A body in vLLM's or SGLang's shape, with routing that may be invalid, or junk around it."""
    engine = draw(st.sampled_from(["vllm", "sglang"]))
    ids = draw(routing_arrays())
    encoded = encode_vllm(ids.clip(0, 255), 16) if engine == "vllm" else encode_sglang(ids)
    choice: dict = {"index": 0, "text": draw(st.text(max_size=20))}
    body: dict = {"choices": [choice], "extra": draw(junk)}
    if engine == "vllm":
        choice["routed_experts"] = draw(st.sampled_from([encoded, None, "%%%", 7]))
    else:
        body["sglext"] = {"routed_experts": draw(st.sampled_from([encoded, "AAAA", 7]))}
    raw = json.dumps(body).encode()
    if draw(st.booleans()):  # cut or corrupt it
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=8))
    sent = ids.clip(0, 255) if engine == "vllm" else as_sglang_reads_it(ids)
    return raw, sent if sent is not None and encoded in raw.decode("utf-8", "replace") else None, engine


@settings(max_examples=300, deadline=None)
@given(engine_bodies())
def test_a_decoded_body_never_raises_and_counts_only_routing_a_router_could_produce(case) -> None:
    raw, ids, engine = case
    decoded = decode_response(RoutingPlan(engine, GEOMETRY, keep=False), raw)
    if decoded.counts is not None and decoded.tokens == 0:  # an empty routing field counts nothing
        assert not decoded.counts.any()
    elif decoded.counts is not None:
        assert ids is not None and valid(ids)
        assert (
            decoded.tokens == ids.shape[0]
            and int(decoded.counts.sum()) == ids.shape[0] * len(GEOMETRY.moe_layers) * GEOMETRY.top_k
        )
    chunk = decode_chunk(RoutingPlan(engine, GEOMETRY, keep=False), raw.decode("utf-8", "replace"), first=True)
    assert chunk.counts is None or chunk.tokens == 0 or valid(ids)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([b"data: a", b"\r", b"\n", b"\r\n", "\u2028".encode(), "\x85".encode(), b"x" * 5, b""]),
        max_size=20,
    ),
    st.data(),
)
def test_event_lines_split_only_at_cr_lf_whatever_the_reads(pieces, data) -> None:
    stream = b"".join(pieces)
    reads, position = [], 0
    while position < len(stream):  # the same bytes, cut into reads anywhere
        size = data.draw(st.integers(1, max(1, len(stream) - position)))
        reads.append(stream[position : position + size])
        position += size
    lines = EventLines(limit=1 << 20)
    got = [line for read in reads for line in lines.feed(read)] + lines.finish()
    expected = re.split(rb"\r\n|\r|\n", stream)
    if expected and expected[-1] == b"":
        expected.pop()
    assert got == expected


@settings(max_examples=100, deadline=None)
@given(
    st.binary(max_size=4096),
    st.integers(1, 3000),
    st.sampled_from(["gzip", "deflate", "identity"]),
    st.integers(1, 512),
)
def test_inflating_never_holds_more_than_the_limit(payload, limit, encoding, read_size) -> None:
    if encoding == "gzip":
        packer = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        raw = packer.compress(payload * 50) + packer.flush()
    elif encoding == "deflate":
        raw = zlib.compress(payload * 50)
    else:
        raw = payload * 50
    inflater = BoundedInflater(encoding, limit)
    out = []
    try:
        for start in range(0, len(raw), read_size):
            out.append(inflater.feed(raw[start : start + read_size]))
            assert inflater.size <= limit
        out.append(inflater.finish())
    except AnswerTooLarge:
        assert len(payload) * 50 > limit
    else:
        assert b"".join(out) == payload * 50


# ---------------------------------------------------------------------- through a live sidecar
class ScriptedEngine:
    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        self.stream: list[bytes] = []
        self.app = Starlette(routes=[Route("/v1/completions", self.complete, methods=["POST"])])

    async def complete(self, request: Request) -> Response:
        payload = await request.json()
        if payload.get("stream"):

            async def events() -> Iterator[bytes]:
                for piece in self.stream:
                    yield piece

            return StreamingResponse(events(), media_type="text/event-stream")
        return Response(self.body, status_code=self.status, media_type="application/json")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = ScriptedEngine()
    config = tmp_path_factory.mktemp("fuzz") / "config.json"
    config.write_text(json.dumps(CONFIG))
    with (
        serve_app(engine.app) as engine_url,
        running_sidecar(
            upstream=engine_url,
            model_config=config,
            decode_workers=0,
            rules=None,
            window_tokens=None,
            engine="vllm",
            upstream_max_bytes=1 << 16,
            request_timeout=5.0,
        ) as running,
    ):
        yield engine, running


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(engine_bodies(), st.sampled_from([200, 200, 200, 404, 500, 503]))
def test_a_live_sidecar_answers_every_generated_engine_answer(live, case, status) -> None:
    engine, (url, _) = live
    raw, _, _ = case
    engine.body, engine.status = raw, status
    answer = httpx.post(
        url + "/v1/completions", json={"prompt": "x"}, timeout=30, headers={"X-Business-Line": "code_assistant"}
    )
    assert answer.status_code in (200, 502, status)  # a 500 only where the engine said 500: never our own
    assert answer.headers["content-type"].startswith("application/json")
    document = answer.json()
    assert isinstance(document, dict)
    if answer.status_code == 200 and status == 200:
        choices = document.get("choices")
        assert "mla_watch" in document  # vLLM's field stripped (the sidecar reads vLLM's format here)
        assert not any(
            isinstance(c, dict) and "routed_experts" in c for c in (choices if isinstance(choices, list) else [])
        )
    assert httpx.get(url + "/healthz", timeout=10).status_code == 200


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.sampled_from(
            [
                b'data: {"choices": []}\n\n',
                b"data: [1]\r\n\r\n",
                b"data: [DONE]\n\n",
                'data: {"t": "\u2028"}\n\n'.encode(),
                b"\r",
                b"\n",
                b": comment\n",
                b"data: " + b"y" * 70_000,
                b"\xff\xfe",
            ]
        ),
        max_size=8,
    )
)
def test_a_live_sidecar_relays_every_generated_stream_without_a_server_error(live, pieces) -> None:
    engine, (url, _) = live
    engine.stream = pieces
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": "x", "stream": True},
        timeout=30,
        headers={"X-Business-Line": "code_assistant"},
    ) as stream:
        assert stream.status_code == 200
        text = b"".join(stream.iter_bytes())
    for line in text.split(b"\n"):  # every relayed line is one the engine sent, or mla_watch's own
        assert len(line) <= (1 << 16) + 4096
    if any(len(piece) > 1 << 16 for piece in pieces):
        assert b"upstream_too_large" in text
