"""Prometheus export of the alert rules, checked by the real promtool (Debian's prometheus package)."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import processes
from harness.support import REPO
from mla_watch.alerting.promexport import export_prometheus, glob_to_regex, rule_expression
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.alerting.vocabulary import Rule, RuleSet, Selector, Trend

ONCALL = {"MLA_WATCH_ONCALL_URL": "https://alerts.example.com/hook"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: .ci/run must install Debian's prometheus package "
            "(apt-get install -y prometheus), which provides /usr/bin/promtool"
        )
    return path


@pytest.fixture(scope="module")
def shipped() -> RuleSet:
    return load_rules_dir(REPO / "rules", environ=ONCALL)


def exported_rules(rules: RuleSet, job: str = "mla_watch") -> dict[str, dict]:
    document = yaml.safe_load(export_prometheus(rules, job=job))
    (group,) = document["groups"]
    assert group["name"] == "mla_watch_routing"
    return {rule["alert"]: rule for rule in group["rules"]}


def test_export_of_the_shipped_rules(shipped):
    text = export_prometheus(shipped)
    assert "no hysteresis" in text and "keep_firing_for" in text  # the header says what Prometheus cannot do
    rules = exported_rules(shipped)
    assert set(rules) == {r.name for r in shipped.rules}

    low = rules["RoutingEntropyLow"]
    expr = " ".join(low["expr"].split())
    assert expr == (
        'mla_watch_routing_entropy_bits{job="mla_watch", kind="expert", business_line!="all"} < 5 '
        "and on(job, instance, router, layer, kind, business_line) "
        '(mla_watch_routing_slots{job="mla_watch", kind="expert", business_line!="all"} == 64) '
        "and on(job, instance, router, layer, kind, business_line) "
        'mla_watch_routing_window_too_small{job="mla_watch"} == 0'
    )
    collapse = " ".join(rules["RoutingCollapse"]["expr"].split())
    assert collapse.startswith(
        'mla_watch_routing_normalized_entropy{job="mla_watch", kind="expert", business_line!="all"} < 0.7'
    )
    assert '(mla_watch_routing_slots{job="mla_watch", kind="expert", business_line!="all"} != 64)' in collapse
    assert low["for"] == "2m" and low["keep_firing_for"] == "5m"
    assert low["labels"] == {"severity": "critical", "team": "ml-platform"}
    assert low["annotations"]["runbook_url"].endswith("#routingentropylow")
    assert '{{ $value | printf "%.2f" }}' in low["annotations"]["summary"]
    assert "{{ $labels.router }}" in low["annotations"]["summary"]
    assert "below 5.0 bits" in low["annotations"]["summary"]  # {threshold} -> the rule's constant
    assert "{" not in re.sub(r"\{\{.*?\}\}", "", low["annotations"]["description"])  # no str.format left

    high = rules["RoutingEntropyHigh"]
    assert "mla_watch_routing_entropy_bits{" in high["expr"] and "> 6.5" in high["expr"]
    assert 'kind="expert"' in high["expr"]

    dead = rules["DeadExperts"]
    assert "mla_watch_routing_dead_slots{" in dead["expr"]
    # more than 4 beyond the line's healthy count: the healthy baseline's series, plus 4, at least 4
    assert "> clamp_min(mla_watch_routing_baseline_dead_slots{" in dead["expr"] and "} + 4, 4)" in dead["expr"]
    assert 'mla_watch_routing_window_tokens{job="mla_watch"} >= 1024' in dead["expr"]
    assert "window_too_small" not in dead["expr"]

    assert "mla_watch_routing_max_violation{" in rules["ExpertHotspot"]["expr"]
    assert "mla_watch_routing_js_divergence{" in rules["RoutingDrift"]["expr"]
    degenerate = rules["IndexerDegenerate"]["expr"]
    assert "mla_watch_routing_indexer_locality{" in degenerate and 'kind="indexer"' in degenerate
    assert "> 0.95" in degenerate


def test_selectors_become_matchers():
    rule = Rule(
        name="R",
        metric="entropy_bits",
        selector=Selector(
            kind="expert", layers=(2, 4), router="model.layers.*.mlp.gate", business_line="code_assistant"
        ),
        below=5.0,
        above=7.5,
        min_tokens=256,
    )
    expr = rule_expression(rule, job="")
    assert 'layer=~"2|3|4"' in expr
    assert 'router=~"model\\\\.layers\\\\..*\\\\.mlp\\\\.gate"' in expr  # PromQL string escaping of \.
    assert 'business_line="code_assistant"' in expr and "job=" not in expr
    assert "< 5" in expr and "> 7.5" in expr and " or " in expr
    assert "mla_watch_routing_window_tokens >= 256" in expr


@pytest.mark.parametrize(
    "pattern", ["*.mlp.gate", "model.layers.?.mlp.gate", "model.layers.[12].*", "model.layers.[!1]*", "*(x)+$", "a[b"]
)
def test_glob_to_regex_agrees_with_fnmatch(pattern):
    names = [
        "model.layers.1.mlp.gate",
        "model.layers.2.mlp.gate",
        "model.layers.12.mlp.gate",
        "xmlpxgate",
        "model.layers.1.self_attn.indexer",
        "a(x)+$",
        "a[b",
        "ab",
    ]
    regex = re.compile(glob_to_regex(pattern))  # RE2 syntax is a subset of what re accepts here
    for name in names:
        assert bool(regex.fullmatch(name)) == fnmatch.fnmatchcase(name, pattern), (pattern, name)


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return processes.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_accepts_the_export(shipped, tmp_path):
    (tmp_path / "mla_watch.rules.yaml").write_text(export_prometheus(shipped))
    result = run_promtool("check", "rules", "mla_watch.rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(shipped.rules)} rules found" in result.stdout


def test_promtool_rejects_a_broken_file(tmp_path):  # the check above can fail
    (tmp_path / "bad.yaml").write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: 'm <'\n")
    assert run_promtool("check", "rules", "bad.yaml", cwd=tmp_path).returncode != 0


def series(metric: str, router: str, line: str, **extra: str) -> str:
    labels = {
        "job": "mla_watch",
        "instance": "sidecar:8000",
        "router": router,
        "layer": "1",
        "kind": "expert",
        "business_line": line,
        **extra,
    }
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_promtool_unit_test_fires_routing_entropy_low_for_one_router(shipped, tmp_path):
    low = next(r for r in shipped.rules if r.name == "RoutingEntropyLow")
    # known annotations, to check the template conversion too (including the floor/ceiling/tokens queries)
    low = dataclasses.replace(
        low,
        annotations={
            "summary": "{alertname}: {metric} {value:.2f} < {threshold} on {router} layer {layer} ({business_line})",
            "description": "floor {floor_bits:.3f}, ceiling {ceiling_bits:.3f}, {tokens} tokens, {status_url}",
        },
    )
    (tmp_path / "rules.yaml").write_text(export_prometheus(RuleSet(rules=(low,), receivers={})))
    bad, good = "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"
    input_series = []
    for router, entropy in ((bad, "4.5"), (good, "5.5")):
        input_series += [
            {"series": series("mla_watch_routing_entropy_bits", router, "code_assistant"), "values": f"{entropy}x20"},
            {"series": series("mla_watch_routing_slots", router, "code_assistant"), "values": "64x20"},
            {"series": series("mla_watch_routing_window_too_small", router, "code_assistant"), "values": "0x20"},
            {"series": series("mla_watch_routing_window_tokens", router, "code_assistant"), "values": "4096x20"},
        ]
    # the aggregate line reads low too, and a too-small window reads low: neither may fire
    input_series += [
        {"series": series("mla_watch_routing_entropy_bits", bad, "all"), "values": "4.5x20"},
        {"series": series("mla_watch_routing_slots", bad, "all"), "values": "64x20"},
        {"series": series("mla_watch_routing_slots", bad, "doc_summary"), "values": "64x20"},
        {"series": series("mla_watch_routing_window_too_small", bad, "all"), "values": "0x20"},
        {"series": series("mla_watch_routing_entropy_bits", bad, "doc_summary"), "values": "4.0x20"},
        {"series": series("mla_watch_routing_window_too_small", bad, "doc_summary"), "values": "1x20"},
        {
            "series": f'mla_watch_routing_entropy_floor_bits{{router="{bad}",layer="1",kind="expert"}}',
            "values": "2.584962500721156x20",
        },
        {
            "series": f'mla_watch_routing_entropy_ceiling_bits{{router="{bad}",layer="1",kind="expert"}}',
            "values": "6x20",
        },
    ]
    labels = {
        "job": "mla_watch",
        "instance": "sidecar:8000",
        "router": bad,
        "layer": "1",
        "kind": "expert",
        "business_line": "code_assistant",
        "severity": low.severity,
        **dict(low.labels),
    }
    firing = [
        {
            "exp_labels": labels,
            "exp_annotations": {
                "summary": f"RoutingEntropyLow: entropy_bits 4.50 < 5.0 on {bad} layer 1 (code_assistant)",
                "description": "floor 2.585, ceiling 6.000, 4096 tokens, n/a",
            },
        }
    ]
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "RoutingEntropyLow", "exp_alerts": []},  # pending (for: 2m)
                    {"eval_time": "5m", "alertname": "RoutingEntropyLow", "exp_alerts": firing},
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    result = run_promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout

    # the same test must fail when it expects the healthy router to fire as well
    unit["tests"][0]["alert_rule_test"][1]["exp_alerts"] = [*firing, {"exp_labels": {**labels, "router": good}}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    assert run_promtool("test", "rules", "test.yaml", cwd=tmp_path).returncode != 0


def test_promtool_unit_test_the_geometry_decides_which_collapse_rule_pages(shipped, tmp_path):
    """An 8-expert router at 2.0 bits (normalized 0.5) pages RoutingCollapse, not the 64-expert seed rule."""
    picked = tuple(
        dataclasses.replace(r, annotations={})
        for r in shipped.rules
        if r.name in ("RoutingEntropyLow", "RoutingCollapse")
    )
    (tmp_path / "rules.yaml").write_text(export_prometheus(RuleSet(rules=picked, receivers={})))
    small = "model.layers.1.block_sparse_moe.gate"
    input_series = [
        {"series": series("mla_watch_routing_entropy_bits", small, "chat"), "values": "2x20"},
        {"series": series("mla_watch_routing_normalized_entropy", small, "chat"), "values": "0.5x20"},
        {"series": series("mla_watch_routing_slots", small, "chat"), "values": "8x20"},
        {"series": series("mla_watch_routing_window_too_small", small, "chat"), "values": "0x20"},
    ]
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "RoutingEntropyLow", "exp_alerts": []},
                    {
                        "eval_time": "5m",
                        "alertname": "RoutingCollapse",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "job": "mla_watch",
                                    "instance": "sidecar:8000",
                                    "router": small,
                                    "layer": "1",
                                    "kind": "expert",
                                    "business_line": "chat",
                                    "severity": "critical",
                                    "team": "ml-platform",
                                }
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    result = run_promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_test_expert_hotspot_judges_each_line_against_its_healthy_baseline(shipped, tmp_path):
    """MaxVio 3.0 pages the line healthy at 1.2 (threshold 2.4), not the line healthy at 1.6 (threshold 3.2),
    nor a line without a baseline; a line healthy at 0.2 pages above the floor of 1.0."""
    hotspot = next(r for r in shipped.rules if r.name == "ExpertHotspot")
    hotspot = dataclasses.replace(
        hotspot, annotations={"summary": "{value:.2f}, healthy {healthy:.2f}, threshold {threshold:.2f}"}
    )
    (tmp_path / "rules.yaml").write_text(export_prometheus(RuleSet(rules=(hotspot,), receivers={})))
    router = "model.layers.3.mlp.gate"
    input_series = []
    for line, value, healthy in (
        ("sql", "3", "1.2"),
        ("code", "3", "1.6"),
        ("chat", "9", None),
        ("summaries", "1.1", "0.2"),
    ):
        input_series += [
            {"series": series("mla_watch_routing_max_violation", router, line), "values": f"{value}x20"},
            {"series": series("mla_watch_routing_window_tokens", router, line), "values": "4096x20"},
        ]
        if healthy is not None:
            input_series.append(
                {"series": series("mla_watch_routing_baseline_max_violation", router, line), "values": f"{healthy}x20"}
            )
    labels = {
        "job": "mla_watch",
        "instance": "sidecar:8000",
        "router": router,
        "layer": "1",
        "kind": "expert",
        "severity": "warning",
    }
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": "ExpertHotspot",
                        "exp_alerts": [
                            {
                                "exp_labels": {**labels, "business_line": "sql"},
                                "exp_annotations": {"summary": "3.00, healthy 1.20, threshold 2.40"},
                            },
                            {
                                "exp_labels": {**labels, "business_line": "summaries"},
                                "exp_annotations": {"summary": "1.10, healthy 0.20, threshold 1.00"},
                            },
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    result = run_promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_trend_rules_export_as_deriv_and_predict_linear(shipped):
    falling = exported_rules(shipped)["RoutingEntropyFalling"]
    expr = " ".join(falling["expr"].split())
    assert expr.startswith(
        'predict_linear(mla_watch_routing_entropy_bits{job="mla_watch", kind="expert", '
        'business_line!="all"}[12h], 259200) < 5 '
    )
    assert "count_over_time(" in expr and "[6h] offset 6h) > 0" in expr  # enough history, as the sidecar asks
    assert falling["for"] == "2h" and falling["labels"]["severity"] == "warning"
    slope = Rule(
        name="S",
        metric="normalized_entropy",
        selector=Selector(),
        below=-0.05,
        trend=Trend("slope", 6 * 3600.0, per_seconds=86400.0),
    )
    assert rule_expression(slope, job="").startswith(
        'deriv(mla_watch_routing_normalized_entropy{business_line!="all"}[6h]) * 86400 < -0.05'
    )


def test_promtool_unit_test_fires_a_trend_and_a_predict_rule(tmp_path):
    """A line falling 0.02 bits a step (1 step = 15m: -1.92 bits a day) fires both; a flat one neither."""
    summary = "{router}: {predicted:.2f} bits in 3d, {slope_per_hour:.3f} bits/h, now {current:.2f}"
    predict = Rule(
        name="Falling",
        metric="entropy_bits",
        selector=Selector(kind="expert"),
        below=5.0,
        for_seconds=1800.0,
        trend=Trend("predict", 6 * 3600.0, ahead_seconds=3 * 86400.0),
        annotations={"summary": summary},
    )
    slope = Rule(
        name="Sinking",
        metric="entropy_bits",
        selector=Selector(kind="expert"),
        below=-1.0,
        trend=Trend("slope", 6 * 3600.0, per_seconds=86400.0),
    )
    (tmp_path / "rules.yaml").write_text(export_prometheus(RuleSet(rules=(predict, slope), receivers={})))
    falling, flat = "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"
    input_series = [
        {"series": series("mla_watch_routing_entropy_bits", falling, "chat"), "values": "5.9-0.02x40"},
        {"series": series("mla_watch_routing_entropy_bits", flat, "chat"), "values": "5.9x40"},
        *(
            {"series": series("mla_watch_routing_window_too_small", router, "chat"), "values": "0x40"}
            for router in (falling, flat)
        ),
    ]
    labels = {
        "job": "mla_watch",
        "instance": "sidecar:8000",
        "router": falling,
        "layer": "1",
        "kind": "expert",
        "business_line": "chat",
    }
    # at 4h: 5.58 bits now, -0.08 bits/h, 5.58 - 0.08 * 72 = -0.18 predicted
    at_4h = {
        "exp_labels": {**labels, "severity": "warning"},
        "exp_annotations": {"summary": f"{falling}: -0.18 bits in 3d, -0.080 bits/h, now 5.58"},
    }
    unit = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "15m",
        "tests": [
            {
                "interval": "15m",
                "input_series": input_series,
                "alert_rule_test": [
                    # 2h of history: less than half the 6h look-back, not judged yet
                    {"eval_time": "2h", "alertname": "Falling", "exp_alerts": []},
                    {"eval_time": "2h", "alertname": "Sinking", "exp_alerts": []},
                    {"eval_time": "4h", "alertname": "Falling", "exp_alerts": [at_4h]},
                    {
                        "eval_time": "4h",
                        "alertname": "Sinking",
                        "exp_alerts": [{"exp_labels": {**labels, "severity": "warning"}}],
                    },
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    result = run_promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # and it fails when the flat router is expected to fire too
    unit["tests"][0]["alert_rule_test"][3]["exp_alerts"].append(
        {"exp_labels": {**labels, "router": flat, "layer": "1", "severity": "warning"}}
    )
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit, sort_keys=False))
    assert run_promtool("test", "rules", "test.yaml", cwd=tmp_path).returncode != 0


def test_export_rules_wraps_the_same_rules_in_each_format(shipped):
    from mla_watch.alerting.promexport import export_rules

    plain = yaml.safe_load(export_prometheus(shipped))
    operator = yaml.safe_load(
        export_rules(shipped, command="mla-watch rules export --format operator", file_format="operator")
    )
    mimir = yaml.safe_load(export_rules(shipped, command="mla-watch rules export --format mimir", file_format="mimir"))
    assert operator["spec"] == plain and operator["kind"] == "PrometheusRule"
    assert mimir.pop("namespace") == "mla_watch" and mimir == plain
    with pytest.raises(ValueError, match=r"'thanos'.*prometheus, operator, mimir"):
        export_rules(shipped, command="x", file_format="thanos")
