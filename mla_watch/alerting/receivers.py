"""Receivers in rule files: where notifications go, with secrets expanded from the environment and never echoed."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import cast

from mla_watch.alerting.durations import duration_key
from mla_watch.alerting.notifiers import NOTIFIER_TYPES, redact_url
from mla_watch.alerting.vocabulary import (
    DEFAULT_GROUP_BY,
    DEFAULT_GROUP_INTERVAL_SECONDS,
    DEFAULT_GROUP_WAIT_SECONDS,
    LABEL_NAME_RE,
    Receiver,
)
from mla_watch.common.yamlcheck import Checker
from mla_watch.routing.windows import NAME_RE, NAME_RULE

__all__ = ["PAGERDUTY_EVENTS_URL", "parse_receiver"]

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
_RECEIVER_KEYS = (
    "name",
    "type",
    "url",
    "headers",
    "hmac_secret",
    "routing_key",
    "timeout",
    "max_attempts",
    "group_by",
    "group_wait",
    "group_interval",
    "repeat_interval",
    "send_resolved",
    "resend_interval",
)
# Alertmanager's API takes alerts, not notifications: Alertmanager groups and waits itself (its route's group_wait).
_API_TYPE = "alertmanager_api"
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(text: str, environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """``text`` with ``${VAR}`` replaced from ``environ``; also the names of unset variables."""
    unset: list[str] = []

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            unset.append(name)
            return ""
        return environ[name]

    return _ENV_RE.sub(sub, text), unset


def _url_problem(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL with a host; ``None`` when it is one. Never echoes the URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        return "it does not parse as a URL"
    if parts.scheme not in ("http", "https"):
        return f"its scheme is {parts.scheme!r}" if parts.scheme else "it has no scheme"
    if not parts.hostname:
        return "it has no host"
    if any(c.isspace() for c in url):
        return "it contains whitespace"
    return None


def _secret_string(chk: Checker, path: str, raw: object, environ: Mapping[str, str], disabled: bool) -> str | None:
    """A secret value with ``${VAR}`` expanded; errors name the key and variables, never the value."""
    if not isinstance(raw, str) or not raw:
        what = "null" if raw is None else type(raw).__name__
        chk.add(
            path,
            f"{chk.label}: {path} = (a {what}, value hidden): expected a non-empty string "
            "(write ${VAR} to take it from the environment)",
        )
        return None
    value, unset = _expand(raw, environ)
    if unset:
        if disabled:
            return None
        names = ", ".join(unset)
        chk.add(
            path,
            f"{chk.label}: {path}: environment variable {names} is unset: expected it to be set "
            "(this secret is needed to send notifications)",
        )
        return None
    if not value:
        chk.add(path, f"{chk.label}: {path}: expands to an empty string: expected a non-empty secret")
        return None
    if "\n" in value or "\r" in value:
        chk.add(path, f"{chk.label}: {path}: contains a line break: expected a single-line value")
        return None
    return value


def parse_receiver(
    chk: Checker, path: str, raw: object, environ: Mapping[str, str], warnings: list[str]
) -> Receiver | None:
    data = chk.mapping(path, raw, _RECEIVER_KEYS, "a receiver with keys " + ", ".join(_RECEIVER_KEYS))
    if data is None:
        return None
    before = len(chk.errors)
    name = data.get("name")
    if "name" not in data:
        chk.missing(f"{path}.name", "a receiver name such as 'oncall'")
    elif not isinstance(name, str) or not NAME_RE.fullmatch(name):
        chk.bad(f"{path}.name", name, f"a name of {NAME_RULE}")
    shown = name if isinstance(name, str) else "?"

    rtype = data.get("type")
    if "type" not in data:
        chk.missing(f"{path}.type", "one of: " + ", ".join(NOTIFIER_TYPES))
    elif not isinstance(rtype, str) or rtype not in NOTIFIER_TYPES:
        chk.bad(f"{path}.type", rtype, "one of: " + ", ".join(NOTIFIER_TYPES))

    # url: ${VAR} unset -> the receiver is disabled (None) with a warning
    url: str | None = None
    disabled = False
    if "url" not in data or data["url"] is None:
        if rtype == "pagerduty":
            url = PAGERDUTY_EVENTS_URL
        else:
            chk.missing(f"{path}.url", "an http(s) URL, e.g. ${MLA_WATCH_ONCALL_URL} to take it from the environment")
    elif not isinstance(data["url"], str):
        chk.bad(f"{path}.url", data["url"], "an http(s) URL string")
    else:
        template = data["url"]
        expanded, unset = _expand(template, environ)
        from_env = bool(_ENV_RE.search(template))
        if unset:
            disabled = True
            warnings.append(
                f"{chk.label}: receiver {shown!r}: {', '.join(unset)} "
                f"{'is' if len(unset) == 1 else 'are'} unset; "
                "alerts are evaluated, exported and logged but not sent"
            )
        else:
            problem = _url_problem(expanded)
            if problem is not None:
                shown_url = template if from_env else repr(redact_url(template))
                source = " (expanded from the environment)" if from_env else ""
                chk.add(
                    f"{path}.url",
                    f"{chk.label}: {path}.url = {shown_url}{source}: expected an http:// or "
                    f"https:// URL with a host, but {problem}",
                )
            else:
                url = expanded

    headers: dict[str, str] = {}
    if data.get("headers") is not None:
        raw_headers = data["headers"]
        if not isinstance(raw_headers, dict):
            chk.add(
                f"{path}.headers",
                f"{chk.label}: {path}.headers = (a {type(raw_headers).__name__}, value hidden): "
                "expected a mapping of header name -> value",
            )
        else:
            for key, value in raw_headers.items():
                if not isinstance(key, str) or not re.match(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$", key):
                    chk.bad(f"{path}.headers", key, "an HTTP header name")
                    continue
                secret = _secret_string(chk, f"{path}.headers.{key}", value, environ, disabled)
                if secret is not None:
                    headers[key] = secret

    hmac_secret = None
    if data.get("hmac_secret") is not None:
        hmac_secret = _secret_string(chk, f"{path}.hmac_secret", data["hmac_secret"], environ, disabled)

    routing_key = None
    if "routing_key" in data:
        if rtype != "pagerduty":
            chk.add(
                f"{path}.routing_key",
                f"{chk.label}: {path}.routing_key = (value hidden): expected no "
                f"routing_key: it is only used by type pagerduty, not {rtype!r}",
            )
        else:
            routing_key = _secret_string(chk, f"{path}.routing_key", data["routing_key"], environ, disabled)
    elif rtype == "pagerduty":
        chk.missing(f"{path}.routing_key", "the PagerDuty Events v2 integration key, e.g. ${PAGERDUTY_ROUTING_KEY}")

    timeout = duration_key(chk, data, "timeout", path, 5.0, positive=True)
    repeat = duration_key(chk, data, "repeat_interval", path, 4 * 3600.0, positive=True)
    if "resend_interval" in data and rtype != _API_TYPE:
        chk.bad(
            f"{path}.resend_interval",
            data["resend_interval"],
            f"no resend_interval: it is only used by type {_API_TYPE}, not {rtype!r}",
        )
    resend = duration_key(chk, data, "resend_interval", path, 60.0, positive=True)
    for key in ("group_wait", "group_interval"):
        if key in data and rtype == _API_TYPE:
            chk.bad(
                f"{path}.{key}",
                data[key],
                f"no {key} for type {_API_TYPE}: Alertmanager groups the alerts posted to it (set {key} in its route)",
            )
    group_wait = duration_key(chk, data, "group_wait", path, DEFAULT_GROUP_WAIT_SECONDS)
    group_interval = duration_key(chk, data, "group_interval", path, DEFAULT_GROUP_INTERVAL_SECONDS)

    max_attempts = data.get("max_attempts", 12)
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        chk.bad(f"{path}.max_attempts", max_attempts, "an integer >= 1")
        max_attempts = 12

    group_by: tuple[str, ...] = DEFAULT_GROUP_BY
    if "group_by" in data:
        raw_group = data["group_by"]
        if not isinstance(raw_group, list) or not raw_group:
            chk.bad(f"{path}.group_by", raw_group, "a non-empty list of label names, e.g. [alertname, router]")
        else:
            for i, label in enumerate(raw_group):
                if not isinstance(label, str) or not LABEL_NAME_RE.fullmatch(label):
                    chk.bad(f"{path}.group_by[{i}]", label, "a label name (letters, digits, '_')")
            group_by = tuple(str(x) for x in raw_group)

    send_resolved = data.get("send_resolved", True)
    if not isinstance(send_resolved, bool):
        chk.bad(f"{path}.send_resolved", send_resolved, "true or false")
        send_resolved = True

    if len(chk.errors) != before:
        return None
    return Receiver(  # no error: name and type are checked strings
        name=cast(str, name),
        type=cast(str, rtype),
        url=url,
        headers=headers,
        hmac_secret=hmac_secret,
        routing_key=routing_key,
        timeout_seconds=timeout,
        max_attempts=max_attempts,
        group_by=group_by,
        repeat_interval_seconds=repeat,
        send_resolved=send_resolved,
        resend_interval_seconds=resend,
        source=f"{chk.label}: {path}",
        group_wait_seconds=group_wait,
        group_interval_seconds=group_interval,
    )
