"""The sidecar pages on-call itself: a router collapses, the webhook receives the alert, the
router recovers, the alert resolves; and notifications survive a SIGKILL of the sidecar."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from harness import processes
from harness.helpers import write_rules
from harness.receivers import running_receiver
from harness.support import free_port, get_metrics, metric_value, running_sidecar, wait_until

pytestmark = pytest.mark.slow

SUMMARY = "Routing entropy {value:.2f} bits on {router} (layer {layer}, {business_line}), below {threshold}"
ANNOTATIONS = {"summary": SUMMARY, "dashboard": "{status_url}"}


def traffic(url: str, requests: int, tokens: int = 60) -> None:
    for index in range(requests):
        response = httpx.post(
            url + "/v1/completions",
            timeout=120,
            headers={"X-Business-Line": "code_assistant"},
            json={"prompt": f"def parse_invoice_{index}(", "max_tokens": tokens, "seed": index},
        )
        assert response.status_code == 200, response.text


def webhook_alerts(receiver, status: str) -> list[dict]:
    return [
        alert for request in list(receiver.requests) for alert in request.json()["alerts"] if alert["status"] == status
    ]


def test_a_collapsed_router_pages_oncall_once_and_resolves(tmp_path, monkeypatch) -> None:
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        rules = write_rules(tmp_path / "rules", below=5.0, resolve_above=5.2, annotations=ANNOTATIONS)
        with running_sidecar(
            rules=rules,
            alert_interval=0.2,
            window_tokens=256,
            public_url="http://sidecar.test",
            state_dir=tmp_path / "state",
        ) as (url, sidecar):
            traffic(url, 3)
            sidecar.alerts.evaluate_once()
            assert webhook_alerts(receiver, "firing") == []  # healthy routing pages nobody

            gate = sidecar.model_worker.model.model.layers[1].mlp.gate
            healthy_bias = gate.e_score_correction_bias.clone()
            with torch.no_grad():
                gate.e_score_correction_bias[:6] += 10.0  # every token now picks the same six experts
            traffic(url, 6)

            def collapsed(status: str) -> list[dict]:
                return [
                    alert
                    for alert in webhook_alerts(receiver, status)
                    if alert["labels"]["router"] == "model.layers.1.mlp.gate"
                ]

            assert wait_until(lambda: collapsed("firing"), timeout=30)
            (alert,) = collapsed("firing")
            labels = alert["labels"]
            assert (labels["alertname"], labels["router"], labels["layer"], labels["business_line"]) == (
                "RoutingEntropyLow",
                "model.layers.1.mlp.gate",
                "1",
                "code_assistant",
            )
            summary = alert["annotations"]["summary"]
            # the cause first: the sidecar's reference prompts route differently too
            assert re.match(
                r"MODEL CHANGED: Routing entropy \d\.\d\d bits on model\.layers\.1\.mlp\.gate \(layer 1", summary
            ), summary
            assert alert["annotations"]["dashboard"].startswith("http://sidecar.test/#router=model.layers.1")
            body = next(r.json() for r in receiver.requests if r.json()["alerts"][0]["labels"]["layer"] == "1")
            assert body["version"] == "4" and body["groupKey"].startswith("{}:{")
            alerts = httpx.get(url + "/v1/alerts").json()["alerts"]
            assert [a["state"] for a in alerts if a["labels"]["router"] == "model.layers.1.mlp.gate"] == ["firing"]
            text = get_metrics(url)
            assert (
                metric_value(text, "mla_watch_alerts_firing", alertname="RoutingEntropyLow", severity="critical") == 1
            )
            assert metric_value(text, "mla_watch_notifications_total", receiver="oncall", outcome="delivered") >= 1

            traffic(url, 2)
            sidecar.alerts.evaluate_once()
            assert len(collapsed("firing")) == 1  # paged once, not on every evaluation
            (instance,) = [
                a
                for a in httpx.get(url + "/v1/alerts").json()["alerts"]
                if a["labels"]["router"] == "model.layers.1.mlp.gate"
            ]
            assert instance["value"] < 3.0  # the window now holds collapsed traffic only: log2 6 = 2.585

            with torch.no_grad():
                gate.e_score_correction_bias.copy_(healthy_bias)
            traffic(url, 8)  # enough tokens to roll the collapsed window out
            assert wait_until(lambda: collapsed("resolved"), timeout=30)
            (resolved,) = collapsed("resolved")
            assert resolved["fingerprint"] == alert["fingerprint"]
            assert resolved["endsAt"] > resolved["startsAt"]


def serve(port: int, rules: Path, state: Path, oncall: str) -> subprocess.Popen:
    env = {**os.environ, "MLA_WATCH_ONCALL_URL": oncall}
    return processes.start(
        [
            sys.executable,
            "-m",
            "mla_watch.cli",
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--rules",
            str(rules),
            "--state-dir",
            str(state),
            "--attn-implementation",
            "eager",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_ready(url: str, process: subprocess.Popen) -> None:
    def ready() -> bool:
        assert process.poll() is None, "the sidecar exited"
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(ready, timeout=120, interval=0.2)


def test_notifications_survive_a_sigkill_while_the_receiver_is_down(tmp_path) -> None:
    # A threshold healthy traffic breaches, so the alert fires without touching the model.
    rules = write_rules(tmp_path / "rules", below=6.5, resolve_above=6.6, annotations=ANNOTATIONS)
    state = tmp_path / "state"
    receiver_port, sidecar_port = free_port(), free_port()
    oncall = f"http://127.0.0.1:{receiver_port}/hook"  # nothing listens there yet: on-call's endpoint is down
    url = f"http://127.0.0.1:{sidecar_port}"

    first = serve(sidecar_port, rules, state, oncall)
    try:
        wait_ready(url, first)
        traffic(url, 3)
        # The alert fires at the next evaluation; its notification is written to the outbox first.
        assert wait_until(lambda: httpx.get(url + "/v1/alerts").json()["notifications_pending"] >= 1, timeout=60)
    finally:
        processes.stop(first, grace=0)  # SIGKILL: the crash the notifications must survive

    second = serve(sidecar_port, rules, state, oncall)
    try:
        wait_ready(url, second)
        firing = [a for a in httpx.get(url + "/v1/alerts").json()["alerts"] if a["state"] == "firing"]
        assert firing  # the restart remembered the alert instead of starting from nothing
        with running_receiver(port=receiver_port) as receiver:
            assert wait_until(lambda: len(receiver.requests) >= 1, timeout=90, interval=0.2)
            # a duplicate, if any, is sent before the outbox counts its notification delivered
            assert wait_until(lambda: httpx.get(url + "/v1/alerts").json()["notifications_pending"] == 0, timeout=90)
            bodies = [request.json() for request in receiver.requests]
        firing_keys = {body["groupKey"] for body in bodies if body["status"] == "firing"}
        assert firing_keys and all(body["status"] == "firing" for body in bodies)
        routers = {alert["labels"]["router"] for body in bodies for alert in body["alerts"]}
        assert routers <= {f["labels"]["router"] for f in firing}
        # every notification that arrived twice carries the same idempotency key
        assert len(firing_keys) == len({(b["groupKey"], tuple(a["fingerprint"] for a in b["alerts"])) for b in bodies})
    finally:
        processes.stop(second, grace=30)
