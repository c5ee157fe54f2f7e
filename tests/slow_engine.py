"""A vLLM twin that also answers what the reference reader asks (``/tokenize``, ``prompt_logprobs``), slowly.

:class:`ReferenceTwin` answers a scoring request (``prompt_logprobs``: one reference prompt) after
``score_seconds``, and counts the scoring requests in flight and the most there ever were; a client's request is
answered at once unless ``client_seconds`` says otherwise. ``/health`` answers 200.
"""

from __future__ import annotations

import asyncio
import threading

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mla_watch.engines.formats import encode_vllm
from mla_watch.engines.geometry import EngineGeometry
from tests.vllm_twin import VllmTwin

__all__ = ["ReferenceTwin"]


class ReferenceTwin(VllmTwin):
    def __init__(self, geometry: EngineGeometry, *, score_seconds: float = 0.0) -> None:
        super().__init__(geometry)
        self.score_seconds = score_seconds
        self.client_seconds = 0.0
        self.scoring = 0  # scoring requests in flight now
        self.most_scoring = 0  # the most ever in flight at once
        self.scored = 0  # scoring requests answered
        self.scoring_bodies: list[dict] = []
        self._lock = threading.Lock()
        self.app.router.routes.extend(
            [Route("/tokenize", self.tokenize, methods=["POST"]), Route("/health", self.health, methods=["GET"])]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        tokens = [1, *body["prompt"].encode()[:200]]
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    async def _answer(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        if "prompt_logprobs" not in body:
            if self.client_seconds:
                await asyncio.sleep(self.client_seconds)
            return await self._relay(request, body, chat)
        with self._lock:
            self.scoring += 1
            self.most_scoring = max(self.most_scoring, self.scoring)
            self.scoring_bodies.append(body)
        try:
            await asyncio.sleep(self.score_seconds)
        finally:
            with self._lock:
                self.scoring -= 1
                self.scored += 1
        ids = list(body["prompt"])
        positions = [None, *({str(token): {"logprob": -2.0, "rank": 1}} for token in ids[1:])]
        return JSONResponse(
            {
                "id": "s",
                "object": "text_completion",
                "model": "twin",
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "finish_reason": "length",
                        "prompt_logprobs": positions,
                        "routed_experts": encode_vllm(self.routing(ids), self.geometry.num_experts),
                    }
                ],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
            }
        )

    async def _relay(self, request: Request, body: dict, chat: bool) -> Response:
        """The twin's own answer to a client's request (its body already read)."""

        async def receive() -> dict:
            import json

            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        return await VllmTwin._answer(self, Request(request.scope, receive), chat=chat)
