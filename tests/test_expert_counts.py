"""Opt-in per-expert window counts (serve --export-expert-counts): exactly each window's counts, from the same
snapshot as the routing gauges, within their budget; a router shard's series alone on GET /metrics?shard=K/N."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness.support import get_metrics, running_sidecar
from mla_watch.cli import build_parser
from mla_watch.routing.ingest import snapshot_body
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.series import (
    EXPERT_OVERFLOW_SELECTIONS,
    EXPERT_SERIES,
    EXPERT_SERIES_BUDGET,
    EXPERT_WINDOW_SELECTIONS,
    EXPERT_WINDOW_TOKENS,
    routing_gauge,
)
from mla_watch.routing.stats import entropy_bits
from mla_watch.routing.windows import RouterWindows, take_snapshot
from mla_watch.server.config import ServerConfig, ServerConfigError
from mla_watch.server.expert_counts import ExpertCounts, ExpertSelection
from mla_watch.server.exposition import exposition
from mla_watch.server.metrics import RoutingCollector
from tests.client import post

CODE = {"X-Business-Line": "code_assistant", "X-Task": "code"}
SERVICE = {"X-Business-Line": "customer_service"}
INGEST_TOKEN = "expert-counts-ingest-token-0123"

Key = tuple[str, str]  # (router, business line)


def samples(text: str, name: str) -> list:
    return [
        sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name
    ]


def exported(text: str) -> tuple[dict[Key, dict[int, float]], dict[Key, float]]:
    """Selections per slot and tokens, by (router, line), of one scrape."""
    selections: dict[Key, dict[int, float]] = {}
    for sample in samples(text, EXPERT_WINDOW_SELECTIONS):
        labels = sample.labels
        assert labels["kind"] == "expert" and labels["layer"].lstrip("-").isdigit()
        slots = selections.setdefault((labels["router"], labels["business_line"]), {})
        assert int(labels["expert"]) not in slots  # one series per slot
        slots[int(labels["expert"])] = sample.value
    tokens = {(s.labels["router"], s.labels["business_line"]): s.value for s in samples(text, EXPERT_WINDOW_TOKENS)}
    return selections, tokens


def per_pair(text: str, name: str) -> dict[Key, float]:
    return {(s.labels["router"], s.labels["business_line"]): s.value for s in samples(text, name)}


def gauge(text: str, name: str) -> float | None:
    values = samples(text, name)
    assert len(values) <= 1
    return values[0].value if values else None


def windows_now(sidecar) -> dict[Key, tuple[np.ndarray, int]]:
    """Every source's window counts and tokens of its expert routers, as the windows hold them now."""
    found: dict[Key, tuple[np.ndarray, int]] = {}
    for windows in sidecar.sources.windows():
        for info in windows.routers:
            for line in windows.business_lines:
                totals = windows.window_totals(info.name, line) if info.kind == "expert" else None
                if totals is not None:
                    found[(info.name, line)] = (totals.counts, totals.tokens)
    return found


def generate(url: str, headers: dict, prompt: str, tokens: int = 12) -> None:
    answer = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "seed": 3}, headers)
    assert answer.status_code == 200, answer.text


# ------------------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def exporting() -> Iterator[tuple[str, object]]:
    # A short window, so that it rolls over many times: what is exported is what it holds now.
    with running_sidecar(export_expert_counts="all", window_tokens=32, ingest_token=INGEST_TOKEN) as running:
        yield running


def test_exported_counts_are_the_windows_counts_on_two_lines(exporting) -> None:
    url, sidecar = exporting
    generate(url, CODE, "def parse_invoice(")
    generate(url, SERVICE, "Hello, my order has not arrived")
    text = get_metrics(url)
    selections, tokens = exported(text)
    expected = windows_now(sidecar)
    lines = {line for _, line in expected}
    assert {"code_assistant", "customer_service"} <= lines and "all" not in lines
    local = {key: found for key, found in expected.items() if "/" not in key[0]}
    assert set(local) == {key for key in selections if "/" not in key[0]}
    routers = {info.name: info for info in sidecar.sources.probe.routers}
    entropy, total = per_pair(text, routing_gauge("entropy_bits")), per_pair(text, routing_gauge("selections"))
    for key, (counts, window_tokens) in local.items():
        # Every slot, zeros included, exactly the window's counts; beside them, of the same window, the routing
        # gauges the fleet rules read: its entropy and its selections.
        assert sorted(selections[key]) == list(range(routers[key[0]].num_slots))
        assert [selections[key][slot] for slot in range(counts.size)] == counts.tolist()
        assert tokens[key] == window_tokens > 0
        assert counts.sum() == window_tokens * routers[key[0]].top_k
        assert total[key] == counts.sum() and math.isclose(entropy[key], entropy_bits(counts), abs_tol=1e-12)
    # No indexer and no all-lines aggregate among the counts.
    assert not any(routers[router].kind == "indexer" for router, _ in local)
    assert {line for _, line in selections} <= lines
    assert gauge(text, EXPERT_SERIES) == sum(routers[r].num_slots + 1 for r, _ in selections)
    assert gauge(text, EXPERT_SERIES_BUDGET) == ServerConfig.expert_series_budget
    assert gauge(text, EXPERT_OVERFLOW_SELECTIONS) == 0


def test_the_counts_roll_with_the_window(exporting) -> None:
    url, sidecar = exporting
    generate(url, CODE, "SELECT name FROM users WHERE")
    for prompt in ("def count_active_users(", "class InvoiceParser:", "import numpy as np"):
        generate(url, CODE, prompt)
    selections, tokens = exported(get_metrics(url))
    code = [key for key in selections if key[1] == "code_assistant" and "/" not in key[0]]
    assert code
    windows = sidecar.sources.probe.windows
    for router, line in code:
        # The window (32 tokens, whole buckets) holds less than the four requests routed; the export is the window.
        totals = windows.window_totals(router, line)
        cumulative = windows.cumulative(router, line)
        assert totals is not None and cumulative is not None and totals.tokens < cumulative.tokens
        assert tokens[(router, line)] == totals.tokens
        assert [selections[(router, line)][slot] for slot in range(totals.counts.size)] == totals.counts.tolist()


def test_remote_routers_are_exported_under_their_source_name(exporting) -> None:
    url, sidecar = exporting
    gate = RouterInfo("model.layers.5.mlp.gate", 5, "expert", 16, 2)
    indexer = RouterInfo("model.layers.5.self_attn.indexer", 5, "indexer", 32, 4)
    counts = np.zeros(16, dtype=np.int64)
    counts[[1, 4, 9]] = [3, 2, 1]  # 3 tokens x top-2
    body = snapshot_body(
        "worker-7",
        [gate, indexer],
        {
            (gate.name, "doc_summary"): CountDelta(counts, 3),
            (indexer.name, "doc_summary"): CountDelta(np.full(32, 1, dtype=np.int64), 8),
        },
    )
    answer = httpx.post(
        url + "/v1/routing/ingest", json=body, timeout=30, headers={"Authorization": f"Bearer {INGEST_TOKEN}"}
    )
    assert answer.status_code == 200, answer.text
    selections, tokens = exported(get_metrics(url))
    key = ("worker-7/" + gate.name, "doc_summary")
    assert [selections[key][slot] for slot in range(16)] == counts.tolist()
    assert tokens[key] == 3
    assert not any(router.endswith("indexer") for router, _ in selections)
    # The same router label value the routing gauges use.
    gauges = {s.labels["router"] for s in samples(get_metrics(url), "mla_watch_routing_slots")}
    assert key[0] in gauges
    assert windows_now(sidecar)[key][0].tolist() == counts.tolist()


def test_a_shard_scrape_answers_its_routers_series_alone(exporting) -> None:
    """?shard=K/N: the routing gauges and per-expert counts of the routers whose layer modulo N is K, nothing else;
    ?experts=none: everything but the per-expert counts. The shards together are the whole."""
    url, _ = exporting
    generate(url, CODE, "def parse_invoice(")
    whole = get_metrics(url)
    routers = {s.labels["layer"] for s in samples(whole, EXPERT_WINDOW_SELECTIONS)}
    assert len(routers) >= 2
    joined: dict[Key, dict[int, float]] = {}
    for index in range(2):
        answer = httpx.get(url + "/metrics", params={"shard": f"{index}/2"}, timeout=10)
        assert answer.status_code == 200
        text = answer.text
        names = {family.name for family in text_string_to_metric_families(text)}
        assert EXPERT_WINDOW_SELECTIONS in names and "mla_watch_requests" not in names
        assert EXPERT_SERIES not in names  # the budget's figures are no router's
        layers = {s.labels["layer"] for family in text_string_to_metric_families(text) for s in family.samples}
        assert layers and all(int(layer) % 2 == index for layer in layers)
        joined.update(exported(text)[0])
    selections, _ = exported(whole)
    local = {key: slots for key, slots in selections.items() if not key[0].startswith("worker-")}
    assert {key: slots for key, slots in joined.items() if not key[0].startswith("worker-")} == local
    rest = httpx.get(url + "/metrics", params={"experts": "none"}, timeout=10).text
    names = {family.name for family in text_string_to_metric_families(rest)}
    assert EXPERT_WINDOW_SELECTIONS not in names and EXPERT_WINDOW_TOKENS not in names
    assert {"mla_watch_requests", "mla_watch_routing_entropy_bits", EXPERT_SERIES} <= names


@pytest.mark.parametrize(
    ("query", "param", "says"),
    [
        ({"shard": "3/7"}, "shard", "N one of 1, 2, 4, 5, 10, 20, 25, 50, 100"),
        ({"shard": "10/10"}, "shard", "K from 0 to N-1"),
        ({"shard": "abc"}, "shard", 'shard="abc"'),
        ({"experts": "some"}, "experts", "expected all (the default) or none"),
    ],
)
def test_bad_metrics_parameters_are_refused_naming_them(exporting, query, param, says) -> None:
    url, _ = exporting
    answer = httpx.get(url + "/metrics", params=query, timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_off_by_default() -> None:
    with running_sidecar() as (url, _):
        generate(url, CODE, "def f(", tokens=4)
        text = get_metrics(url)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names and not any(name.startswith("mla_watch_expert_") for name in names)
    assert "mla_watch_routing_entropy_bits" in names


def test_selection_by_router_glob_and_line() -> None:
    with running_sidecar(export_expert_counts="routers=*.layers.2.*,*.layers.3.*;lines=customer_service") as (
        url,
        sidecar,
    ):
        generate(url, CODE, "def f(", tokens=4)
        generate(url, SERVICE, "Where is my parcel", tokens=4)
        selections, tokens = exported(get_metrics(url))
        expected = windows_now(sidecar)
    assert (
        set(selections)
        == set(tokens)
        == {("model.layers.2.mlp.gate", "customer_service"), ("model.layers.3.mlp.gate", "customer_service")}
    )
    for key, slots in selections.items():
        assert [slots[slot] for slot in range(len(slots))] == expected[key][0].tolist()


def test_budget_admits_what_fits_refuses_the_rest_and_never_flaps(caplog) -> None:
    # Each bundled router and line is 64 experts + 1 token series: 150 admits two of the three routers of a line.
    with (
        caplog.at_level(logging.WARNING, logger="mla_watch.server"),
        running_sidecar(export_expert_counts="all", expert_series_budget=150) as (url, sidecar),
    ):
        generate(url, CODE, "def parse_invoice(")
        first = get_metrics(url)
        admitted = set(exported(first)[0])
        generate(url, SERVICE, "My order has not arrived")
        scrapes = [get_metrics(url) for _ in range(3)]
        expected = windows_now(sidecar)
    assert len(admitted) == 2 and {line for _, line in admitted} == {"code_assistant"}
    for text in scrapes:  # the same pairs on every scrape: none added, none dropped
        assert set(exported(text)[0]) == set(exported(text)[1]) == admitted
        assert gauge(text, EXPERT_SERIES) == 130
        assert gauge(text, EXPERT_SERIES_BUDGET) == 150
    refused = set(expected) - admitted
    assert {line for _, line in refused} == {"code_assistant", "customer_service"} and len(refused) == 4
    overflow = sum(int(expected[key][0].sum()) for key in refused)
    # What the refused pairs' windows hold now: it grew with the refused line's traffic.
    assert overflow > 0 and gauge(scrapes[-1], EXPERT_OVERFLOW_SELECTIONS) == overflow
    assert 0 < gauge(first, EXPERT_OVERFLOW_SELECTIONS) < overflow
    warnings = [r.getMessage() for r in caplog.records if "per-expert counts" in r.getMessage()]
    assert len(warnings) == 1  # one warning, not one per scrape or per pair
    assert "--expert-series-budget" in warnings[0] and "150" in warnings[0] and "code_assistant" in warnings[0]


# ------------------------------------------------------------------------------------- the collector alone
def registry_of(sources: list[RouterWindows], counts: ExpertCounts) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RoutingCollector(lambda: take_snapshot(list(sources), 0.0), counts))
    return registry


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_zeros_are_exported_for_experts_never_chosen() -> None:
    gate = RouterInfo("model.layers.3.mlp.gate", 3, "expert", 8, 2)
    windows = RouterWindows([gate], window_tokens=None)
    windows.add(gate.name, "code_assistant", CountDelta(np.array([2, 0, 0, 1, 0, 0, 1, 0]), 2))
    selections, tokens = exported(scrape(registry_of([windows], ExpertCounts(ExpertSelection()))))
    assert selections == {(gate.name, "code_assistant"): {0: 2, 1: 0, 2: 0, 3: 1, 4: 0, 5: 0, 6: 1, 7: 0}}
    assert tokens == {(gate.name, "code_assistant"): 2}


def test_series_of_a_dropped_source_return_to_the_budget() -> None:
    gate = RouterInfo("w/model.layers.1.mlp.gate", 1, "expert", 4, 1)
    first = RouterWindows([gate], window_tokens=None)
    first.add(gate.name, "a", CountDelta(np.array([1, 0, 0, 0]), 1))
    first.add(gate.name, "b", CountDelta(np.array([0, 2, 0, 0]), 2))
    sources = [first]
    registry = registry_of(sources, ExpertCounts(ExpertSelection(), budget=5))
    text = scrape(registry)
    assert set(exported(text)[0]) == {(gate.name, "a")} and gauge(text, EXPERT_OVERFLOW_SELECTIONS) == 2
    # The source is dropped and comes back with new windows: first come, first kept, in the new order.
    sources.clear()
    text = scrape(registry)
    assert exported(text)[0] == {} and gauge(text, EXPERT_SERIES) == 0 and gauge(text, EXPERT_OVERFLOW_SELECTIONS) == 0
    again = RouterWindows([gate], window_tokens=None)
    again.add(gate.name, "b", CountDelta(np.array([0, 0, 1, 0]), 1))
    again.add(gate.name, "a", CountDelta(np.array([0, 0, 0, 1]), 1))
    sources.append(again)
    text = scrape(registry)
    assert set(exported(text)[0]) == {(gate.name, "b")}
    assert gauge(text, EXPERT_SERIES) == 5 and gauge(text, EXPERT_OVERFLOW_SELECTIONS) == 1


# ------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "empty"),
        ("everything", "neither routers=... nor lines=..."),
        ("routers=", "routers= has an empty entry"),
        ("lines=a,,b", "lines= has an empty entry"),
        ("lines=all", "every line summed"),
        ("lines=code assistant", "is not a line name"),
        ("routers=*;routers=x", "routers= given twice"),
        ("experts=1,2", "neither routers=... nor lines=..."),
    ],
)
def test_bad_selections_are_refused_naming_the_flag_and_the_value(value: str, problem: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--export-expert-counts", value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--export-expert-counts" in error and problem in error and "expected 'all', or routers=GLOB" in error
    with pytest.raises(ServerConfigError, match="export_expert_counts") as config_error:
        ServerConfig(export_expert_counts=value)
    assert problem in str(config_error.value)


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_a_bad_budget_is_refused_naming_the_flag_and_the_value(value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--export-expert-counts", "all", "--expert-series-budget", value])
    error = capsys.readouterr().err
    assert "--expert-series-budget" in error and repr(value) in error and "integer >= 1" in error


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_a_bad_budget_in_the_config_names_the_key(value: object) -> None:
    with pytest.raises(ServerConfigError, match=r"expert_series_budget = .*expected an integer >= 1"):
        ServerConfig(expert_series_budget=value)  # type: ignore[arg-type]


def test_good_selections_parse_through_the_flag() -> None:
    cases = {
        "all": ExpertSelection(),
        "routers=*.mlp.gate": ExpertSelection(routers=("*.mlp.gate",)),
        " lines = code_assistant , doc_summary ": ExpertSelection(lines=("code_assistant", "doc_summary")),
        "routers=a*,b*;lines=x": ExpertSelection(routers=("a*", "b*"), lines=("x",)),
        "lines=x;routers=w-1/*": ExpertSelection(routers=("w-1/*",), lines=("x",)),
    }
    for text, selection in cases.items():
        args = build_parser().parse_args(["serve", "--export-expert-counts", text])
        assert args.export_expert_counts == selection
        assert ExpertSelection.parse(selection.describe()) == selection
    assert build_parser().parse_args(["serve"]).export_expert_counts is None
    assert ExpertSelection(routers=("w-1/*",)).matches_router("w-1/model.layers.1.mlp.gate")
    assert not ExpertSelection(lines=("x",)).matches_line("all")


def test_the_prewritten_text_reads_as_prometheus_clients_own() -> None:
    """/metrics writes the per-expert families from label strings made once; parsed, they are the very samples
    prometheus_client writes of the same families, label values that need escaping included."""
    gate = RouterInfo('w-1/model.layers.3.mlp."gate"\\x', 3, "expert", 8, 2)
    windows = RouterWindows([gate], window_tokens=None)
    windows.add(gate.name, "code_assistant", CountDelta(np.array([2, 0, 0, 1, 0, 0, 1, 0]), 2))
    windows.add(gate.name, "doc_summary", CountDelta(np.array([0, 0, 5, 1, 0, 0, 0, 0]), 3))
    registry = registry_of([windows], ExpertCounts(ExpertSelection()))

    def parsed(text: str) -> dict:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    written = exposition(registry).decode()
    assert parsed(written) == parsed(scrape(registry))
    assert exported(written)[0][(gate.name, "doc_summary")] == {0: 0, 1: 0, 2: 5, 3: 1, 4: 0, 5: 0, 6: 0, 7: 0}
