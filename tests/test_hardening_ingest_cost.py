"""Finding 17: ingestion costs what a delta carries. A megabyte of empty deltas on a 262,144-slot router allocates
one dense array, not one per delta, and sparse deltas sum exactly, by parse and over HTTP."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import numpy as np
import pytest

from harness.support import running_sidecar
from mla_watch.routing.ingest import IngestError, IngestLimits, parse_snapshot

UPSTREAM = "http://127.0.0.1:9"  # nothing listens: a proxy sidecar that loads no model
INGEST = "ingest-cost-token-0123456789"
SLOTS = 262_144  # IngestLimits' default max_slots: DeepSeek-V3.2's indexer scale
INDEXER = {"name": "model.layers.3.self_attn.indexer", "layer": 3, "kind": "indexer", "num_slots": SLOTS, "top_k": 2048}
GATE = {"name": "model.layers.3.mlp.gate", "layer": 3, "kind": "expert", "num_slots": 256, "top_k": 8}
DENSE_BYTES = SLOTS * 8  # one router and line's int64 counts
BODY_BYTES = 990_000  # under serve's default --max-body-bytes (1,000,000)


def empty_delta(router: dict, line: str = "code") -> dict:
    return {"router": router["name"], "business_line": line, "slots": [], "counts": []}


def empty_deltas(size: int, router: dict = INDEXER) -> list[dict]:
    """As many empty deltas as make about ``size`` bytes of JSON."""
    return [empty_delta(router)] * (size // (len(json.dumps(empty_delta(router))) + 2))


def real_delta(rng: np.random.Generator, router: dict, line: str, tokens: int) -> dict:
    slots = np.sort(rng.choice(router["num_slots"], size=router["top_k"] // 2, replace=False))
    counts = rng.multinomial(tokens * router["top_k"] // 2, np.full(slots.size, 1 / slots.size))
    return {
        "router": router["name"],
        "business_line": line,
        "slots": slots.tolist(),
        "counts": counts.tolist(),
        "tokens": tokens,
        "choice_selections": int(counts.sum()),
        "local_selections": int(counts.sum()) // 3,
    }


def mixed_body(seed: int = 0) -> dict:
    """Real deltas of two routers and two lines, slots repeating across deltas, among empty ones."""
    rng = np.random.default_rng(seed)
    deltas: list[dict] = []
    for index in range(60):
        router, line = (INDEXER, GATE)[index % 2], ("code", "chat")[index // 2 % 2]
        deltas.extend([empty_delta(router, line)] * 20)
        deltas.append(real_delta(rng, router, line, tokens=int(rng.integers(1, 8))))
    return {"source": "worker-1", "routers": [INDEXER, GATE], "deltas": deltas}


def expected_sums(body: dict) -> dict[tuple[str, str], tuple[np.ndarray, int, int, int]]:
    """Each (router, line)'s counts and totals, summed densely, delta by delta: the plain reading of the wire."""
    slots_of = {router["name"]: router["num_slots"] for router in body["routers"]}
    sums: dict[tuple[str, str], list] = {}
    for delta in body["deltas"]:
        key = (delta["router"], delta["business_line"])
        counts, tokens, local, choice = sums.setdefault(key, [np.zeros(slots_of[key[0]], dtype=np.int64), 0, 0, 0])
        counts[delta["slots"]] += np.asarray(delta["counts"], dtype=np.int64)
        sums[key] = [
            counts,
            tokens + delta.get("tokens", 0),
            local + delta.get("local_selections", 0),
            choice + delta.get("choice_selections", 0),
        ]
    return {key: tuple(value) for key, value in sums.items()}


def test_a_megabyte_of_empty_deltas_allocates_one_dense_array() -> None:
    body = {"source": "worker-1", "routers": [INDEXER], "deltas": empty_deltas(BODY_BYTES)}
    assert len(json.dumps(body)) > 0.95 * BODY_BYTES and len(body["deltas"]) > 9_000
    tracemalloc.start()
    try:
        snapshot = parse_snapshot(body, IngestLimits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One 2 MiB array for the (router, line). Dense per delta, a delta's array and the sum it was merged into
    # were alive at once besides it: 6 MiB at the peak, and 2 MiB allocated and filled 9,000 times.
    assert peak < DENSE_BYTES + 2**20, f"parsing allocated {peak} bytes at its peak"
    (delta,) = snapshot.deltas.values()
    assert delta.counts.shape == (SLOTS,) and not delta.counts.any() and delta.tokens == 0


def test_sparse_deltas_among_empty_ones_sum_exactly() -> None:
    body = mixed_body()
    snapshot = parse_snapshot(body, IngestLimits())
    expected = expected_sums(body)
    assert set(snapshot.deltas) == set(expected)
    for key, (counts, tokens, local, choice) in expected.items():
        merged = snapshot.deltas[key]
        assert merged.counts.dtype == np.int64 and np.array_equal(merged.counts, counts), key
        assert (merged.tokens, merged.local_selections, merged.choice_selections) == (tokens, local, choice)
        assert counts.any()  # every key got real counts: the test sums something


def test_empty_deltas_still_open_their_window_and_keep_every_check() -> None:
    only_empty = parse_snapshot(
        {"source": "w", "routers": [GATE], "deltas": [empty_delta(GATE, "chat")]}, IngestLimits()
    )
    assert list(only_empty.deltas) == [(GATE["name"], "chat")]
    empty_then_bad = [empty_delta(GATE)] * 3 + [{**empty_delta(GATE), "slots": [1], "counts": []}]
    with pytest.raises(IngestError, match="slots has 1 entries and counts 0") as refused:
        parse_snapshot({"source": "w", "routers": [GATE], "deltas": empty_then_bad}, IngestLimits())
    assert refused.value.field == "deltas[3].counts"
    with pytest.raises(IngestError, match="expected a list of integers, got NoneType"):
        parse_snapshot(
            {"source": "w", "routers": [GATE], "deltas": [{**empty_delta(GATE), "slots": None}]}, IngestLimits()
        )


def test_ingestion_over_http_counts_a_mix_exactly() -> None:
    body = mixed_body(seed=1)
    body["deltas"].extend(empty_deltas(BODY_BYTES - len(json.dumps(body)) - 1000, GATE))
    content = json.dumps(body).encode()
    assert len(content) < BODY_BYTES
    expected = expected_sums(body)
    with running_sidecar(upstream=UPSTREAM, ingest_token=INGEST) as (url, _):
        answer = httpx.post(
            url + "/v1/routing/ingest",
            content=content,
            timeout=60,
            headers={"Authorization": f"Bearer {INGEST}", "Content-Type": "application/json"},
        )
        assert answer.status_code == 200, answer.text
        for line in ("code", "chat"):
            routers = httpx.get(url + "/v1/routing", params={"business_line": line}, timeout=30).json()["routers"]
            tokens = {router["name"]: router["tokens"] for router in routers}
            assert tokens == {f"worker-1/{name}": expected[(name, line)][1] for name in (INDEXER["name"], GATE["name"])}
