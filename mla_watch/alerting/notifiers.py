"""Notifier plugins: turn a :class:`~mla_watch.alerting.vocabulary.Notification` into HTTP requests.

A notifier is chosen by the receiver's ``type:`` (:data:`NOTIFIER_TYPES`, filled by subclassing
:class:`Notifier`, the way APScheduler picks a trigger class by alias) and has one abstract
method, :meth:`Notifier.render`, which is pure: it builds :class:`OutgoingRequest` objects and
does no I/O. Sending, retrying and durability belong to :mod:`mla_watch.alerting.outbox`.

Types:

* ``alertmanager_webhook``: the Alertmanager webhook payload, version "4", one request per
  notification (group). Fingerprints are computed as Alertmanager computes them (Prometheus
  ``model.LabelSet.Fingerprint()``: FNV-1a 64 over the sorted label pairs), not with
  :func:`mla_watch.alerting.vocabulary.fingerprint`, which is the same FNV-1a 64.
* ``alertmanager_api``: ``POST {url}/api/v2/alerts`` with the alerts as an Alertmanager client
  (Prometheus) posts them; a firing alert's ``endsAt`` is ``now + 4 x resend_interval_seconds``
  so that it expires by itself when the sidecar dies. Re-posting firing alerts every
  ``resend_interval_seconds`` is the job of whoever holds the alert state (the engine submits
  the notification again); ``send_resolved`` is ignored here, since resolving is state.
* ``slack``: an incoming-webhook message with ``text`` and ``blocks``.
* ``pagerduty``: Events API v2, one request per alert, ``dedup_key`` = the alert's
  Alertmanager fingerprint (stable between trigger and resolve).

Secrets (the URL, which often carries a token, header values, the HMAC secret, the routing
key) are never logged nor put into exception messages; :func:`redact_url` shortens a URL to
``scheme://host/…`` for messages, and the ``repr`` of a request shows only that.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar
from urllib.parse import urlsplit

from mla_watch.alerting.vocabulary import Alert, Notification, Receiver
from mla_watch.alerting.vocabulary import fingerprint as am_fingerprint
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER

__all__ = [
    "NOTIFIER_TYPES",
    "SIGNATURE_HEADER",
    "ZERO_TIME",
    "AlertmanagerApiNotifier",
    "AlertmanagerWebhookNotifier",
    "Notifier",
    "OutgoingRequest",
    "PagerDutyNotifier",
    "SlackNotifier",
    "am_fingerprint",
    "format_time",
    "group_key",
    "notifier_for",
    "redact_url",
    "sign",
]

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-MLA-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
ZERO_TIME = "0001-01-01T00:00:00Z"  # what Alertmanager sends as endsAt of a firing alert
USER_AGENT = "mla-watch"


@dataclass(frozen=True)
class OutgoingRequest:
    """One HTTP POST, ready to be stored in the outbox and sent (possibly more than once)."""

    url: str = field(repr=False)
    body: bytes = field(repr=False)
    headers: Mapping[str, str] = field(repr=False)
    idempotency_key: str

    def __repr__(self) -> str:  # never show the URL's token or header values
        return (
            f"OutgoingRequest(url={redact_url(self.url)!r}, body=<{len(self.body)} bytes>, "
            f"headers=<{len(self.headers)}>, idempotency_key={self.idempotency_key!r})"
        )


def redact_url(url: str | None) -> str:
    """``scheme://host[:port]/…`` — the part of a URL that may appear in logs."""
    if not url:
        return "<no url>"
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme or '?'}://{host}{port}/…"


def sign(body: bytes, secret: str) -> str:
    """``sha256=`` + the hex HMAC-SHA256 of ``body`` under ``secret`` (the X-MLA-Signature value)."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def _go_quote(text: str) -> str:
    """Approximately Go's ``strconv.Quote`` (used by ``model.LabelSet.String()``)."""
    out = ['"']
    simple = {
        "\\": "\\\\",
        '"': '\\"',
        "\a": "\\a",
        "\b": "\\b",
        "\f": "\\f",
        "\n": "\\n",
        "\r": "\\r",
        "\t": "\\t",
        "\v": "\\v",
    }
    for ch in text:
        if ch in simple:
            out.append(simple[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def group_key(group_labels: Mapping[str, str], route_key: str = "{}") -> str:
    """Alertmanager's group key: ``'{}:{alertname="X", router="..."}'`` (labels sorted by name)."""
    pairs = ", ".join(f"{name}={_go_quote(str(group_labels[name]))}" for name in sorted(group_labels))
    return f"{route_key}:{{{pairs}}}"


def format_time(ts: float | None) -> str:
    """RFC 3339 in UTC with milliseconds and ``Z``: ``2026-11-29T08:01:02.345Z``; None -> the zero time."""
    if ts is None:
        return ZERO_TIME
    millis = round(float(ts) * 1000.0)
    seconds, ms = divmod(millis, 1000)
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + f".{ms:03d}Z"


def _common(maps: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """The pairs present with the same value in every mapping (empty for no mappings)."""
    maps = list(maps)
    if not maps:
        return {}
    first = maps[0]
    return {k: str(v) for k, v in sorted(first.items()) if all(k in m and m[k] == v for m in maps[1:])}


def _str_map(mapping: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in sorted(mapping.items())}


NOTIFIER_TYPES: dict[str, type[Notifier]] = {}


class Notifier(ABC):
    """Renders notifications for one receiver. Subclasses set ``type_name`` and register themselves."""

    type_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("type_name")
        if name:
            NOTIFIER_TYPES[name] = cls

    def __init__(self, receiver: Receiver, *, clock: Callable[[], float] = time.time) -> None:
        self.receiver = receiver
        self.clock = clock

    def __repr__(self) -> str:
        return f"{type(self).__name__}(receiver={self.receiver.name!r}, url={redact_url(self.receiver.url)})"

    @abstractmethod
    def render(self, notification: Notification) -> list[OutgoingRequest]:
        """The requests that deliver ``notification`` (pure; no I/O). Empty when nothing is to be sent."""

    # helpers for subclasses ---------------------------------------------------------------
    def _group_key(self, notification: Notification) -> str:
        return notification.group_key or group_key(notification.group_labels)

    def _request(self, url: str, payload: Any, idempotency_key: str) -> OutgoingRequest:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        headers: dict[str, str] = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            IDEMPOTENCY_HEADER: idempotency_key,
        }
        headers.update({str(k): str(v) for k, v in self.receiver.headers.items()})
        if self.receiver.hmac_secret:
            headers[SIGNATURE_HEADER] = sign(body, self.receiver.hmac_secret)
        return OutgoingRequest(url=url, body=body, headers=headers, idempotency_key=idempotency_key)

    def _alerts_to_send(self, notification: Notification) -> tuple[Alert, ...]:
        if self.receiver.send_resolved:
            return tuple(notification.alerts)
        return tuple(a for a in notification.alerts if a.status == "firing")

    def _disabled(self) -> bool:
        if self.receiver.url is None:
            log.debug("receiver %r has no URL (disabled); nothing rendered", self.receiver.name)
            return True
        return False


def _idempotency_key(gkey: str, status: str, alerts: Iterable[Alert]) -> str:
    """The group, its status and its alerts; an alert resolved in a group still firing is marked, so that the
    group's notification of that resolution is no duplicate of the one that said it fired."""
    marked = (
        am_fingerprint(a.labels) + (":resolved" if status == "firing" and a.status == "resolved" else "")
        for a in alerts
    )
    return f"{gkey}|{status}|{','.join(sorted(marked))}"


class AlertmanagerWebhookNotifier(Notifier):
    """Alertmanager's webhook payload, version "4" (one request per notification group)."""

    type_name = "alertmanager_webhook"

    def render(self, notification: Notification) -> list[OutgoingRequest]:
        if self._disabled():
            return []
        alerts = self._alerts_to_send(notification)
        if not alerts:
            return []
        status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
        gkey = self._group_key(notification)
        payload = {
            "version": "4",
            "groupKey": gkey,
            "truncatedAlerts": 0,
            "status": status,
            "receiver": self.receiver.name,
            "groupLabels": _str_map(notification.group_labels),
            "commonLabels": _common(_str_map(a.labels) for a in alerts),
            "commonAnnotations": _common(_str_map(a.annotations) for a in alerts),
            "externalURL": notification.external_url,
            "alerts": [
                {
                    "status": a.status,
                    "labels": _str_map(a.labels),
                    "annotations": _str_map(a.annotations),
                    "startsAt": format_time(a.starts_at),
                    "endsAt": format_time(_resolved_end(a, self.clock)) if a.status == "resolved" else ZERO_TIME,
                    "generatorURL": a.generator_url,
                    "fingerprint": am_fingerprint(a.labels),
                }
                for a in alerts
            ],
        }
        assert self.receiver.url is not None
        return [self._request(self.receiver.url, payload, _idempotency_key(gkey, status, alerts))]


def _resolved_end(alert: Alert, clock: Callable[[], float]) -> float:
    return alert.ends_at if alert.ends_at is not None else clock()


class AlertmanagerApiNotifier(Notifier):
    """``POST {url}/api/v2/alerts``, as Prometheus posts alerts to Alertmanager."""

    type_name = "alertmanager_api"
    PATH = "/api/v2/alerts"

    def endpoint(self) -> str:
        assert self.receiver.url is not None
        base = self.receiver.url.rstrip("/")
        return base if base.endswith(self.PATH) else base + self.PATH

    def render(self, notification: Notification) -> list[OutgoingRequest]:
        if self._disabled():
            return []
        alerts = tuple(notification.alerts)  # resolving is state, not a notification: always sent
        if not alerts:
            return []
        now = self.clock()
        horizon = 4.0 * float(self.receiver.resend_interval_seconds)
        payload = [
            {
                "labels": _str_map(a.labels),
                "annotations": _str_map(a.annotations),
                "startsAt": format_time(a.starts_at),
                "endsAt": format_time(now + horizon if a.status == "firing" else _resolved_end(a, self.clock)),
                "generatorURL": a.generator_url,
            }
            for a in alerts
        ]
        status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
        key = _idempotency_key(self._group_key(notification), status, alerts)
        return [self._request(self.endpoint(), payload, key)]


def _runbook(alert: Alert) -> str | None:
    for name in ("runbook_url", "runbook"):
        value = alert.annotations.get(name)
        if value:
            return str(value)
    return None


def _slack_escape(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fmt_value(value: float) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)


class SlackNotifier(Notifier):
    """A Slack incoming-webhook message: a ``text`` summary plus ``blocks`` per alert."""

    type_name = "slack"
    MAX_ALERT_BLOCKS = 20  # Slack allows 50 blocks per message

    def render(self, notification: Notification) -> list[OutgoingRequest]:
        if self._disabled():
            return []
        alerts = self._alerts_to_send(notification)
        if not alerts:
            return []
        firing = [a for a in alerts if a.status == "firing"]
        status = "firing" if firing else "resolved"
        gkey = self._group_key(notification)
        names = sorted({str(a.labels.get("alertname", "alert")) for a in alerts})
        head = f"[FIRING:{len(firing)}]" if firing else f"[RESOLVED:{len(alerts)}]"
        text = f"{head} {', '.join(names)}"
        if len(alerts) == 1:
            text += " — " + self._one_line(alerts[0])
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": text[:150], "emoji": False}},
        ]
        for alert in alerts[: self.MAX_ALERT_BLOCKS]:
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": self._alert_text(alert)}})
        if len(alerts) > self.MAX_ALERT_BLOCKS:
            blocks.append(
                {
                    "type": "context",
                    "elements": [
                        {"type": "mrkdwn", "text": f"… and {len(alerts) - self.MAX_ALERT_BLOCKS} more alerts"}
                    ],
                }
            )
        if notification.external_url:
            blocks.append(
                {
                    "type": "context",
                    "elements": [{"type": "mrkdwn", "text": f"<{notification.external_url}|mla_watch>"}],
                }
            )
        payload = {"text": text, "blocks": blocks}
        assert self.receiver.url is not None
        return [self._request(self.receiver.url, payload, _idempotency_key(gkey, status, alerts))]

    @staticmethod
    def _one_line(alert: Alert) -> str:
        labels = alert.labels
        bits = [f"{k} {labels[k]}" for k in (ROUTER, LAYER, BUSINESS_LINE) if labels.get(k) not in (None, "")]
        bits.append(f"value {_fmt_value(alert.value)}")
        return ", ".join(bits)

    @staticmethod
    def _alert_text(alert: Alert) -> str:
        labels = alert.labels
        state = "*FIRING*" if alert.status == "firing" else "*RESOLVED*"
        lines = [
            f"{state} *{_slack_escape(labels.get('alertname', 'alert'))}*"
            f" (severity: {_slack_escape(labels.get('severity', 'unknown'))})"
        ]
        summary = alert.annotations.get("summary") or alert.annotations.get("description")
        if summary:
            lines.append(_slack_escape(summary))
        for key, title in ((ROUTER, "Router"), (LAYER, "Layer"), (BUSINESS_LINE, "Business line")):
            if labels.get(key) not in (None, ""):
                lines.append(f"{title}: `{_slack_escape(labels[key])}`")
        lines.append(f"Value: {_fmt_value(alert.value)}")
        lines.append(f"Since: {format_time(alert.starts_at)}")
        if alert.status == "resolved":
            lines.append(f"Resolved at: {format_time(alert.ends_at)}")
        runbook = _runbook(alert)
        if runbook:
            lines.append(f"Runbook: <{runbook}>")
        if alert.generator_url:
            lines.append(f"<{alert.generator_url}|Source>")
        return "\n".join(lines)


_PD_SEVERITY = {
    "critical": "critical",
    "page": "critical",
    "fatal": "critical",
    "error": "error",
    "major": "error",
    "high": "error",
    "warning": "warning",
    "warn": "warning",
    "minor": "warning",
    "medium": "warning",
    "info": "info",
    "low": "info",
    "none": "info",
}


def pagerduty_severity(severity: str | None) -> str:
    """Map a rule severity onto PagerDuty's critical | error | warning | info (unknown -> warning)."""
    return _PD_SEVERITY.get(str(severity or "").strip().lower(), "warning")


class PagerDutyNotifier(Notifier):
    """PagerDuty Events API v2: one trigger/resolve event per alert, deduplicated by fingerprint."""

    type_name = "pagerduty"

    def __init__(self, receiver: Receiver, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(receiver, clock=clock)
        if not receiver.routing_key:
            raise ValueError(f"receiver {receiver.name!r} (type pagerduty) has no routing_key")

    def render(self, notification: Notification) -> list[OutgoingRequest]:
        if self._disabled():
            return []
        assert self.receiver.url is not None
        requests = []
        for alert in self._alerts_to_send(notification):
            dedup = am_fingerprint(alert.labels)
            action = "trigger" if alert.status == "firing" else "resolve"
            labels = _str_map(alert.labels)
            summary = f"{labels.get('alertname', 'alert')}: {SlackNotifier._one_line(alert)}"
            if alert.annotations.get("summary"):
                summary = f"{summary} — {alert.annotations['summary']}"
            payload: dict[str, Any] = {
                "routing_key": self.receiver.routing_key,
                "event_action": action,
                "dedup_key": dedup,
                "payload": {
                    "summary": summary[:1024],
                    "source": "mla_watch",
                    "severity": pagerduty_severity(labels.get("severity")),
                    "timestamp": format_time(alert.starts_at),
                    "component": labels.get(ROUTER, ""),
                    "group": labels.get(BUSINESS_LINE, ""),
                    "class": labels.get("alertname", ""),
                    "custom_details": {
                        "labels": labels,
                        "annotations": _str_map(alert.annotations),
                        "value": alert.value,
                    },
                },
                "client": "mla_watch",
            }
            if alert.generator_url:
                payload["client_url"] = alert.generator_url
            runbook = _runbook(alert)
            if runbook:
                payload["links"] = [{"href": runbook, "text": "Runbook"}]
            requests.append(self._request(self.receiver.url, payload, f"pagerduty|{dedup}|{action}"))
        return requests


def notifier_for(receiver: Receiver, *, clock: Callable[[], float] = time.time) -> Notifier:
    """The notifier plugin for ``receiver.type``; ValueError naming the receiver for an unknown type."""
    cls = NOTIFIER_TYPES.get(receiver.type)
    if cls is None:
        raise ValueError(
            f"receiver {receiver.name!r}: unknown type {receiver.type!r} (known: {', '.join(sorted(NOTIFIER_TYPES))})"
        )
    return cls(receiver, clock=clock)
