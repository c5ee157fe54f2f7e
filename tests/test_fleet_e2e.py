"""A fleet as operators run it: real Prometheus scrapes a live sidecar, evaluates the exported
rules, and real Alertmanager delivers the alert to a webhook receiver.

Prometheus, promtool and Alertmanager come from Debian's packages, which `.ci/run` installs.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from harness import processes
from harness.helpers import binary, running_tool
from harness.receivers import running_receiver
from harness.support import running_sidecar, wait_until
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.alerting.promexport import export_prometheus
from mla_watch.alerting.rules import load_rules_dir

pytestmark = pytest.mark.slow

RULES = entropy_low_rules(
    hold="1s",
    group_by=False,
    annotations={
        "summary": "Routing entropy {value:.2f} bits on {router} (layer {layer}, {business_line})",
        "runbook_url": "https://github.com/mla-watch/mla_watch/blob/main/docs/runbooks.md#routingentropylow",
    },
)


def json_bodies(receiver) -> list[dict]:
    return [request.json() for request in list(receiver.requests)]


def test_prometheus_scrapes_the_sidecar_and_alertmanager_pages_oncall(tmp_path: Path) -> None:
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "routing.yaml").write_text(RULES)
    exported = tmp_path / "mla_watch.rules.yml"
    exported.write_text(export_prometheus(load_rules_dir(rules_dir, environ={})))
    check = processes.run(
        [binary("promtool"), "check", "rules", str(exported)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr

    with running_receiver() as receiver, running_sidecar(rules=None) as (sidecar_url, sidecar), ExitStack() as tools:
        alertmanager = tools.enter_context(
            running_tool(
                "prometheus-alertmanager",
                tmp_path,
                (
                    "route:\n  receiver: oncall\n  group_by: [alertname, router, layer, business_line]\n"
                    "  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n"
                    f"receivers:\n  - name: oncall\n    webhook_configs:\n      - url: {receiver.url}/alerts\n"
                    "        send_resolved: true\n"
                ),
                "--cluster.listen-address=",
            )
        )
        sidecar_host = sidecar_url.removeprefix("http://")
        tools.enter_context(
            running_tool(
                "prometheus",
                tmp_path,
                (
                    "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    f"rule_files: [{exported}]\n"
                    "alerting:\n  alertmanagers:\n    - static_configs:\n"
                    f"        - targets: ['{alertmanager.removeprefix('http://')}']\n"
                    "scrape_configs:\n  - job_name: mla_watch\n    static_configs:\n"
                    f"      - targets: ['{sidecar_host}']\n"
                ),
            )
        )
        # A collapse: push layer 1's correction bias towards six experts.
        gate = sidecar.model_worker.model.model.layers[1].mlp.gate
        with torch.no_grad():
            gate.e_score_correction_bias[:6] += 10.0
        for _ in range(3):
            response = httpx.post(
                sidecar_url + "/v1/completions",
                timeout=120,
                json={"prompt": "def parse_invoice(", "max_tokens": 40},
                headers={"X-Business-Line": "code_assistant"},
            )
            assert response.status_code == 200

        def paged() -> bool:
            return any(
                alert["labels"].get("alertname") == "RoutingEntropyLow"
                and alert["labels"].get("router") == "model.layers.1.mlp.gate"
                and alert["labels"].get("business_line") == "code_assistant"
                and body.get("status") == "firing"
                for body in json_bodies(receiver)
                for alert in body.get("alerts", [])
            )

        assert wait_until(paged, timeout=90, interval=0.5), (tmp_path / "prometheus.log").read_text()[-2000:] + (
            tmp_path / "prometheus-alertmanager.log"
        ).read_text()[-2000:]
        body = next(b for b in json_bodies(receiver) if b.get("status") == "firing")
        assert body["version"] == "4" and body["receiver"] == "oncall"
        alert = body["alerts"][0]
        assert alert["labels"]["severity"] == "critical" and alert["labels"]["layer"] == "1"
        assert "Routing entropy" in alert["annotations"]["summary"]
        assert alert["annotations"]["runbook_url"].startswith("https://")
        healthy = [
            a
            for b in json_bodies(receiver)
            for a in b["alerts"]
            if a["labels"].get("router") != "model.layers.1.mlp.gate"
        ]
        assert not healthy  # the healthy layers never page
