"""One page per problem: the shipped deploy/alertmanager.yaml, run by real Alertmanager, given the alerts
Prometheus would send for a fleet-wide fault and for one broken replica.

Alertmanager comes from Debian's prometheus-alertmanager package, which `.ci/run` installs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from harness.helpers import running_tool
from harness.receivers import running_receiver
from harness.support import REPO, wait_until
from mla_watch.alerting.fleet import OUTLIER_ALERT, SCOPE_LABEL

pytestmark = pytest.mark.slow

GROUP_WAIT_SECONDS = 1
ROUTER = {
    "job": "mla_watch",
    "router": "model.layers.1.mlp.gate",
    "layer": "1",
    "kind": "expert",
    "business_line": "code_assistant",
}
REPLICAS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def config_for(receiver_url: str, inhibit: bool = True) -> str:
    """The shipped config, its webhooks pointed at the test receiver (``/<receiver name>`` after ``receiver_url``)
    and its group waits shortened."""
    config = yaml.safe_load((REPO / "deploy" / "alertmanager.yaml").read_text())
    if not inhibit:
        del config["inhibit_rules"]
    assert [receiver["name"] for receiver in config["receivers"]] == ["oncall", "line_owners"]
    for receiver in config["receivers"]:
        receiver["webhook_configs"][0]["url"] = f"{receiver_url}/{receiver['name']}"
    for route in (config["route"], *config["route"]["routes"]):
        if "group_wait" in route or route is config["route"]:
            route["group_wait"] = f"{GROUP_WAIT_SECONDS}s"
    return yaml.safe_dump(config)


def alertmanager(tmp_path: Path, receiver_url: str, inhibit: bool = True) -> AbstractContextManager[str]:
    return running_tool(
        "prometheus-alertmanager", tmp_path, config_for(receiver_url, inhibit), "--cluster.listen-address="
    )


def alert(alertname: str, severity: str, scope: str, **labels: str) -> dict:
    """An alert as Prometheus posts it to /api/v2/alerts while it fires."""
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": alertname, "severity": severity, SCOPE_LABEL: scope, **ROUTER, **labels},
        "annotations": {"summary": f"{alertname} on {ROUTER['router']}"},
        "startsAt": now.isoformat(),
        "endsAt": (now + timedelta(minutes=10)).isoformat(),
        "generatorURL": "http://prometheus.example.internal/graph",
    }


def notifications(alerts: list[dict], tmp_path: Path, inhibit: bool = True) -> list[dict]:
    """Every webhook notification the shipped config sends for ``alerts``, posted at once."""
    with running_receiver() as receiver, alertmanager(tmp_path, receiver.url + "/alerts", inhibit) as url:
        response = httpx.post(url + "/api/v2/alerts", json=alerts, timeout=10)
        assert response.status_code == 200, response.text
        assert wait_until(lambda: len(receiver.requests) >= 1, timeout=30, interval=0.1), (
            tmp_path / "prometheus-alertmanager.log"
        ).read_text()[-2000:]
        # Every alert is in its group by the first page: each group that holds one not inhibited pages once.
        assert wait_until(lambda: len(receiver.requests) >= paging_groups(url) >= 1, timeout=30, interval=0.1)
        return [{**request.json(), "path": request.path} for request in list(receiver.requests)]


def paging_groups(url: str) -> int:
    """How many of Alertmanager's groups hold an alert it sends (neither silenced nor inhibited)."""
    groups = httpx.get(
        url + "/api/v2/alerts/groups", params={"silenced": "false", "inhibited": "false"}, timeout=10
    ).json()
    return sum(1 for group in groups if group["alerts"])


def test_a_fleet_wide_fault_pages_once(tmp_path: Path) -> None:
    alerts = [
        alert("RoutingCollapse", "critical", "fleet", team="ml-platform"),
        *(
            alert("RoutingCollapse", "critical", "replica", team="ml-platform", instance=replica)
            for replica in REPLICAS
        ),
    ]
    (body,) = notifications(alerts, tmp_path)
    assert body["status"] == "firing"
    (paged,) = body["alerts"]  # the replicas' own alerts are muted by the fleet's
    assert paged["labels"][SCOPE_LABEL] == "fleet" and "instance" not in paged["labels"]


def test_one_broken_replica_pages_once_naming_it(tmp_path: Path) -> None:
    broken = REPLICAS[1]
    alerts = [
        alert(OUTLIER_ALERT, "warning", "replica", instance=broken),
        alert("RoutingCollapse", "critical", "replica", team="ml-platform", instance=broken),
    ]
    (body,) = notifications(alerts, tmp_path)
    assert body["commonLabels"]["instance"] == broken
    assert {a["labels"]["alertname"] for a in body["alerts"]} == {OUTLIER_ALERT, "RoutingCollapse"}


def test_without_the_inhibit_rule_the_fleet_fault_lists_every_replica(tmp_path: Path) -> None:
    """What the inhibit rule is for: the same alerts, the rule removed, name all four in the page."""
    shipped = REPO / "deploy" / "alertmanager.yaml"
    config = yaml.safe_load(shipped.read_text())
    assert config["inhibit_rules"][0]["source_matchers"] == ['scope="fleet"']
    alerts = [
        alert("RoutingCollapse", "critical", "fleet"),
        *(alert("RoutingCollapse", "critical", "replica", instance=replica) for replica in REPLICAS),
    ]
    bodies = notifications(alerts, tmp_path, inhibit=False)
    assert len(bodies) == 1 and len(bodies[0]["alerts"]) == 4


def test_the_sidecars_alerts_go_by_their_cause_traffic_to_the_line_owners_the_model_to_on_call(tmp_path: Path) -> None:
    """The sidecar's own alerts (alertmanager_api) carry `cause`; no scope label. A flood's alerts on several rules
    and routers of one line reach the line owners as one notification, as the sidecar's own receiver sends them."""

    def own(alertname: str, cause: str, router: str) -> dict:
        sent = alert(alertname, "warning", "replica", cause=cause, router=router)
        del sent["labels"][SCOPE_LABEL]
        return sent

    bodies = notifications(
        [
            own("RoutingDrift", "traffic", "model.layers.1.mlp.gate"),
            own("ExpertHotspot", "traffic", "model.layers.3.mlp.gate"),
            own("RoutingDrift", "model", "model.layers.2.mlp.gate"),
        ],
        tmp_path,
    )
    routed = sorted(
        (body["path"], sorted((a["labels"]["alertname"], a["labels"]["cause"]) for a in body["alerts"]))
        for body in bodies
    )
    assert routed == [
        ("/alerts/line_owners", [("ExpertHotspot", "traffic"), ("RoutingDrift", "traffic")]),
        ("/alerts/oncall", [("RoutingDrift", "model")]),
    ]
