"""A vLLM twin on loopback: vLLM's answers, streams and routing, with every choice a function of the tokens.

Shapes follow vLLM 0.32's own source (the real engine runs in tests/test_real_vllm_*.py):

* a non-streamed answer: ``choices[i].routed_experts``, base64 of a ``.npy`` ``[prompt + generated - 1,
  num_hidden_layers, top_k]`` (vllm/v1/engine/output_processor.py), cut by ``routed_experts_prompt_start``;
  with ``return_token_ids``, a choice's ``token_ids`` and the prompt's ``prompt_token_ids`` (at the top for
  chat, per choice for completions: entrypoints/openai/chat_completion/protocol.py, completion/protocol.py);
* with :attr:`VllmTwin.stream_routing`, a stream's terminal chunk of each choice carries that choice's
  ``routed_experts`` as the unstreamed answer does (vLLM RFC #56745's proposal; the ``/inference/v1/generate``
  stream's ``GenerateResponseStreamChoice.routed_experts``, entrypoints/serve/disagg/protocol.py and serving.py,
  has the same field and format);
* a stream with ``return_token_ids``: chat's first chunk of each choice carries the top-level
  ``prompt_token_ids`` and a ``role`` delta; completions carry ``prompt_token_ids`` on a choice's first
  chunk; every chunk carries that step's ``token_ids`` (entrypoints/openai/chat_completion/serving.py,
  entrypoints/openai/completion/serving.py). A chat step that makes no text is sent (``delta: {}``) only
  because ids were asked for.

The routing of the token at position ``p`` with id ``t`` is :func:`routing_row`: a replay of the same
tokens gets the same rows, so streamed and unstreamed requests count exactly the same.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mla_watch.engines.formats import encode_vllm, every_layer
from mla_watch.engines.geometry import EngineGeometry

SILENT_TOKEN = 7  # a generated token that makes no text: chat sends its step only when ids were asked for


def routing_row(token: int, position: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """``[layers, top_k]`` distinct expert ids for one token, a function of its id and position."""
    stride = experts // top_k
    return np.array(
        [[(token * 3 + position + layer + j * stride) % experts for j in range(top_k)] for layer in range(layers)]
    )


class VllmTwin:
    """Answers /v1/completions and /v1/chat/completions as vLLM does with --enable-return-routed-experts."""

    def __init__(self, geometry: EngineGeometry) -> None:
        self.geometry = geometry
        self.bodies: list[dict] = []
        self.replay_status = 200  # what a replay (a prompt of token ids) is answered with
        self.url = ""  # where it listens, once it does
        self.step_seconds = 0.0  # between two chunks of a stream
        # Routing on the terminal chunk of each choice of an OpenAI stream, as vLLM's RFC #56745 proposes: the
        # field and format of the unstreamed choice (and of GenerateResponseStreamChoice.routed_experts, which
        # vllm/entrypoints/serve/disagg/serving.py sets from output.routed_experts in its stream generator).
        self.stream_routing = False
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    @property
    def replays(self) -> list[dict]:
        return [body for body in self.bodies if isinstance(body.get("prompt"), list)]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "twin", "object": "model", "owned_by": "vllm"}]})

    def tokens_of(self, body: dict, chat: bool) -> list[int]:
        if chat:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
            return list(text.encode())
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else list(prompt.encode())

    def generated(self, prompt: list[int], choice: int, count: int) -> list[int]:
        out = [(sum(prompt) + 11 * step + 13 * choice) % 90 + 33 for step in range(count)]  # ASCII text
        if count > 2:
            out[1] = SILENT_TOKEN
        return out

    def routing(self, tokens: list[int]) -> np.ndarray:
        g = self.geometry
        rows = np.stack([routing_row(t, p, len(g.moe_layers), g.top_k, g.num_experts) for p, t in enumerate(tokens)])
        return every_layer(rows, list(g.moe_layers), g.num_hidden_layers)

    async def completion(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def _answer(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if isinstance(body.get("prompt"), list) and self.replay_status != 200:
            return JSONResponse(
                {"error": {"message": "replays refused", "type": "server_error"}}, status_code=self.replay_status
            )
        prompt = self.tokens_of(body, chat)
        n = body.get("n", 1)
        count = body.get("max_tokens") or body.get("max_completion_tokens") or 4
        outputs = [self.generated(prompt, i, count) for i in range(n)]
        if body.get("stream"):
            return StreamingResponse(self._stream(body, chat, prompt, outputs), media_type="text/event-stream")
        start = body.get("routed_experts_prompt_start", 0)
        choices = []
        for index, out in enumerate(outputs):
            routing = self.routing(prompt + out[:-1])[start:]
            text = bytes(t for t in out if t != SILENT_TOKEN).decode()
            content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            choices.append(
                {
                    "index": index,
                    **content,
                    "finish_reason": "length",
                    "routed_experts": encode_vllm(routing, self.geometry.num_experts),
                }
            )
            if body.get("return_token_ids") is True:  # chat: the prompt's once, at the top; completions: per choice
                choices[-1]["token_ids"] = out
                if not chat:
                    choices[-1]["prompt_token_ids"] = prompt
        answer = {
            "id": "x",
            "object": "chat.completion" if chat else "text_completion",
            "model": "twin",
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(map(len, outputs))},
        }
        if chat and body.get("return_token_ids") is True:
            answer["prompt_token_ids"] = prompt
        return JSONResponse(answer)

    async def _stream(
        self, body: dict, chat: bool, prompt: list[int], outputs: list[list[int]]
    ) -> AsyncIterator[bytes]:
        ids = body.get("return_token_ids") is True
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(chunk: dict) -> bytes:
            return (
                b"data: "
                + json.dumps({"id": "x", "object": kind, "model": "twin", **chunk}, separators=(",", ":")).encode()
                + b"\n\n"
            )

        if chat:  # the first chunk of each choice: its role (and the prompt's ids)
            for index in range(len(outputs)):
                first = {
                    "choices": [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                }
                if ids:
                    first["prompt_token_ids"] = prompt
                yield event(first)
        for step in range(max(map(len, outputs))):
            for index, out in enumerate(outputs):
                if step >= len(out):
                    continue
                token, last = out[step], step == len(out) - 1
                text = "" if token == SILENT_TOKEN else chr(token)
                if chat:
                    if not text and not last and not ids:
                        continue  # vLLM skips a step with nothing to say, unless ids were asked for
                    choice = {
                        "index": index,
                        "delta": {"content": text} if text else {},
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                else:
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                    if ids and step == 0:
                        choice["prompt_token_ids"] = prompt
                if ids:
                    choice["token_ids"] = [token]
                if last and self.stream_routing:
                    routing = self.routing(prompt + out[:-1])[body.get("routed_experts_prompt_start", 0) :]
                    choice["routed_experts"] = encode_vllm(routing, self.geometry.num_experts)
                yield event({"choices": [choice]})
                if self.step_seconds:
                    await asyncio.sleep(self.step_seconds)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event(
                {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(map(len, outputs))}}
            )
        yield b"data: [DONE]\n\n"
