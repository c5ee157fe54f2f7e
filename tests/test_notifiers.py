"""Notifier plugins: payload formats (Alertmanager webhook v4 and API, Slack, PagerDuty), signing, secrets."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from datetime import datetime, timezone

import pytest

from harness.receivers import Reply, running_receiver, status
from mla_watch.alerting.notifiers import (
    NOTIFIER_TYPES,
    ZERO_TIME,
    AlertmanagerWebhookNotifier,
    Notifier,
    OutgoingRequest,
    am_fingerprint,
    format_time,
    group_key,
    notifier_for,
    redact_url,
    sign,
)
from mla_watch.alerting.outbox import Dispatcher, Outbox
from mla_watch.alerting.vocabulary import Alert, Notification, Receiver

T0 = datetime(2026, 11, 29, 8, 1, 2, 345000, tzinfo=timezone.utc).timestamp()
T1 = T0 + 600.0
SECRET_URL = "https://hooks.example.com/services/T000/B000/SUPERSECRETTOKEN123"
RUNBOOK = "https://runbooks.example.com/routing-entropy"


def make_alert(
    router: str = "model.layers.3.mlp.gate",
    layer: str = "3",
    *,
    status: str = "firing",
    value: float = 4.2,
    extra: dict | None = None,
    summary: str = "entropy low",
) -> Alert:
    labels = {
        "alertname": "RoutingEntropyLow",
        "severity": "critical",
        "router": router,
        "layer": layer,
        "kind": "expert",
        "business_line": "code_assistant",
        **(extra or {}),
    }
    return Alert(
        labels=labels,
        annotations={"summary": f"{summary} on {router}", "runbook_url": RUNBOOK},
        status=status,
        starts_at=T0,
        ends_at=T1 if status == "resolved" else None,
        value=value,
        generator_url="http://127.0.0.1:8000/v1/alerts",
    )


def make_notification(*alerts: Alert, receiver: str = "oncall") -> Notification:
    alerts = alerts or (make_alert(),)
    group_labels = {"alertname": "RoutingEntropyLow", "business_line": "code_assistant"}
    status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
    return Notification(
        receiver=receiver,
        group_key=group_key(group_labels),
        group_labels=group_labels,
        alerts=tuple(alerts),
        status=status,
        external_url="http://127.0.0.1:8000",
    )


def webhook(**kw) -> Receiver:
    return Receiver(
        name=kw.pop("name", "oncall"),
        type=kw.pop("type", "alertmanager_webhook"),
        url=kw.pop("url", "http://127.0.0.1:9/hook"),
        **kw,
    )


# -- fingerprints, keys, times ------------------------------------------------------------------


def test_fingerprint_hand_computed_vector():
    # {"a": "b"} hashes the bytes 61 ff 62 ff with FNV-1a 64, from the offset basis 0xcbf29ce484222325:
    h = 0xCBF29CE484222325
    for byte in (0x61, 0xFF, 0x62, 0xFF):
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    assert f"{h:016x}" == "d2b371819297f98a"  # written down once the loop above was worked through
    assert am_fingerprint({"a": "b"}) == "d2b371819297f98a"
    assert am_fingerprint({}) == "cbf29ce484222325"  # the empty label set is the offset basis


def test_fingerprint_matches_prometheus_upstream_vector():
    # prometheus/common model/signature_test.go TestMetricToFingerprint: 5799056148416392346
    labels = {"name": "garland, briggs", "fear": "love is not enough"}
    assert am_fingerprint(labels) == f"{5799056148416392346:016x}" == "507a62d79ee76c9a"
    assert am_fingerprint(dict(reversed(list(labels.items())))) == "507a62d79ee76c9a"  # order-free
    assert am_fingerprint({"a": "b", "c": "d"}) != am_fingerprint({"a": "bc", "": "d"})


def test_group_key_is_alertmanager_style():
    assert group_key({"router": "m.l.3", "alertname": "X"}) == '{}:{alertname="X", router="m.l.3"}'
    assert group_key({"a": 'q"uo\\te'}) == '{}:{a="q\\"uo\\\\te"}'
    assert group_key({}) == "{}:{}"


def test_format_time_rfc3339_utc_millis():
    assert format_time(T0) == "2026-11-29T08:01:02.345Z"
    assert format_time(None) == ZERO_TIME == "0001-01-01T00:00:00Z"


def test_a_new_notifier_is_a_receiver_type_rules_accept(tmp_path):
    from mla_watch.alerting.rules import RuleError, load_rules_dir

    (tmp_path / "r.yaml").write_text(
        "receivers:\n  - name: echo\n    type: echo_test\n    url: http://127.0.0.1:9/\n"
        "rules:\n  - alert: A\n    metric: entropy_bits\n    below: 1\n"
        "    receivers: [echo]\n"
    )
    with pytest.raises(RuleError, match="echo_test"):
        load_rules_dir(tmp_path, environ={})

    class EchoNotifier(Notifier):
        type_name = "echo_test"

        def render(self, notification):
            return []

    try:
        rules = load_rules_dir(tmp_path, environ={})
        assert rules.receivers["echo"].type == "echo_test"
        assert isinstance(notifier_for(rules.receivers["echo"]), EchoNotifier)
    finally:
        del NOTIFIER_TYPES["echo_test"]


def test_registry_and_unknown_type():
    assert isinstance(notifier_for(webhook()), AlertmanagerWebhookNotifier)
    with pytest.raises(ValueError) as err:
        notifier_for(webhook(name="teams", type="msteams", url=SECRET_URL))
    assert "teams" in str(err.value) and "msteams" in str(err.value)
    assert "SUPERSECRET" not in str(err.value)


# -- alertmanager webhook v4 ----------------------------------------------------------------------


def test_webhook_v4_fields():
    a1 = make_alert("model.layers.3.mlp.gate", "3")
    a2 = make_alert("model.layers.5.mlp.gate", "5", value=4.9)
    n = make_notification(a1, a2)
    [req] = notifier_for(webhook(url="http://127.0.0.1:9/hook")).render(n)
    assert req.url == "http://127.0.0.1:9/hook"
    assert req.headers["Content-Type"] == "application/json"
    body = json.loads(req.body)
    assert body["version"] == "4"
    assert body["groupKey"] == '{}:{alertname="RoutingEntropyLow", business_line="code_assistant"}'
    assert body["truncatedAlerts"] == 0
    assert body["status"] == "firing"
    assert body["receiver"] == "oncall"
    assert body["groupLabels"] == {"alertname": "RoutingEntropyLow", "business_line": "code_assistant"}
    # commonLabels: only what all alerts share (router and layer differ)
    assert body["commonLabels"] == {
        "alertname": "RoutingEntropyLow",
        "severity": "critical",
        "kind": "expert",
        "business_line": "code_assistant",
    }
    assert body["commonAnnotations"] == {"runbook_url": RUNBOOK}  # summaries differ
    assert body["externalURL"] == "http://127.0.0.1:8000"
    assert set(body) == {
        "version",
        "groupKey",
        "truncatedAlerts",
        "status",
        "receiver",
        "groupLabels",
        "commonLabels",
        "commonAnnotations",
        "externalURL",
        "alerts",
    }
    assert len(body["alerts"]) == 2
    first = body["alerts"][0]
    assert set(first) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
    assert first["status"] == "firing"
    assert first["labels"] == dict(a1.labels)
    for name in ("alertname", "severity", "router", "layer"):
        assert name in first["labels"]
    assert first["annotations"] == dict(a1.annotations)
    assert first["startsAt"] == "2026-11-29T08:01:02.345Z"
    assert first["endsAt"] == "0001-01-01T00:00:00Z"
    assert first["generatorURL"] == "http://127.0.0.1:8000/v1/alerts"
    assert first["fingerprint"] == am_fingerprint(a1.labels)
    assert len(first["fingerprint"]) == 16 and first["fingerprint"] == first["fingerprint"].lower()
    assert body["alerts"][1]["fingerprint"] != first["fingerprint"]
    fps = sorted([am_fingerprint(a1.labels), am_fingerprint(a2.labels)])
    assert req.idempotency_key == f"{body['groupKey']}|firing|{','.join(fps)}"
    assert req.headers["Idempotency-Key"] == req.idempotency_key


def test_webhook_resolved_and_common_labels_of_one():
    a = make_alert(status="resolved")
    [req] = notifier_for(webhook()).render(make_notification(a))
    body = json.loads(req.body)
    assert body["status"] == "resolved"
    assert body["alerts"][0]["status"] == "resolved"
    assert body["alerts"][0]["endsAt"] == format_time(T1) == "2026-11-29T08:11:02.345Z"
    assert body["commonLabels"] == dict(a.labels)  # one alert: all its labels are common
    firing_key = notifier_for(webhook()).render(make_notification(make_alert()))[0].idempotency_key
    assert req.idempotency_key != firing_key  # a resolve is a new notification, not a duplicate


def test_webhook_send_resolved_false_drops_resolved_alerts():
    r = webhook(send_resolved=False)
    assert notifier_for(r).render(make_notification(make_alert(status="resolved"))) == []
    [req] = notifier_for(r).render(make_notification(make_alert("r1"), make_alert("r2", status="resolved")))
    assert [a["labels"]["router"] for a in json.loads(req.body)["alerts"]] == ["r1"]


def test_disabled_receiver_renders_nothing():
    assert notifier_for(webhook(url=None)).render(make_notification()) == []


# -- alertmanager api ----------------------------------------------------------------------------


def test_alertmanager_api_ends_at_is_four_resend_intervals_ahead():
    now = T0 + 1000.0
    r = webhook(type="alertmanager_api", url="http://127.0.0.1:9093/", resend_interval_seconds=60.0)
    firing, resolved = make_alert("r1"), make_alert("r2", status="resolved")
    [req] = notifier_for(r, clock=lambda: now).render(make_notification(firing, resolved))
    assert req.url == "http://127.0.0.1:9093/api/v2/alerts"
    body = json.loads(req.body)
    assert isinstance(body, list) and len(body) == 2
    assert set(body[0]) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert body[0]["labels"] == dict(firing.labels)
    assert body[0]["startsAt"] == format_time(T0)
    assert body[0]["endsAt"] == format_time(now + 240.0)
    assert body[1]["endsAt"] == format_time(T1)
    r2 = webhook(type="alertmanager_api", url="http://127.0.0.1:9093/api/v2/alerts", resend_interval_seconds=5)
    [req2] = notifier_for(r2, clock=lambda: now).render(make_notification(firing))
    assert req2.url == "http://127.0.0.1:9093/api/v2/alerts"
    assert json.loads(req2.body)[0]["endsAt"] == format_time(now + 20.0)


# -- slack ----------------------------------------------------------------------------------------


def test_slack_message_is_readable_and_says_resolved():
    r = webhook(name="chat", type="slack", url=SECRET_URL)
    [req] = notifier_for(r).render(make_notification(make_alert(value=4.2133)))
    body = json.loads(req.body)
    assert set(body) == {"text", "blocks"}
    assert "RoutingEntropyLow" in body["text"] and "FIRING" in body["text"]
    blocks_text = json.dumps(body["blocks"])
    for needle in (
        "RoutingEntropyLow",
        "critical",
        "model.layers.3.mlp.gate",
        "Layer",
        "code_assistant",
        "4.213",
        RUNBOOK,
    ):
        assert needle in blocks_text, needle
    assert all(b["type"] in ("header", "section", "context") for b in body["blocks"])
    [res] = notifier_for(r).render(make_notification(make_alert(status="resolved")))
    rbody = json.loads(res.body)
    assert "RESOLVED" in rbody["text"] and "RESOLVED" in json.dumps(rbody["blocks"])
    assert "FIRING" not in rbody["text"]


# -- pagerduty ------------------------------------------------------------------------------------


def test_pagerduty_events_v2():
    r = webhook(name="pd", type="pagerduty", url="https://events.pagerduty.com/v2/enqueue", routing_key="R0UT1NGKEY")
    a1, a2 = make_alert("r1"), make_alert("r2", extra={"severity": "warning"})
    reqs = notifier_for(r).render(make_notification(a1, a2))
    assert len(reqs) == 2  # one event per alert
    b1, b2 = (json.loads(q.body) for q in reqs)
    assert b1["routing_key"] == "R0UT1NGKEY"
    assert b1["event_action"] == "trigger"
    assert b1["dedup_key"] == am_fingerprint(a1.labels)
    assert b1["payload"]["source"] == "mla_watch"
    assert b1["payload"]["severity"] == "critical" and b2["payload"]["severity"] == "warning"
    assert "RoutingEntropyLow" in b1["payload"]["summary"]
    details = b1["payload"]["custom_details"]
    assert details["labels"] == dict(a1.labels) and details["annotations"] == dict(a1.annotations)
    assert details["value"] == pytest.approx(4.2)
    assert b1["links"] == [{"href": RUNBOOK, "text": "Runbook"}]
    [resolve] = notifier_for(r).render(make_notification(make_alert("r1", status="resolved")))
    rb = json.loads(resolve.body)
    assert rb["event_action"] == "resolve"
    assert rb["dedup_key"] == b1["dedup_key"]  # stable across firing and resolved
    assert resolve.idempotency_key != reqs[0].idempotency_key


@pytest.mark.parametrize(
    "severity,expected",
    [("critical", "critical"), ("error", "error"), ("warning", "warning"), ("info", "info"), ("weird", "warning")],
)
def test_pagerduty_severity_mapping(severity, expected):
    r = webhook(type="pagerduty", routing_key="k")
    [req] = notifier_for(r).render(make_notification(make_alert(extra={"severity": severity})))
    assert json.loads(req.body)["payload"]["severity"] == expected


def test_pagerduty_without_routing_key_fails_at_construction():
    with pytest.raises(ValueError, match="pd-main"):
        notifier_for(webhook(name="pd-main", type="pagerduty", url=SECRET_URL))


# -- signing and secrets --------------------------------------------------------------------------


def test_sign_is_hmac_sha256():
    expected = hmac.new(b"k", b"body", hashlib.sha256).hexdigest()
    assert sign(b"body", "k") == "sha256=" + expected
    assert sign(b"body", "k2") != sign(b"body", "k")


def test_hmac_signature_verified_by_receiver(tmp_path):
    secret = "s3cr3t-hmac-key"
    verdicts: list[bool] = []

    def verify(received):
        mac = hmac.new(secret.encode(), received.body, hashlib.sha256).hexdigest()
        verdicts.append(hmac.compare_digest(received.header("X-MLA-Signature") or "", "sha256=" + mac))

    with running_receiver(on_request=verify) as rx:
        r = webhook(url=rx.url + "/hook", hmac_secret=secret)
        unsigned = webhook(name="plain", url=rx.url + "/plain")
        outbox = Outbox(tmp_path / "outbox.db")
        outbox.submit(r, make_notification())
        outbox.submit(unsigned, make_notification())
        assert Dispatcher(outbox, {"oncall": r, "plain": unsigned}).run_once() == 2
        assert rx.wait_for(2)
    by_path = {q.path: q for q in rx.requests}
    assert by_path["/plain"].header("X-MLA-Signature") is None
    assert by_path["/hook"].header("X-MLA-Signature") is not None
    assert verdicts.count(True) == 1  # the signed one verifies, the unsigned one does not
    assert json.loads(by_path["/hook"].body)["version"] == "4"


def test_secrets_absent_from_logs_reprs_and_errors(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    token, header_secret, hmac_secret = "SUPERSECRETTOKEN123", "Bearer HDRSECRET456", "HMACSECRET789"
    routing_key = "ROUTINGKEYSECRET000"
    secrets = (token, header_secret, "HDRSECRET456", hmac_secret, routing_key)
    # the receiver echoes the secrets of each request back in its error bodies
    echo_slack = Reply(status=500, body=f"bad {token} {header_secret}".encode())
    echo_pd = Reply(status=503, body=f"bad {token} {header_secret} routing_key={routing_key}".encode())
    now = [1000.0]
    with running_receiver([echo_slack, echo_pd], default=status(400)) as rx:
        url = f"{rx.url}/services/T000/B000/{token}"
        slack = webhook(
            name="chat", type="slack", url=url, headers={"Authorization": header_secret}, hmac_secret=hmac_secret
        )
        pd = webhook(
            name="pd", type="pagerduty", url=url, routing_key=routing_key, headers={"Authorization": header_secret}
        )
        outbox = Outbox(tmp_path / "outbox.db", clock=lambda: now[0])
        outbox.submit(slack, make_notification())
        outbox.submit(pd, make_notification())
        dispatcher = Dispatcher(outbox, {"chat": slack, "pd": pd}, base_delay=0.0)
        for _ in range(3):
            dispatcher.run_once()
            now[0] += 10.0
        assert outbox.pending() == 0
        dead = outbox.dead_letters()
        assert [q.reply.status for q in rx.requests] == [500, 503, 400, 400]
    assert len(dead) == 2
    texts = [caplog.text, repr(notifier_for(slack)), repr(notifier_for(pd).render(make_notification())[0])]
    texts += [d["error"] + " " + d["url"] for d in dead]
    with pytest.raises(ValueError) as err:
        Outbox(tmp_path / "o2.db").enqueue("x", OutgoingRequest(f"ftp://h/{token}", b"", {}, "k"))
    texts.append(str(err.value))
    assert "500" in caplog.text and "400" in caplog.text  # the failures were logged ...
    for text in texts:
        for secret in secrets:
            assert secret not in text, (secret, text)  # ... without a secret in them
    assert redact_url(url) == rx.url + "/…"
