"""Routing by context position: buckets, exact per-position counts on the real model, the shipped long-context
rule and the recommended max_prompt_tokens on the bundled model (trained on 256-token sequences)."""

from __future__ import annotations

import json
import urllib.request
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

import mla_watch
from harness.helpers import FakeClock
from harness.support import get_metrics, long_texts, metric_value, running_sidecar, wait_until
from mla_watch.alerting.alert_engine import AlertEngine
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.cli import main
from mla_watch.probe.position_counting import DEFAULT_POSITION_ROWS
from mla_watch.routing.positions import SHORT_PROMPTS, PositionBuckets, PositionCounts, profile
from mla_watch.routing.routers import RouterInfo
from mla_watch.shipped import __file__ as shipped_init

SHIPPED_RULES = Path(shipped_init).parent / "rules"


@cache
def _bundled() -> tuple[torch.nn.Module, object]:
    return mla_watch.load_model("bundled", device="cpu")


def _long_texts(domain: str, count: int, tokens: int, seed: int) -> list[str]:
    return long_texts(_bundled()[1], domain, count, tokens, seed)


def _ids(text: str, limit: int) -> list[int]:
    _, tokenizer = _bundled()
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]][:limit]


# --------------------------------------------------------------------------- buckets and profiles (no model)
def test_buckets_are_powers_of_two_up_to_the_context_and_one_past_it() -> None:
    buckets = PositionBuckets(512)
    assert buckets.labels == ["0-63", "64-127", "128-255", "256-511", "512+"]
    assert buckets.bucket_of(np.array([0, 63, 64, 127, 128, 511, 512, 10_000])).tolist() == [0, 0, 1, 1, 2, 3, 4, 4]
    assert PositionBuckets(163_840).labels[-2:] == ["131072-163839", "163840+"]
    assert PositionBuckets(32).labels == ["0-31", "32+"]
    with pytest.raises(ValueError, match="context_length = 0: expected an integer >= 1"):
        PositionBuckets(0)


def test_the_edge_is_the_first_bucket_that_leaves_the_pooled_in_range_routing() -> None:
    buckets = PositionBuckets(512)
    rng = np.random.default_rng(0)
    healthy = rng.dirichlet(np.ones(64) * 50)
    shifted = healthy.copy()
    shifted[:8] *= 3
    shifted /= shifted.sum()
    counts = np.stack(
        [rng.multinomial(6000 * 6, p) for p in (healthy, healthy, healthy, shifted)] + [np.zeros(64, dtype=np.int64)]
    )
    found = profile(counts, buckets, top_k=6)
    assert [bucket.judged for bucket in found.buckets] == [False, True, True, True, False]
    assert [bucket.in_range for bucket in found.buckets] == [False, True, True, False, False]
    assert found.edge == "256-511" and found.edge_start == 256
    assert found.drift == found.buckets[3].js_divergence > found.drift_bits
    assert found.buckets[2].js_divergence < 0.005  # same routing: sampling noise only
    # Without the shifted bucket nothing leaves: the drift is the largest in-range divergence, under the threshold.
    counts[3] = rng.multinomial(6000 * 6, healthy)
    calm = profile(counts, buckets, top_k=6)
    assert calm.edge is None and calm.drift is not None and calm.drift < calm.drift_bits


def test_the_row_wise_divergence_and_entropy_equal_the_scalar_ones() -> None:
    from mla_watch.routing.stats import entropy_bits, entropy_rows, js_divergence_bits, js_divergence_rows

    rng = np.random.default_rng(1)
    counts, baselines = rng.integers(0, 40, (6, 64)), rng.integers(0, 40, (6, 64))
    counts[2, :60] = 0  # a sparse row
    assert np.allclose(
        js_divergence_rows(counts, baselines),
        [js_divergence_bits(row, base) for row, base in zip(counts, baselines, strict=True)],
    )
    assert np.allclose(entropy_rows(counts), [entropy_bits(row) for row in counts])
    empty = np.zeros((1, 64), dtype=np.int64)
    assert np.isnan(js_divergence_rows(empty, baselines[:1])[0]) and entropy_rows(empty)[0] == 0.0


def test_position_counts_forget_by_half_life_and_refuse_bad_shapes() -> None:
    clock = FakeClock(0.0)
    router = RouterInfo("gate", 1, "expert", 4, 2)
    counts = PositionCounts([router], 128, half_life_seconds=60.0, clock=clock)
    assert len(counts.buckets) == 3
    counts.add("gate", "a", np.full((3, 4), 8))
    clock.advance(125.0)  # two half-lives
    assert counts.counts("gate", "a").tolist() == [[2] * 4] * 3
    with pytest.raises(ValueError, match=r"position counts of 'gate': shape \[2, 4\], expected \[3, 4\]"):
        counts.add("gate", "a", np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(KeyError, match="router 'other' is not one of the 1 expert routers"):
        counts.add("other", "a", np.zeros((3, 4), dtype=np.int64))


# --------------------------------------------------------------------------- the real model, real hooks
def test_with_prompt_lengths_and_clients_only_the_prompts_tokens_count_each_clients_apart() -> None:
    """attribute(clients=..., prompt_tokens=...): the decode steps are not counted by position, the prompt's tokens
    are, under each row's client; a prompt within the first bucket counts as short prompts; each prompt given counts
    once towards the line's prompts by length."""
    model, tokenizer = _bundled()
    probe = mla_watch.attach(model, count_positions=True, flush_every=4)
    try:
        texts = _long_texts("doc_summary", 2, 200, seed=3)
        rows = [_ids(texts[0], 200), _ids(texts[1], 40)]
        width = max(len(row) for row in rows)
        ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        with (
            torch.no_grad(),
            probe.attribute(["a", "a"], clients=["writer", "asker"], prompt_tokens=[len(rows[0]), len(rows[1])]),
            probe.record_routing() as recording,
        ):
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=9,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        probe.collect()
        assert probe.positions is not None
        buckets = probe.positions.buckets
        experts = [info for info in probe.routers if info.kind == "expert"]
        for row, client in ((0, "writer"), (1, SHORT_PROMPTS)):
            length = len(rows[row])
            real = recording.rows(row)[width - length : width]  # the prompt's tokens, no padding, no decode step
            for index, info in enumerate(experts):
                expected = np.zeros((len(buckets), info.num_slots), dtype=np.int64)
                np.add.at(
                    expected,
                    (np.repeat(buckets.bucket_of(np.arange(length)), real.shape[2]), real[:, index, :].reshape(-1)),
                    1,
                )
                assert np.array_equal(probe.positions.counts(info.name, "a", client), expected), (info.name, client)
        assert probe.positions.counts(experts[0].name, "a", "asker").sum() == 0  # its prompt was short
        assert probe.positions.prompts("a").tolist() == [1, 0, 1, 0, 0]  # 40 tokens: bucket 0; 200: 128-255
    finally:
        probe.detach()


def test_per_position_counts_agree_exactly_with_an_independent_count() -> None:
    """Prefill and KV-cached decode steps of a batch, one row left-padded: each token counted in the bucket of its
    index among its sequence's real tokens, padding never."""
    model, tokenizer = _bundled()
    probe = mla_watch.attach(model, count_positions=True, flush_every=4)
    try:
        texts = _long_texts("doc_summary", 2, 200, seed=3)
        rows = [_ids(texts[0], 200), _ids(texts[1], 150)]
        width = max(len(row) for row in rows)
        ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        with torch.no_grad(), probe.attribute(["a", "b"]), probe.record_routing() as recording:
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=9,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        probe.collect()
        assert probe.positions is not None
        buckets = probe.positions.buckets
        experts = [info for info in probe.routers if info.kind == "expert"]
        for row, (line, length) in enumerate((("a", len(rows[0])), ("b", len(rows[1])))):
            picks = recording.rows(row)  # [prompt width + 8 decode steps, routers, top_k]
            padding = width - length
            real = picks[padding:]  # the left padding is no token
            positions = np.arange(real.shape[0])
            for index, info in enumerate(experts):
                expected = np.zeros((len(buckets), info.num_slots), dtype=np.int64)
                np.add.at(
                    expected, (np.repeat(buckets.bucket_of(positions), real.shape[2]), real[:, index, :].reshape(-1)), 1
                )
                assert np.array_equal(probe.positions.counts(info.name, line), expected), (info.name, line)
            assert positions[-1] >= 128  # the decode steps crossed into the third bucket for both rows
        assert probe.position_bytes == DEFAULT_POSITION_ROWS * 3 * 5 * 64 * 8  # rows x routers x buckets x slots
        # A router called outside the model's forward pass: counted, but no position is known for it.
        gate = experts[0]
        before = probe.positions.counts(gate.name).sum()
        with torch.no_grad():
            model.get_submodule(gate.name)(torch.randn(1, 7, model.config.hidden_size))
        probe.collect()
        assert probe.counts()[gate.name].sum() >= 7 * gate.top_k
        assert probe.positions.counts(gate.name).sum() == before
    finally:
        probe.detach()


def _count(probe: mla_watch.Probe, texts: list[str], line: str, limit: int, clients: int = 3) -> None:
    """Each text as one prompt, sent in turn by ``clients`` clients."""
    model, _ = _bundled()
    for index, text in enumerate(texts):
        ids = _ids(text, limit)
        with torch.no_grad(), probe.attribute(line, clients=f"client-{index % clients}", prompt_tokens=len(ids)):
            model(input_ids=torch.tensor([ids]))


@pytest.mark.slow
def test_long_prompts_fire_the_shipped_rule_naming_256_511_and_in_range_prompts_do_not() -> None:
    model, _ = _bundled()
    clock = FakeClock()
    probe = mla_watch.attach(model, count_positions=True, window_tokens=None, clock=clock)
    engine = AlertEngine(load_rules_dir(SHIPPED_RULES, environ={}), clock=clock)
    try:
        _count(probe, _long_texts("customer_service", 24, 520, seed=1), "long", 512)
        _count(probe, _long_texts("customer_service", 32, 255, seed=2), "short", 256)
        for _ in range(2):  # pending, then firing once `for: 5m` has passed
            engine.evaluate([record for line in ("long", "short") for record in probe.router_stats(line)])
            clock.advance(301.0)
        fired = [alert for alert in engine.alerts() if alert.rule == "LongContextDrift"]
        assert fired and {alert.labels["business_line"] for alert in fired} == {"long"}
        assert all(alert.state == "firing" for alert in fired)
        assert all("(from bucket 256-511)" in alert.annotations["summary"] for alert in fired)
        # What it compared, and who sent the tokens: every client's own, and the departure held across them.
        compared = "each client's prompt tokens at 256-511 against its own at 64-255"
        assert all(
            compared in alert.annotations["description"] and "client-0 33%" in alert.annotations["description"]
            for alert in fired
        )
        short = {
            record.router.name: record.stats for record in probe.router_stats("short") if record.router.kind == "expert"
        }
        assert all(stats.long_context_edge is None for stats in short.values())
        assert all(stats.long_context_drift is not None for stats in short.values())  # judged, and in range
    finally:
        probe.detach()


@pytest.mark.slow
def test_context_recommends_at_most_256_prompt_tokens_from_a_dataset(tmp_path: Path) -> None:
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": text}) + "\n" for text in _long_texts("doc_summary", 24, 520, seed=4))
    )
    out = tmp_path / "context.json"
    with out.open("w") as handle, _stdout(handle):
        assert main(["context", "--prompts", str(prompts), "--business-line", "doc_summary", "--json"]) == 0
    found = json.loads(out.read_text())["recommendation"]
    assert found["edge"] == "256-511" and found["max_prompt_tokens"] == 256


def _post(url: str, line: str, client: str, body: dict) -> None:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Business-Line": line, "X-Client-Id": client},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200


def _routing(url: str, line: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/routing?business_line={line}", timeout=30) as answer:
        return json.loads(answer.read())


@pytest.mark.slow
def test_position_findings_hold_across_clients_and_are_not_content(capsys: pytest.CaptureFixture) -> None:
    """One sidecar, three lines of traffic: one client floods customer_service with a word repeated to 180 tokens
    (inside the trained 256) beside three clients' short questions; three clients send doc_summary's documents of
    81-109 tokens and have up to 96 tokens of summary generated after them; three clients send code_assistant
    documents of 470 tokens (past the trained 256). Only the last leaves in-range routing, and only it draws a
    cap, naming its clients and the share of the line's prompts the cap would refuse."""
    _, tokenizer = _bundled()
    word = tokenizer("parcel", add_special_tokens=False)["input_ids"]
    flood = tokenizer.decode((word * 200)[:180])
    documents = [text for length in (81, 90, 100, 109) for text in _long_texts("doc_summary", 6, length, seed=length)]
    long_documents = _long_texts("code", 24, 470, seed=5)
    with running_sidecar(position_metrics=True, alert_interval=0.5) as (url, _):
        for index in range(32):
            _post(url, "customer_service", "flood-1", {"prompt": flood, "max_tokens": 4})
            for client in ("alice", "bob", "carol"):
                _post(url, "customer_service", client, {"prompt": f"Where is my order {index}?", "max_tokens": 4})
        for index, text in enumerate(documents):
            _post(
                url,
                "doc_summary",
                f"reader-{index % 3}",
                {"prompt": f"Summarize: {text}", "max_tokens": 96, "seed": index},
            )
        for index, text in enumerate(long_documents):
            _post(url, "code_assistant", f"team-{index % 3}", {"prompt": text, "max_tokens": 4})

        for line in ("customer_service", "doc_summary"):
            routing = _routing(url, line)
            assert {router["edge"] for router in routing["positions"]["routers"]} == {None}, (line, routing)
            assert all(
                record["long_context_edge"] is None for record in routing["routers"] if record["kind"] == "expert"
            )
        flooded = _routing(url, "customer_service")["positions"]
        assert {client["client"] for router in flooded["routers"] for client in router["clients"]} == {"flood-1"}
        summaries = _routing(url, "doc_summary")["positions"]
        assert all(bucket["tokens"] == 0 for router in summaries["routers"] for bucket in router["buckets"][2:]), (
            "a summary's generated tokens were counted by position"
        )
        routing = _routing(url, "code_assistant")
        edges = {router["name"]: router for router in routing["positions"]["routers"]}
        assert "256-511" in {router["edge"] for router in edges.values()}
        edge = next(router for router in edges.values() if router["edge"] == "256-511")
        assert len(edge["held_by"]) >= 2 and set(edge["held_by"]) <= {"team-0", "team-1", "team-2"}, edge
        assert edge["compared"].startswith("each client's")
        assert {record["long_context_edge"] for record in routing["routers"] if record["kind"] == "expert"} == {
            router["edge"] for router in edges.values()
        }
        metrics = get_metrics(url)
        assert (
            metric_value(
                metrics,
                "mla_watch_routing_position_tokens",
                router=edge["name"],
                layer=str(edge["layer"]),
                business_line="code_assistant",
                position_bucket="256-511",
            )
            > 0
        )
        # The footprint of a batch, from every 4th request's decode tokens (three lines: apart reads less than mixed).
        for size in ("1", "8", "32", "64"):
            footprint = metric_value(
                metrics, "mla_watch_batch_expert_footprint", business_line="customer_service", batch_size=size
            )
            assert 6 <= footprint <= 64 and (size != "1" or footprint == 6)
            assert 0 < metric_value(metrics, "mla_watch_batch_footprint_ratio", batch_size=size) <= 1.0

        def long_context_alerts() -> list[dict]:
            with urllib.request.urlopen(f"{url}/v1/alerts", timeout=30) as answer:
                return [alert for alert in json.loads(answer.read())["alerts"] if alert["rule"] == "LongContextDrift"]

        assert wait_until(
            lambda: any(alert["labels"]["business_line"] == "code_assistant" for alert in long_context_alerts()),
            timeout=30,
        )
        alerts = long_context_alerts()
        assert {alert["labels"]["business_line"] for alert in alerts} == {"code_assistant"}, alerts
        assert all("team-" in alert["annotations"]["description"] for alert in alerts)

        capsys.readouterr()
        assert main(["context", "--url", url, "--business-line", "code_assistant"]) == 0
        printed = capsys.readouterr().out
        assert "recommended max_prompt_tokens: 256" in printed and "256-511" in printed
        assert "across the clients team-" in printed and "of the line's last 24 prompts" in printed, printed
        assert main(["context", "--url", url, "--business-line", "customer_service"]) == 0
        printed = capsys.readouterr().out
        assert "nothing to recommend" in printed and "recommended max_prompt_tokens" not in printed
        assert main(["context", "--url", url, "--business-line", "doc_summary", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["recommendation"]["max_prompt_tokens"] is None
        with pytest.raises(SystemExit) as stopped:
            main(["context", "--url", url])
        assert stopped.value.code == 2 and "--url needs --business-line" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["context", "--url", "file:///etc/passwd", "--business-line", "a"])
        assert "expected the sidecar's http:// or https:// base URL" in capsys.readouterr().err


class _stdout:
    """Print into ``handle`` inside the block."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def __enter__(self) -> None:
        import sys

        self._saved, sys.stdout = sys.stdout, self._handle

    def __exit__(self, *exc: object) -> None:
        import sys

        sys.stdout = self._saved


# --------------------------------------------------------------------------- beside an engine: vLLM's rows
def test_vllm_rows_are_counted_per_position_exactly_the_prompts_once_and_no_generated_row() -> None:
    from prometheus_client import CollectorRegistry

    from mla_watch.engines.formats import RoutingPlan, decode_response, encode_vllm, every_layer
    from mla_watch.engines.geometry import parse_geometry
    from mla_watch.engines.watch import EngineMetrics, EngineRouting

    geometry = parse_geometry(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 5,
            "first_k_dense_replace": 2,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "max_position_embeddings": 128,
        }
    )
    assert geometry.context_length == 128
    routing = EngineRouting("vllm", geometry, EngineMetrics(CollectorRegistry()))
    assert routing.position_edges == (64, 128)
    rng = np.random.default_rng(7)

    def ids(tokens: int) -> np.ndarray:
        return np.stack(
            [[rng.choice(16, 4, replace=False) for _ in geometry.moe_layers] for _ in range(tokens)]
        ).astype(np.int64)

    prompt, first, second = ids(100), ids(40), ids(3)  # the first choice runs past the context length (128)
    body = {
        "choices": [
            {
                "index": index,
                "text": "x",
                "routed_experts": encode_vllm(
                    every_layer(np.concatenate([prompt, generated]), list(geometry.moe_layers), 5), 16
                ),
            }
            for index, generated in enumerate((first, second))
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 43, "total_tokens": 143},
    }
    plan = RoutingPlan("vllm", geometry, keep=False, position_edges=routing.position_edges)
    decoded = decode_response(plan, json.dumps(body).encode())
    assert decoded.error is None and decoded.tokens == 143
    expected = np.zeros((3, 3, 16), dtype=np.int64)  # [MoE layers, buckets 0-63 / 64-127 / 128+, experts]
    for offset, token in enumerate(prompt):  # the prompt's rows, once: no choice's generated row
        for layer, chosen in enumerate(token):
            expected[layer, offset // 64, chosen] += 1
    assert np.array_equal(decoded.position_counts, expected) and decoded.prompt_tokens == 100
    assert decoded.position_counts.sum() * 143 == decoded.counts.sum() * 100  # the windows count every row
    routing.count("code", decoded, client="writer")
    routing.collect()
    assert routing.positions is not None
    for layer, name in enumerate(geometry.router_names):
        assert np.array_equal(routing.positions.counts(name, "code", "writer"), expected[layer])
    assert routing.positions.prompts("code").tolist() == [0, 1, 0]  # one prompt of 100 tokens: 64-127
    # Without a context length in the config, nothing is counted by position.
    unknown = parse_geometry(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 5,
            "first_k_dense_replace": 2,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
        }
    )
    assert EngineRouting("vllm", unknown, EngineMetrics(CollectorRegistry())).positions is None
    # Each choice's decode rows (past the 100-token prompt) are kept for the footprint of a batch, 16 at most.
    footprint_plan = RoutingPlan("vllm", geometry, keep=False, footprint_tokens=16)
    rows = decode_response(footprint_plan, json.dumps(body).encode()).footprint_rows
    assert [kept.shape for kept in rows] == [(16, 3, 4), (3, 3, 4)]
    assert np.array_equal(rows[0][0], first[0]) and np.array_equal(rows[0][-1], first[-1])
    assert np.array_equal(rows[1], second) and rows[1].dtype == np.uint16
    routing.count("code", decode_response(footprint_plan, json.dumps(body).encode()))
    assert routing.footprint.table((1, 2), draws=8).requests == {"code": 2}
    # An answer that does not say its prompt's length is not counted by position (nor taken for a prompt).
    del body["usage"]
    assert decode_response(plan, json.dumps(body).encode()).position_counts is None


def test_the_history_file_keeps_its_width_and_a_trend_rule_cannot_watch_long_context_drift(tmp_path: Path) -> None:
    from mla_watch.alerting.rules import load_rules_file
    from mla_watch.alerting.vocabulary import RuleError
    from mla_watch.history.store import VALUES

    # The history's points are packed arrays of these values: one more would make every existing file unreadable.
    assert VALUES == (
        "entropy_bits",
        "normalized_entropy",
        "bits_below_ceiling",
        "max_violation",
        "dead_slots",
        "js_divergence",
        "locality",
        "tokens",
        "too_small",
    )
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - alert: X\n    metric: long_context_drift\n    predict: {over: 6h, ahead: 1d}\n    above: 0.05\n"
    )
    with pytest.raises(RuleError, match=r"metric = 'long_context_drift': expected a metric the routing history keeps"):
        load_rules_file(rules, environ={})
