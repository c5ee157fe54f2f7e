"""The served model's routing written as the engines write theirs (``serve --return-routed-experts``).

A client of the sidecar's own model reads its routing where vLLM and SGLang put it, so that one client reads
all three: vLLM's ``routed_experts`` on every choice of a whole answer (no switch), SGLang's
``sglext.routed_experts`` (the first choice's) in a whole answer and in one stream chunk of its own after the
last token, only to a request that asked (``return_routed_experts: true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.engines.routing_ids import encode_sglang, encode_vllm, every_layer

__all__ = ["RoutingLayout"]


@dataclass(frozen=True)
class RoutingLayout:
    """Where the recorded expert routers sit: what the engines' every-layer axis needs."""

    layers: list[int]  # the decoder layer of each expert router, in recording order
    num_hidden_layers: int
    num_experts: int

    def spread(self, ids: np.ndarray) -> np.ndarray:
        return every_layer(ids, self.layers, self.num_hidden_layers)

    def add_to_choices(self, choices: list[dict[str, Any]], routing: list[np.ndarray]) -> None:
        """vLLM's field on each choice of a whole answer: every answer carries it."""
        for choice, ids in zip(choices, routing, strict=True):
            choice["routed_experts"] = encode_vllm(self.spread(ids), self.num_experts)

    def sglang_fields(self, routing: list[np.ndarray]) -> dict[str, Any]:
        """SGLang's fields of an answer, or of its stream's routing chunk: the first choice's routing."""
        return {"sglext": {"routed_experts": encode_sglang(self.spread(routing[0]))}}
