"""OpenAI response bodies and stream chunks, built from the engine's token events (pure: no I/O)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import numpy as np

# RoutingLayout moved to mla_watch.engines.routing_fields (it writes the engines' fields): re-exported until the next
# release.
from mla_watch.engines.routing_fields import RoutingLayout
from mla_watch.policy.model import Decision
from mla_watch.server.requests import GenerationRequest

__all__ = ["LocalCompletion", "RoutingLayout", "sse"]


class LocalCompletion:
    """Accumulates token events into an OpenAI response body or stream chunks."""

    def __init__(self, parsed: GenerationRequest, decision: Decision, model: str, prompt_tokens: int, n: int) -> None:
        self.parsed = parsed
        self.decision = decision
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.texts = [""] * n
        self.finish = [None] * n
        self.completion_tokens = [0] * n
        # With serve --return-routed-experts: each choice's expert ids, once the job is over.
        self.routing: list[np.ndarray] | None = None
        self.routing_layout: RoutingLayout | None = None

    @property
    def extra(self) -> dict[str, Any]:
        return self.decision.as_dict()

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.parsed.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.parsed.kind == "chat" else ""),
            "created": self.created,
            "model": self.model,
        }

    def _choice(self, index: int, text: str, finish: str | None, chunk: bool) -> dict[str, Any]:
        if self.parsed.kind == "chat":
            key = "delta" if chunk else "message"
            content = {"content": text} if chunk else {"role": "assistant", "content": text}
            return {"index": index, key: content, "finish_reason": finish, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

    def add(self, event: Any) -> dict[str, Any] | None:
        index = event.index
        if event.token_id is not None:
            self.completion_tokens[index] += 1
        self.texts[index] += event.text
        if event.finish_reason is not None:
            self.finish[index] = event.finish_reason
        if not event.text and event.finish_reason is None:
            return None
        return {**self._envelope(chunk=True), "choices": [self._choice(index, event.text, event.finish_reason, True)]}

    def first_chunk(self) -> dict[str, Any]:
        choices: list[dict[str, Any]]
        if self.parsed.kind == "chat":
            choices = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                for i in range(len(self.texts))
            ]
        else:
            choices = [
                {"index": i, "text": "", "finish_reason": None, "logprobs": None} for i in range(len(self.texts))
            ]
        return {**self._envelope(chunk=True), "choices": choices, "mla_watch": self.extra}

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def routing_chunk(self) -> dict[str, Any] | None:
        """The stream's chunk of the routing (``choices: []``), for a client that asked for it."""
        fields = self._asked_routing()
        return None if fields is None else {**self._envelope(chunk=True), "choices": [], **fields}

    def _asked_routing(self) -> dict[str, Any] | None:
        """The routing fields of a client that asked for them (``return_routed_experts``)."""
        if not self.routing or self.routing_layout is None or not self.parsed.return_routed_experts:
            return None
        return self.routing_layout.sglang_fields(self.routing)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(chunk=True), "choices": [], "usage": self.usage()}

    def body(self) -> dict[str, Any]:
        choices = [self._choice(i, text, self.finish[i], False) for i, text in enumerate(self.texts)]
        if self.routing is not None and self.routing_layout is not None:  # on every answer, asked or not
            self.routing_layout.add_to_choices(choices, self.routing)
        body = {**self._envelope(chunk=False), "choices": choices, "usage": self.usage(), "mla_watch": self.extra}
        body.update(self._asked_routing() or {})
        return body


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
