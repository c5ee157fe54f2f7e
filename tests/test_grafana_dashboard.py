"""The shipped Grafana dashboard queries only metrics the sidecar really exports, in valid PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mla_watch.dashboards import GRAFANA_DASHBOARD

METRIC = re.compile(r"\bmla_watch_[a-z_]+\b")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    return [(f"{panel['title']} / {target['refId']}", target["expr"])
            for panel in dashboard["panels"] for target in panel["targets"]]


def exported_names(url: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_dashboard_query_uses_metrics_the_sidecar_exports(sidecar) -> None:
    url, _ = sidecar
    response = httpx.post(url + "/v1/completions", json={"prompt": "def parse(", "max_tokens": 8}, timeout=120,
                          headers={"X-Business-Line": "code_assistant", "X-Task": "code"})
    assert response.status_code == 200
    exported = exported_names(url)
    queries = dashboard_queries()
    used = {name for _, expr in queries for name in METRIC.findall(expr)}
    assert {"mla_watch_routing_entropy_bits", "mla_watch_routing_max_violation", "mla_watch_routing_dead_slots",
            "mla_watch_policy_adjustments_total", "mla_watch_notifications_total",
            "mla_watch_retune_jobs_total"} <= used  # what on-call looks at
    unknown = {f"{where}: {name}" for where, expr in queries for name in METRIC.findall(expr) if name not in exported}
    assert not unknown, f"the dashboard queries metrics the sidecar does not export: {sorted(unknown)}"


def test_every_dashboard_query_is_valid_promql(tmp_path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: .ci/run installs Debian's prometheus package"
    rules = [{"record": f"dashboard:query_{index}", "expr": re.sub(r"\$\w+", ".*", expr)}
             for index, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout
