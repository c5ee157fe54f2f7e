"""A hostile or broken engine: an OpenAI-compatible server whose answers are what no engine should send.

``HostileEngine.mode`` picks the answer to ``POST /v1/completions``; each mode is one way an
engine (or whatever answers at its address) can try to grow the sidecar's memory, stall it, or
make it count routing no router produced. Used by tests/test_hardening_engine.py and
bench/engine_attacks.py. The routing it returns has the shapes pinned in
tests/test_engine_formats.py (vLLM >= 0.22: base64 ``.npy`` per choice).
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from collections.abc import AsyncIterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mla_watch.engines.formats import encode_vllm, every_layer
from mla_watch.engines.geometry import parse_geometry

__all__ = ["CONFIG", "GEOMETRY", "MODES", "HostileEngine", "ids", "vllm_routing"]

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}
GEOMETRY = parse_geometry(CONFIG)


def ids(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, len(GEOMETRY.moe_layers), 16)), axis=2)[:, :, :4]


def vllm_routing(rows: np.ndarray) -> str:
    return encode_vllm(every_layer(rows, list(GEOMETRY.moe_layers), GEOMETRY.num_hidden_layers), 16)


def gzip_bomb(inflated: int) -> bytes:
    """``inflated`` bytes of a JSON-looking answer, gzip-compressed (about 1,000 : 1), built without holding them."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    pieces = [packer.compress(b'{"choices": [{"text": "')]
    block = b"a" * (1 << 20)
    pieces += [packer.compress(block) for _ in range(inflated >> 20)]
    return b"".join([*pieces, packer.compress(b'"}]}'), packer.flush()])


class HostileEngine:
    """Answers /v1/completions as ``self.mode`` says; records what the sidecar sent it."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.bomb = gzip_bomb(400 << 20)
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.complete, methods=["POST"]),
                # SGLang's recorder endpoints: the files are written by the attacker instead
                Route("/start_expert_distribution_record", self.recorder, methods=["POST"]),
                Route("/dump_expert_distribution_record", self.recorder, methods=["POST"]),
            ]
        )
        self.nested_models = False

    async def models(self, request: Request) -> Response:
        if self.nested_models:
            return Response(b"[" * 100_000 + b"]" * 100_000, media_type="application/json")
        return JSONResponse({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})

    async def recorder(self, request: Request) -> Response:
        return Response(status_code=200)

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        return getattr(self, "answer_" + self.mode)(body)

    # -- answers --------------------------------------------------------------------------------------
    def answer_ok(self, body: dict) -> Response:
        rows = ids(9)
        return JSONResponse(
            {
                "choices": [{"index": 0, "text": "ok", "routed_experts": vllm_routing(rows)}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
            }
        )

    def answer_gzip_bomb(self, body: dict) -> Response:
        return Response(self.bomb, media_type="application/json", headers={"Content-Encoding": "gzip"})

    def answer_huge_json(self, body: dict) -> Response:
        return StreamingResponse(
            _pieces(b'{"choices": [{"text": "', b"b" * (1 << 20), 40, b'"}]}'), media_type="application/json"
        )

    def answer_huge_error(self, body: dict) -> Response:
        return StreamingResponse(
            _pieces(b"<html>", b"e" * (1 << 20), 40, b"</html>"), status_code=500, media_type="text/html"
        )

    def answer_html_error(self, body: dict) -> Response:
        return Response(b"<html><script>alert(1)</script></html>", status_code=503, media_type="text/html")

    def answer_not_json(self, body: dict) -> Response:
        return Response(b"<html>ok</html>", media_type="text/html")

    def answer_json_array(self, body: dict) -> Response:
        return JSONResponse([1, 2, 3])

    def answer_lying_npy(self, body: dict) -> Response:
        header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000, 4, 4), }"
        header += " " * (63 - (10 + len(header)) % 64) + "\n"
        lying = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(64)
        return JSONResponse(
            {"choices": [{"index": 0, "text": "still here", "routed_experts": base64.b64encode(lying).decode()}]}
        )

    def answer_all_zero(self, body: dict) -> Response:
        zeros = np.zeros((9, GEOMETRY.num_hidden_layers, 4), dtype=np.uint8)
        return JSONResponse({"choices": [{"index": 0, "text": "z", "routed_experts": encode_vllm(zeros, 16)}]})

    def answer_no_routing(self, body: dict) -> Response:
        return JSONResponse({"choices": [{"index": 0, "text": "n"}], "usage": {"prompt_tokens": 1}})

    def answer_two_choices(self, body: dict) -> Response:
        prompt = ids(6, seed=1)
        choices = [
            {"index": i, "text": "c", "routed_experts": vllm_routing(np.concatenate([prompt, ids(3, seed=2 + i)]))}
            for i in range(2)
        ]
        return JSONResponse({"choices": choices, "usage": {"prompt_tokens": 6, "completion_tokens": 8}})

    def answer_drip(self, body: dict) -> Response:
        async def drip() -> AsyncIterator[bytes]:
            for byte in b'{"choices": [{"text": "slow"}]}':
                yield bytes([byte])
                await asyncio.sleep(0.5)

        return StreamingResponse(drip(), media_type="application/json")

    def answer_stream_drip(self, body: dict) -> Response:
        async def drip() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
            for byte in b'data: {"choices": [{"index": 0, "text": "never ends"}]}':
                yield bytes([byte])
                await asyncio.sleep(0.5)

        return StreamingResponse(drip(), media_type="text/event-stream")

    def answer_big_first_chunk(self, body: dict) -> Response:
        chunk = json.dumps({"choices": [{"index": 0, "text": "w" * 300_000}]}).encode()
        return StreamingResponse(
            _pieces(b"", b"", 0, b"", [b"data: " + chunk + b"\n\n", b"data: [DONE]\n\n"]),
            media_type="text/event-stream",
        )

    def answer_endless_line(self, body: dict) -> Response:
        return StreamingResponse(_pieces(b'data: {"x": "', b"c" * (1 << 20), 60, b""), media_type="text/event-stream")

    def answer_odd_stream(self, body: dict) -> Response:
        chunk = {"id": "s", "choices": [{"index": 0, "text": "line\u2028sep\u0085next"}]}
        text = json.dumps(chunk, ensure_ascii=False).encode()  # raw U+2028 and U+0085, as pydantic writes them
        events = [b"data: [1, 2]\r\n\r\n", b"data: " + text + b"\r\n\r", b"\n", b"data: [DONE]\n\n"]
        return StreamingResponse(_pieces(b"", b"", 0, b"", events), media_type="text/event-stream")


async def _pieces(
    head: bytes, block: bytes, count: int, tail: bytes, parts: list[bytes] | None = None
) -> AsyncIterator[bytes]:
    for part in parts or [head, *([block] * count), tail]:
        yield part
        await asyncio.sleep(0)


MODES = sorted(name.removeprefix("answer_") for name in vars(HostileEngine) if name.startswith("answer_"))
