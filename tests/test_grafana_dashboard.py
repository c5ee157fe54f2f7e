"""The shipped Grafana dashboard queries only metrics the sidecar really exports, in valid PromQL."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness import processes
from mla_watch.alerting import fleet
from mla_watch.dashboards import GRAFANA_DASHBOARD

METRIC = re.compile(r"\bmla_watch_[a-z_]+\b")
# A recording rule's name, `level:metric:operations` (the fleet rules of `rules export --fleet`).
RECORDING = re.compile(r"\b[a-z_]+:mla_watch_[a-z_]+:[a-z0-9_]+\b")
# What a sidecar exports only with --export-expert-counts: the fleet panels read the recordings made of them.
EXPERT_COUNTS = {fleet.WINDOW_SELECTIONS, fleet.WINDOW_TOKENS}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def sidecar_names(expr: str) -> list[str]:
    """The metric names of ``expr`` a sidecar exports itself: neither recordings nor the opt-in per-expert counts."""
    return [name for name in METRIC.findall(RECORDING.sub("", expr)) if name not in EXPERT_COUNTS]


def exported_names(url: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_dashboard_query_uses_metrics_the_sidecar_exports(sidecar) -> None:
    url, _ = sidecar
    response = httpx.post(
        url + "/v1/completions",
        json={"prompt": "def parse(", "max_tokens": 8},
        timeout=120,
        headers={"X-Business-Line": "code_assistant", "X-Task": "code"},
    )
    assert response.status_code == 200
    exported = exported_names(url)
    queries = dashboard_queries()
    used = {name for _, expr in queries for name in sidecar_names(expr)}
    assert {
        "mla_watch_routing_entropy_bits",
        "mla_watch_routing_max_violation",
        "mla_watch_routing_dead_slots",
        "mla_watch_policy_adjustments_total",
        "mla_watch_notifications_total",
        "mla_watch_retune_jobs_total",
    } <= used  # what on-call looks at
    unknown = {f"{where}: {name}" for where, expr in queries for name in sidecar_names(expr) if name not in exported}
    assert not unknown, f"the dashboard queries metrics the sidecar does not export: {sorted(unknown)}"


def test_fleet_panels_read_the_fleet_recordings_never_the_replicas_per_expert_series() -> None:
    queries = dashboard_queries()
    recordings = {name for _, expr in queries for name in RECORDING.findall(expr)}
    assert {
        fleet.FLEET_ENTROPY_BITS,
        fleet.FLEET_MAX_VIOLATION,
        fleet.FLEET_DEAD_SLOTS,
        fleet.REPLICA_KL_BITS,
    } <= recordings  # fleet entropy, MaxVio, dead experts, divergence
    unknown = recordings - set(fleet.RECORDING_NAMES)
    assert not unknown, f"the dashboard reads recordings the fleet rules do not record: {sorted(unknown)}"
    # The fleet's per-expert recordings are one replica's worth of series: a panel never sums every replica's.
    per_expert = {
        name
        for _, expr in queries
        for name in METRIC.findall(RECORDING.sub("", expr))
        if name.startswith("mla_watch_expert_")
    }
    assert not per_expert and fleet.FLEET_EXPERT_SELECTIONS in recordings
    assert any("ALERTS" in expr and "scope" in expr for _, expr in queries)  # the fleet and outlier alerts
    heat = [panel for panel in json.loads(GRAFANA_DASHBOARD.read_text())["panels"] if panel["type"] == "heatmap"]
    assert heat and heat[0]["repeat"] == "layer"  # one expert-load heat map per layer
    assert 'layer="$layer"' in heat[0]["targets"][0]["expr"]


def test_every_dashboard_query_is_valid_promql(tmp_path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: .ci/run installs Debian's prometheus package"
    rules = [
        {"record": f"dashboard:query_{index}", "expr": re.sub(r"\$\w+", ".*", expr.replace("$__rate_interval", "5m"))}
        for index, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = processes.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout
