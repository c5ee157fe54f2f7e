"""Reference readings yield to clients beside vLLM: one reference request in flight at most, vLLM's request
priority sent only where asked for, and a reading cancelled at a stop sends nothing more (a twin of vLLM on
loopback answers them)."""

from __future__ import annotations

import json

import pytest

from mla_watch.cause.prompts import ReferenceSet
from mla_watch.cause.readers import EngineReader, ReadingAbandoned
from mla_watch.engines.geometry import parse_geometry
from mla_watch.engines.vllm_weights import VllmWeights
from tests.slow_engine import ReferenceTwin
from tests.support import serve_app

CONFIG = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1,
          "n_routed_experts": 16, "num_experts_per_tok": 4}
SET = ReferenceSet("default", 1, ("where is my order", "summarise the report", "reverse a linked list",
                                  "what is the refund policy", "translate this to french", "explain the error"))


@pytest.mark.parametrize("priority", [None, 10])
def test_one_reference_request_in_flight_with_vllms_priority_only_where_asked_for(priority: int | None) -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry, score_seconds=0.05)
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        weights.priority = priority
        try:
            reading = EngineReader(weights, geometry, rate=1000.0).read(SET)
        finally:
            weights.close()
    assert reading.tokens > 0 and twin.scored == len(SET.prompts)
    assert twin.most_scoring == 1  # the engine's batch holds one reference prompt at most: clients come first
    sent = [body.get("priority", "absent") for body in twin.scoring_bodies]
    assert sent == ["absent" if priority is None else priority] * len(SET.prompts), json.dumps(sent)


def test_a_cancelled_reader_sends_no_further_request() -> None:
    geometry = parse_geometry(CONFIG)
    twin = ReferenceTwin(geometry)
    with serve_app(twin.app) as twin.url:
        weights = VllmWeights(twin.url, geometry=geometry, timeout=30)
        reader = EngineReader(weights, geometry, rate=1000.0)
        reader.read(SET)  # tokenized once per set: what a reading sends is then only its prompts
        scored = twin.scored
        reader.cancel()
        try:
            with pytest.raises(ReadingAbandoned, match="the sidecar is stopping"):
                reader.read(SET)
        finally:
            weights.close()
    assert twin.scored == scored
