"""Rules that fit each router's geometry: the `slots` selector, relative thresholds, the shipped rules on every size.

The seed's 5.0 / 6.5 bits are facts about 64-expert top-6 routers; an 8-expert top-2 router
lives in 1.0-3.0 bits. The shipped rules keep the seed numbers for 64 experts and carry them to
every other geometry in normalized entropy: `mla-watch check` passes them on real geometries
(Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3, gpt-oss-20b, the bundled model), and a collapse pages
on 8-expert models through the probe's real hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mla_watch
from harness.helpers import FakeClock
from mla_watch.alerting.lint import lint
from mla_watch.alerting.rules import RuleError, load_rules_dir
from mla_watch.cli import main
from mla_watch.engines.geometry import parse_geometry
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.windows import RouterStats
from mla_watch.shipped import SHIPPED_RULES
from tests.tiny_models import VOCAB, build

# The keys that decide the routers' geometry, from each model's published config.json.
REAL_CONFIGS = {
    "Mixtral-8x7B": {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "DeepSeek-V3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 24,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
    },
}
ONCALL = {"MLA_WATCH_ONCALL_URL": "http://127.0.0.1:9/hook"}


def rules_file(tmp_path: Path, select: str, *, metric: str = "entropy_bits", below: float = 5.0) -> Path:
    (tmp_path / "r.yaml").write_text(
        "receivers: [{name: oncall, type: alertmanager_webhook, url: 'http://127.0.0.1:9/hook'}]\n"
        f"rules:\n  - {{alert: Low, metric: {metric}, select: {select}, below: {below}}}\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    ("select", "inside", "outside"),
    [
        ("{slots: 64}", [64], [8, 256]),
        ("{slots: [8, 63]}", [8, 63], [7, 64]),
        ("{slots: [65, null]}", [65, 4096], [64]),
        ("{slots: {not: 64}}", [8, 256], [64]),
        ("{slots: {not: [8, 64]}}", [7, 65], [8, 64]),
    ],
)
def test_the_slots_selector_matches_routers_by_size(tmp_path, select, inside, outside) -> None:
    (rule,) = load_rules_dir(rules_file(tmp_path, select)).rules
    for slots in inside:
        assert rule.selector.matches({"name": "g", "layer": 1, "kind": "expert", "num_slots": slots})
    for slots in outside:
        assert not rule.selector.matches({"name": "g", "layer": 1, "kind": "expert", "num_slots": slots})


@pytest.mark.parametrize(
    ("select", "words"),
    [
        ("{slots: 0}", "a number of slots (64)"),
        ("{slots: [64, 8]}", "[low, high] with low <= high"),
        ("{slots: {except: 64}}", "under `not:`"),
        ("{slots: true}", "rules[Low].select.slots"),
    ],
)
def test_a_bad_slots_selector_is_refused_by_key_and_value(tmp_path, select, words) -> None:
    with pytest.raises(RuleError) as caught:
        load_rules_dir(rules_file(tmp_path, select))
    assert words in str(caught.value) and "r.yaml" in str(caught.value)


def test_bits_below_ceiling_is_linted_against_each_routers_span(tmp_path) -> None:
    rules = load_rules_dir(rules_file(tmp_path, "{kind: expert}", metric="bits_below_ceiling", below=2.5))
    mixtral = RouterInfo("model.layers.0.mlp.gate", 0, "expert", 8, 2)  # 1-3 bits: at most 2 below the ceiling
    deepseek = RouterInfo("model.layers.3.mlp.gate", 3, "expert", 256, 8)  # 3-8 bits
    findings = lint(rules, [mixtral, deepseek])
    assert [f.router for f in findings] == [mixtral.name] and findings[0].severity == "error"
    assert "always fires" in findings[0].message and "at most 2.000 bits below its ceiling" in findings[0].message


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_check_passes_the_shipped_rules_on_real_geometries(tmp_path, capsys, monkeypatch, name) -> None:
    for key, value in ONCALL.items():
        monkeypatch.setenv(key, value)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(REAL_CONFIGS[name]))
    assert main(["check", "--model-config", str(config)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "0 error(s)" in out and "info: rule RoutingEntropyLow" in out  # the 64-expert seed rule stands aside
    routers = parse_geometry(REAL_CONFIGS[name]).routers()
    findings = lint(load_rules_dir(SHIPPED_RULES, environ=ONCALL), routers)
    watched = {f.rule for f in findings if f.severity == "info"}
    # the 64-expert seed rules stand aside; the baseline rules say what they judge against; the indexer rule says
    # it does not apply to a model without indexers
    no_indexer = {"IndexerDegenerate"} if all(router.kind != "indexer" for router in routers) else set()
    assert (
        watched
        == {"RoutingEntropyLow", "RoutingEntropyHigh", "RoutingEntropyFalling", "ExpertHotspot", "DeadExperts"}
        | no_indexer
    )
    # serve keeps the routing history by default, and its trend rules read it: nothing to warn of
    assert "never judges it" not in out
    assert main(["check", "--model-config", str(config), "--history-retention", "0"]) == 0
    assert "warning: rule RoutingCollapseForecast" in capsys.readouterr().out  # without it, say so


def test_check_passes_the_shipped_rules_on_the_bundled_model(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MLA_WATCH_ONCALL_URL", ONCALL["MLA_WATCH_ONCALL_URL"])
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "info: rule RoutingCollapse" in out and "0 error(s)" in out
    assert "info: rule RoutingCollapseForecast" in out and "never judges it" not in out
    assert main(["check", "--history-retention", "0"]) == 0
    out = capsys.readouterr().out
    assert "warning: rule RoutingEntropyFalling" in out and "never judges it" in out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_a_collapse_pages_on_an_8_expert_model_with_the_shipped_rules(family) -> None:
    from mla_watch.alerting.alert_engine import AlertEngine

    model = build(family)
    probe = mla_watch.attach(model, window_tokens=None)
    collapsed = "model.layers.1.mlp.gate"
    gate = dict(model.named_modules())[collapsed]
    with torch.no_grad():
        if hasattr(gate, "e_score_correction_bias"):  # DeepSeek's balancing bias: the cheapest real fault
            gate.e_score_correction_bias[:2] += 10.0
        else:  # every expert scores alike: top-k always takes the same two
            gate.weight.zero_()
    generator = torch.Generator().manual_seed(0)
    for line in ("chat", "code"):
        with torch.no_grad(), probe.attribute(line):
            model(input_ids=torch.randint(1, VOCAB, (4, 40), generator=generator))
    clock = FakeClock(1_000_000.0)
    engine = AlertEngine(load_rules_dir(SHIPPED_RULES, environ=ONCALL), clock=clock)

    def records() -> list[RouterStats]:
        return [record for line in (None, "chat", "code") for record in probe.router_stats(line)]

    assert [a for a in engine.evaluate(records()) if a.kind == "notify"] == []  # pending: for 2m
    clock.now += 121
    pages = [a for a in engine.evaluate(records()) if a.kind == "notify"]
    assert {(a.alert.labels["alertname"], a.alert.labels["router"]) for a in pages} == {("RoutingCollapse", collapsed)}
    assert {a.alert.labels["business_line"] for a in pages} == {"chat", "code"}
    assert all("floor of 1.000 bits" in a.alert.annotations["description"] for a in pages)
    probe.detach()


def test_hash_routers_have_no_log2_k_floor_and_rules_skip_them_unless_asked(tmp_path) -> None:
    from mla_watch.routing.routers import CountDelta
    from mla_watch.routing.windows import RouterWindows

    hashed = RouterInfo("model.layers.0.mlp.gate", 0, "expert", 8, 2, hash_routed=True)
    learned = RouterInfo("model.layers.1.mlp.gate", 1, "expert", 8, 2)
    windows = RouterWindows([hashed, learned], window_tokens=None)
    counts = torch.zeros(8, dtype=torch.int64).numpy()
    counts[0] = 200  # the lookup table gives every token expert 0, twice
    for info in (hashed, learned):
        windows.add(info.name, "chat", CountDelta(counts.copy(), 100))
    by_name = {record.router.name: record.as_dict() for record in windows.router_stats("chat")}
    assert by_name[hashed.name]["floor_bits"] == 0.0 and by_name[hashed.name]["entropy_bits"] == 0.0
    assert by_name[hashed.name]["hash_routed"] is True and "hash_routed" not in by_name[learned.name]
    (rule,) = load_rules_dir(rules_file(tmp_path, "{kind: expert}")).rules
    assert not rule.selector.matches(by_name[hashed.name]) and rule.selector.matches(by_name[learned.name])
    (asked,) = load_rules_dir(rules_file(tmp_path, "{kind: expert, hash_routed: true}")).rules
    assert asked.selector.matches(by_name[hashed.name]) and not asked.selector.matches(by_name[learned.name])


def test_routing_never_shows_an_entropy_below_its_floor(sidecar) -> None:
    """The README's own requests on the bundled model: indexers on short contexts used to read under their floor."""
    import httpx

    url, _ = sidecar
    for line, prompt in (
        ("customer_service", "Where is my order?"),
        ("code_assistant", "def add(a, b):"),
        ("doc_summary", "Summarise: the meeting moved to Monday."),
    ):
        answer = httpx.post(
            url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 8},
            headers={"X-Business-Line": line},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    body = httpx.get(url + "/v1/routing", timeout=30).json()
    records = [
        r
        for line in [None, *body["business_lines"]]
        for r in httpx.get(url + "/v1/routing", params={"business_line": line} if line else {}, timeout=30).json()[
            "routers"
        ]
    ]
    counted = [r for r in records if r["selections"]]
    assert {r["kind"] for r in counted} == {"expert", "indexer"}
    for record in counted:
        assert record["floor_bits"] <= record["entropy_bits"] + 1e-9 <= record["ceiling_bits"] + 2e-9, record
        assert 0.0 <= record["normalized_entropy"] <= 1.0
