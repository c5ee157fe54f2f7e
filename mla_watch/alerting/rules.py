"""Alert rules and receivers from YAML (``rules/*.yaml``), and the rule linter.

A rules file has two optional top-level keys, ``receivers`` and ``rules``::

    receivers:
      - name: oncall
        type: alertmanager_webhook      # alertmanager_webhook | alertmanager_api | slack | pagerduty
        url: ${MLA_WATCH_ONCALL_URL}    # ${VAR} is expanded from the environment
        headers: {Authorization: "Bearer ${ONCALL_TOKEN}"}
        timeout: 5s
    rules:
      - alert: RoutingEntropyLow
        metric: entropy_bits
        select: {kind: expert, layers: [0, 60], router: "*.mlp.gate", business_line: "*"}
        below: 5.0
        resolve_above: 5.2
        for: 2m
        severity: critical
        actions: [notify, retune]
        annotations: {summary: "{value:.2f} bits on {router}"}

Loading validates everything and raises :class:`RuleError` listing *every* problem, each
message naming the file, the key path, the offending value and what was expected.  Secret
values (header values, ``hmac_secret``, ``routing_key``, and anything expanded from the
environment) never appear in errors or warnings.

:func:`lint` checks rules against a model's routers: rules that can never fire or always
fire given the metric's true range on that router, minimum windows too small to trust,
and selectors that match no router.

No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import string
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mla_watch.alerting.model import (
    ACTIONS,
    METRICS,
    TEMPLATE_FIELDS,
    Receiver,
    Rule,
    RuleSet,
    Selector,
)
from mla_watch.alerting.notifiers import NOTIFIER_TYPES
from mla_watch.config import ConfigError, config_files
from mla_watch.routing import entropy_bounds, minimum_window_tokens
from mla_watch.windows import RouterInfo
from mla_watch.yamlcheck import Checker as _Checker
from mla_watch.yamlcheck import fmt as _fmt
from mla_watch.yamlcheck import is_number as _is_number
from mla_watch.yamlcheck import read_yaml

__all__ = [
    "RETUNE_STRATEGIES",
    "SEVERITIES",
    "LintFinding",
    "RuleError",
    "lint",
    "load_rules_dir",
    "load_rules_file",
    "parse_duration",
    "render_annotations",
]

SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
RETUNE_STRATEGIES: tuple[str, ...] = ("bias", "router_finetune", "restore")
PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
RESERVED_LABELS: tuple[str, ...] = ("alertname", "severity", "router", "layer", "kind", "business_line")

_TOP_KEYS = ("receivers", "rules")
_RULE_KEYS = ("alert", "metric", "select", "below", "above", "resolve_above", "resolve_below", "for",
              "keep_firing_for", "min_tokens", "severity", "actions", "retune_strategy", "labels", "annotations",
              "receivers")
_SELECT_KEYS = ("kind", "layers", "router", "business_line")
_RECEIVER_KEYS = ("name", "type", "url", "headers", "hmac_secret", "routing_key", "timeout", "max_attempts",
                  "group_by", "repeat_interval", "send_resolved", "resend_interval")
_KINDS = ("expert", "indexer")
_ALERT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

_DURATION_UNITS: tuple[tuple[str, float], ...] = (
    ("w", 7 * 86400.0), ("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001),
)
_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)w)?(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?"
                          r"(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?$")
_DURATION_HINT = "a duration such as 30s, 2m, 1h or 1h30m (units ms, s, m, h, d, w), or a number of seconds, >= 0"


# --------------------------------------------------------------------------- errors and formatting


class RuleError(ConfigError):
    """The rule configuration is invalid; ``errors`` holds one complete message per problem."""

    what = "alert rules"


def _num(x: float) -> str:
    """A threshold as people write it: 5.0 -> '5', 6.5 -> '6.5'."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


# --------------------------------------------------------------------------- durations


def parse_duration(text: str | int | float, where: str) -> float:
    """Seconds in a duration: ``"30s"``, ``"2m"``, ``"1h"``, ``"1h30m"``, ``"500ms"``; bare numbers are seconds.

    Raises :class:`RuleError` naming ``where`` for anything else, including negative durations.
    """
    if _is_number(text):
        value = float(text)  # type: ignore[arg-type]
        if not math.isfinite(value):
            raise RuleError([f"{where} = {_fmt(text)}: expected a finite {_DURATION_HINT}"])
        if value < 0:
            raise RuleError([f"{where} = {_fmt(text)}: expected a non-negative duration ({_DURATION_HINT})"])
        return value
    if not isinstance(text, str):
        raise RuleError([f"{where} = {_fmt(text)}: expected {_DURATION_HINT}"])
    raw = text.strip()
    if raw.startswith("-"):
        raise RuleError([f"{where} = {_fmt(text)}: expected a non-negative duration ({_DURATION_HINT})"])
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
        raise RuleError([f"{where} = {_fmt(text)}: expected a finite {_DURATION_HINT}"])
    match = _DURATION_RE.match(raw)
    if not raw or match is None or not any(match.groups()):
        raise RuleError([f"{where} = {_fmt(text)}: expected {_DURATION_HINT}, largest unit first"])
    return sum(float(part) * scale for part, (_, scale) in zip(match.groups(), _DURATION_UNITS, strict=True) if part)


def format_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``"2m"``, ``"1h30m"``, ``"0s"``), to the millisecond."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    parts = []
    for unit, scale in _DURATION_UNITS:
        size = round(scale * 1000)
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


# --------------------------------------------------------------------------- YAML


def _read_yaml(path: Path, label: str) -> Any:
    return read_yaml(path, label, RuleError, may_hold_secrets=True)


# --------------------------------------------------------------------------- receivers


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


def _redact_url(url: str) -> str:
    """``url`` as it may appear in a message: scheme, host and port only (paths of webhook URLs are secrets)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "(an unparseable URL, value hidden)"
    rest = "/..." if parts.path.strip("/") or parts.query or parts.fragment else ""
    shown = f"{parts.scheme}://{host}{port}{rest}" if parts.scheme else f"{host}{port}{rest}" or "..."
    return repr(shown)


def _secret_string(chk: _Checker, path: str, raw: object, environ: Mapping[str, str],
                   disabled: bool) -> str | None:
    """A secret value with ``${VAR}`` expanded; errors name the key and variables, never the value."""
    if not isinstance(raw, str) or not raw:
        what = "null" if raw is None else type(raw).__name__
        chk.errors.append(f"{chk.label}: {path} = (a {what}, value hidden): expected a non-empty string "
                          "(write ${VAR} to take it from the environment)")
        return None
    value, unset = _expand(raw, environ)
    if unset:
        if disabled:
            return None
        names = ", ".join(unset)
        chk.errors.append(f"{chk.label}: {path}: environment variable {names} is unset: expected it to be set "
                          "(this secret is needed to send notifications)")
        return None
    if not value:
        chk.errors.append(f"{chk.label}: {path}: expands to an empty string: expected a non-empty secret")
        return None
    if "\n" in value or "\r" in value:
        chk.errors.append(f"{chk.label}: {path}: contains a line break: expected a single-line value")
        return None
    return value


def _duration_key(chk: _Checker, data: Mapping[str, Any], key: str, path: str, default: float,
                  positive: bool = False) -> float:
    if key not in data or data[key] is None:
        return default
    try:
        value = parse_duration(data[key], f"{chk.label}: {path}.{key}")
    except RuleError as exc:
        chk.errors.extend(exc.errors)
        return default
    if positive and value <= 0:
        chk.bad(f"{path}.{key}", data[key], "a duration > 0")
        return default
    return value


def _parse_receiver(chk: _Checker, path: str, raw: object, environ: Mapping[str, str],
                    warnings: list[str]) -> Receiver | None:
    data = chk.mapping(path, raw, _RECEIVER_KEYS, "a receiver with keys " + ", ".join(_RECEIVER_KEYS))
    if data is None:
        return None
    before = len(chk.errors)
    name = data.get("name")
    if "name" not in data:
        chk.missing(f"{path}.name", "a receiver name such as 'oncall'")
    elif not isinstance(name, str) or not _NAME_RE.match(name):
        chk.bad(f"{path}.name", name, "a name of letters, digits, '_', '.', '-' (starting with a letter or digit)")
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
            warnings.append(f"{chk.label}: receiver {shown!r}: {', '.join(unset)} "
                            f"{'is' if len(unset) == 1 else 'are'} unset; "
                            "alerts are evaluated, exported and logged but not sent")
        else:
            problem = _url_problem(expanded)
            if problem is not None:
                shown_url = template if from_env else _redact_url(template)
                source = " (expanded from the environment)" if from_env else ""
                chk.errors.append(f"{chk.label}: {path}.url = {shown_url}{source}: expected an http:// or https:// "
                                  f"URL with a host, but {problem}")
            else:
                url = expanded

    headers: dict[str, str] = {}
    if data.get("headers") is not None:
        raw_headers = data["headers"]
        if not isinstance(raw_headers, dict):
            chk.errors.append(f"{chk.label}: {path}.headers = (a {type(raw_headers).__name__}, value hidden): "
                              "expected a mapping of header name -> value")
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
            chk.errors.append(f"{chk.label}: {path}.routing_key = (value hidden): expected no routing_key: "
                              f"it is only used by type pagerduty, not {rtype!r}")
        else:
            routing_key = _secret_string(chk, f"{path}.routing_key", data["routing_key"], environ, disabled)
    elif rtype == "pagerduty":
        chk.missing(f"{path}.routing_key", "the PagerDuty Events v2 integration key, e.g. ${PAGERDUTY_ROUTING_KEY}")

    timeout = _duration_key(chk, data, "timeout", path, 5.0, positive=True)
    repeat = _duration_key(chk, data, "repeat_interval", path, 4 * 3600.0, positive=True)
    if "resend_interval" in data and rtype != "alertmanager_api":
        chk.bad(f"{path}.resend_interval", data["resend_interval"],
                f"no resend_interval: it is only used by type alertmanager_api, not {rtype!r}")
    resend = _duration_key(chk, data, "resend_interval", path, 60.0, positive=True)

    max_attempts = data.get("max_attempts", 12)
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        chk.bad(f"{path}.max_attempts", max_attempts, "an integer >= 1")
        max_attempts = 12

    group_by: tuple[str, ...] = ("alertname", "router", "layer", "business_line")
    if "group_by" in data:
        raw_group = data["group_by"]
        if not isinstance(raw_group, list) or not raw_group:
            chk.bad(f"{path}.group_by", raw_group, "a non-empty list of label names, e.g. [alertname, router]")
        else:
            for i, label in enumerate(raw_group):
                if not isinstance(label, str) or not _LABEL_RE.match(label):
                    chk.bad(f"{path}.group_by[{i}]", label, "a label name (letters, digits, '_')")
            group_by = tuple(str(x) for x in raw_group)

    send_resolved = data.get("send_resolved", True)
    if not isinstance(send_resolved, bool):
        chk.bad(f"{path}.send_resolved", send_resolved, "true or false")
        send_resolved = True

    if len(chk.errors) != before:
        return None
    return Receiver(
        name=name,
        type=rtype,
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
    )


# --------------------------------------------------------------------------- templates

_SAMPLE_FIELDS: dict[str, object] = {
    "alertname": "RoutingEntropyLow", "metric": "entropy_bits", "value": 4.5, "threshold": 5.0,
    "resolve_threshold": 5.2, "router": "model.layers.1.mlp.gate", "layer": 1, "kind": "expert",
    "business_line": "code_assistant", "floor_bits": 2.585, "ceiling_bits": 6.0, "tokens": 4096,
    "min_tokens": 152, "severity": "critical", "status_url": "http://127.0.0.1:8000/v1/routing",
}


def _template_problem(template: str) -> str | None:
    """Why ``template`` is not a valid annotation template; ``None`` when it is."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"a str.format template ({exc}; write {{{{ and }}}} for literal braces)"
    for _, field_name, spec, _ in parsed:
        if field_name is None:
            continue
        if field_name == "" or field_name.isdigit():
            return "named fields such as {router}; positional fields {} are not allowed"
        if field_name not in TEMPLATE_FIELDS:
            base = re.split(r"[.\[]", field_name, maxsplit=1)[0]
            if base in TEMPLATE_FIELDS:
                return f"plain fields: {{{field_name}}} uses attribute or index access"
            hint = difflib.get_close_matches(field_name, TEMPLATE_FIELDS, n=1)
            mean = f" (did you mean {{{hint[0]}}}?)" if hint else ""
            return f"fields from: {', '.join(TEMPLATE_FIELDS)}; {{{field_name}}} is unknown{mean}"
        if spec and "{" in spec:
            return f"a literal format spec; {{{field_name}:{spec}}} nests a field"
    try:
        template.format_map(_SAMPLE_FIELDS)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return f"a format spec that suits each field ({exc})"
    return None


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "n/a"


class _LenientFormatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return "n/a"
        try:
            return format(value, format_spec)
        except (ValueError, TypeError):
            return str(value)


def render_annotations(rule: Rule, fields: Mapping[str, object]) -> dict[str, str]:
    """Each of ``rule.annotations`` rendered with ``str.format_map`` over ``fields`` (TEMPLATE_FIELDS).

    ``alertname``, ``metric``, ``severity``, ``threshold``, ``resolve_threshold`` and ``min_tokens``
    default to the rule's own values. A missing or ``None`` field renders as ``n/a``; a format spec
    that does not suit the value (``{value:.2f}`` with text) falls back to ``str(value)``: an alert
    is never lost to a template.
    """
    threshold = rule.below if rule.below is not None else rule.above
    resolve = rule.resolve_above if rule.below is not None else rule.resolve_below
    defaults: dict[str, object] = {
        "alertname": rule.name, "metric": rule.metric, "severity": rule.severity, "threshold": threshold,
        "resolve_threshold": resolve if resolve is not None else threshold, "min_tokens": rule.min_tokens,
    }
    values = _Fields({**defaults, **{k: v for k, v in fields.items() if v is not None or k not in defaults}})
    formatter = _LenientFormatter()
    out: dict[str, str] = {}
    for key, template in rule.annotations.items():
        try:
            out[key] = formatter.vformat(template, (), values)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            out[key] = template
    return out


# --------------------------------------------------------------------------- rules


def _number_key(chk: _Checker, data: Mapping[str, Any], key: str, path: str) -> float | None:
    if key not in data or data[key] is None:
        return None
    value = data[key]
    if not _is_number(value):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = " (YAML reads this as text; write it unquoted)"
            except ValueError:
                pass
        chk.bad(f"{path}.{key}", value, f"a number{hint}")
        return None
    if not math.isfinite(value):
        chk.bad(f"{path}.{key}", value, "a finite number")
        return None
    return float(value)


def _names_list(chk: _Checker, path: str, raw: object, allowed: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        chk.bad(path, raw, f"a non-empty list of {what}")
        return ()
    out: list[str] = []
    for i, item in enumerate(items):
        if allowed is not None and item not in allowed:
            chk.bad(f"{path}[{i}]", item, "one of: " + ", ".join(allowed))
        elif allowed is None and (not isinstance(item, str) or not _NAME_RE.match(item)):
            chk.bad(f"{path}[{i}]", item, f"one of the {what}")
        elif item in out:
            chk.bad(f"{path}[{i}]", item, f"each of the {what} once")
        else:
            out.append(item)
    return tuple(out)


def _parse_selector(chk: _Checker, path: str, raw: object) -> Selector:
    if raw is None:
        return Selector()
    data = chk.mapping(path, raw, _SELECT_KEYS, "with keys " + ", ".join(_SELECT_KEYS))
    if data is None:
        return Selector()
    kind = data.get("kind")
    if kind is not None and kind not in _KINDS:
        chk.bad(f"{path}.kind", kind, "one of: expert, indexer (any other kind matches no router)")
        kind = None
    layers = None
    raw_layers = data.get("layers")
    if raw_layers is not None:
        if isinstance(raw_layers, int) and not isinstance(raw_layers, bool):
            raw_layers = [raw_layers, raw_layers]
        if (not isinstance(raw_layers, list) or len(raw_layers) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw_layers)):
            chk.bad(f"{path}.layers", raw_layers, "[first, last]: two integers, an inclusive range of layer indices")
        elif raw_layers[0] > raw_layers[1]:
            chk.bad(f"{path}.layers", raw_layers,
                    f"[first, last] with first <= last; [{raw_layers[0]}, {raw_layers[1]}] matches no layer")
        elif raw_layers[1] < -1:
            chk.bad(f"{path}.layers", raw_layers, "a range that includes layers >= -1; it matches no layer")
        else:
            layers = (raw_layers[0], raw_layers[1])
    router = data.get("router")
    if router is not None:
        if not isinstance(router, str) or not router:
            chk.bad(f"{path}.router", router, "a glob over router module names, e.g. '*.mlp.gate'")
            router = None
        elif router == "*":
            router = None
        elif router.count("[") != router.count("]"):
            chk.bad(f"{path}.router", router, "a glob with balanced [ ] brackets")
            router = None
    line = data.get("business_line")
    if line is not None and (not isinstance(line, str) or not (line == "*" or _NAME_RE.match(line))):
        chk.bad(f"{path}.business_line", line, "a business line name or '*' (every line, one alert per line)")
        line = None
    return Selector(kind=kind, layers=layers, router=router, business_line=line)


def _parse_rule(chk: _Checker, index: int, raw: object) -> Rule | None:
    path = f"rules[{index}]"
    data = chk.mapping(path, raw, _RULE_KEYS, "a rule with keys " + ", ".join(_RULE_KEYS))
    if data is None:
        return None
    before = len(chk.errors)

    name = data.get("alert")
    if "alert" not in data:
        chk.missing(f"{path}.alert", "the alert name, e.g. RoutingEntropyLow")
    elif not isinstance(name, str) or not _ALERT_RE.match(name):
        chk.bad(f"{path}.alert", name, "an alert name matching ^[A-Za-z_][A-Za-z0-9_]*$")

    metric = data.get("metric")
    if "metric" not in data:
        chk.missing(f"{path}.metric", "one of: " + ", ".join(METRICS))
    elif metric not in METRICS:
        chk.bad(f"{path}.metric", metric, "one of: " + ", ".join(METRICS))

    selector = _parse_selector(chk, f"{path}.select", data.get("select"))

    below = _number_key(chk, data, "below", path)
    above = _number_key(chk, data, "above", path)
    resolve_above = _number_key(chk, data, "resolve_above", path)
    resolve_below = _number_key(chk, data, "resolve_below", path)
    if data.get("below") is None and data.get("above") is None:
        chk.missing(f"{path}.below", "a threshold: below and/or above (a number)")
    if below is not None and above is not None and not below < above:
        chk.bad(f"{path}.below", below, f"a value < above ({_num(above)}); otherwise every value is out of band")
    if "resolve_above" in data and data.get("below") is None:
        chk.bad(f"{path}.resolve_above", data["resolve_above"], "no resolve_above without below (it is the "
                "hysteresis of a 'below' rule; an 'above' rule uses resolve_below)")
    elif resolve_above is not None and below is not None:
        if resolve_above < below:
            chk.bad(f"{path}.resolve_above", resolve_above, f"a value >= below ({_num(below)})")
        elif above is not None and resolve_above > above:
            chk.bad(f"{path}.resolve_above", resolve_above, f"a value <= above ({_num(above)})")
    if "resolve_below" in data and data.get("above") is None:
        chk.bad(f"{path}.resolve_below", data["resolve_below"], "no resolve_below without above (it is the "
                "hysteresis of an 'above' rule; a 'below' rule uses resolve_above)")
    elif resolve_below is not None and above is not None:
        if resolve_below > above:
            chk.bad(f"{path}.resolve_below", resolve_below, f"a value <= above ({_num(above)})")
        elif below is not None and resolve_below < below:
            chk.bad(f"{path}.resolve_below", resolve_below, f"a value >= below ({_num(below)})")

    for_seconds = _duration_key(chk, data, "for", path, 0.0)
    keep_seconds = _duration_key(chk, data, "keep_firing_for", path, 0.0)

    min_tokens = data.get("min_tokens")
    if min_tokens is not None and (not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 1):
        chk.bad(f"{path}.min_tokens", min_tokens, "an integer >= 1 (or leave it out for the router's own minimum)")
        min_tokens = None

    severity = data.get("severity", "warning")
    if severity not in SEVERITIES:
        chk.bad(f"{path}.severity", severity, "one of: " + ", ".join(SEVERITIES))

    actions: tuple[str, ...] = ("notify",)
    if "actions" in data:
        actions = _names_list(chk, f"{path}.actions", data["actions"], ACTIONS, "actions")

    strategies: tuple[str, ...] = ()
    if data.get("retune_strategy") is not None:
        if "retune" not in actions:
            chk.bad(f"{path}.retune_strategy", data["retune_strategy"],
                    "no retune_strategy unless actions include retune")
        else:
            strategies = _names_list(chk, f"{path}.retune_strategy", data["retune_strategy"], RETUNE_STRATEGIES,
                                     "re-tune strategies")

    labels: dict[str, str] = {}
    if data.get("labels") is not None:
        raw_labels = chk.mapping(f"{path}.labels", data["labels"], None, "label name -> text")
        for key, value in (raw_labels or {}).items():
            if not isinstance(key, str) or not _LABEL_RE.match(key) or key.startswith("__"):
                chk.bad(f"{path}.labels", key, "label names of letters, digits and '_' (not starting with '__')")
            elif key in RESERVED_LABELS:
                chk.bad(f"{path}.labels.{key}", value, "no override of a label the engine sets: "
                        + ", ".join(RESERVED_LABELS) + " (use severity: for the severity)")
            elif not isinstance(value, str):
                chk.bad(f"{path}.labels.{key}", value, "a string (quote it)")
            else:
                labels[key] = value

    annotations: dict[str, str] = {}
    if data.get("annotations") is not None:
        raw_ann = chk.mapping(f"{path}.annotations", data["annotations"], None, "annotation name -> template")
        for key, value in (raw_ann or {}).items():
            if not isinstance(key, str) or not _LABEL_RE.match(key):
                chk.bad(f"{path}.annotations", key, "annotation names of letters, digits and '_'")
            elif not isinstance(value, str):
                chk.bad(f"{path}.annotations.{key}", value, "a string template")
            else:
                problem = _template_problem(value)
                if problem is not None:
                    chk.bad(f"{path}.annotations.{key}", value, problem)
                else:
                    annotations[key] = value

    receivers: tuple[str, ...] = ("oncall",) if "notify" in actions else ()
    if "receivers" in data:
        raw_receivers = data["receivers"]
        if raw_receivers in (None, []) and "notify" not in actions:
            receivers = ()
        else:
            receivers = _names_list(chk, f"{path}.receivers", raw_receivers, None, "receiver names")

    if len(chk.errors) != before:
        return None
    return Rule(
        name=name,
        metric=metric,
        selector=selector,
        below=below,
        above=above,
        resolve_above=resolve_above,
        resolve_below=resolve_below,
        for_seconds=for_seconds,
        keep_firing_for_seconds=keep_seconds,
        min_tokens=min_tokens,
        severity=severity,
        actions=actions,
        retune_strategies=strategies,
        labels=labels,
        annotations=annotations,
        receivers=receivers,
        source=f"{chk.label}: {path}",
    )


def load_rules_file(
    path: Path, *, environ: Mapping[str, str] = os.environ
) -> tuple[list[Rule], dict[str, Receiver], list[str]]:
    """Load and validate one rules file: ``(rules, receivers by name, warnings)``.

    Raises :class:`RuleError` listing every problem in the file. Receivers named by rules
    are checked by :func:`load_rules_dir` (they may live in another file).
    """
    path = Path(path)
    chk = _Checker(str(path))
    data = _read_yaml(path, chk.label)
    if data is None:
        return [], {}, []
    if not isinstance(data, dict):
        raise RuleError([f"{chk.label}: (top level) = {_fmt(data)}: expected a mapping with keys receivers, rules"])
    for key in data:
        if key not in _TOP_KEYS:
            chk.unknown_key("", key, _TOP_KEYS)

    warnings: list[str] = []
    receivers: dict[str, Receiver] = {}
    raw_receivers = data.get("receivers")
    if raw_receivers is not None:
        if not isinstance(raw_receivers, list):
            chk.bad("receivers", raw_receivers, "a list of receivers")
        else:
            for i, raw in enumerate(raw_receivers):
                receiver = _parse_receiver(chk, f"receivers[{i}]", raw, environ, warnings)
                if receiver is None:
                    continue
                if receiver.name in receivers:
                    chk.bad(f"receivers[{i}].name", receiver.name, "a receiver name used once")
                    continue
                receivers[receiver.name] = receiver

    rules: list[Rule] = []
    raw_rules = data.get("rules")
    if raw_rules is not None:
        if not isinstance(raw_rules, list):
            chk.bad("rules", raw_rules, "a list of rules")
        else:
            seen: set[str] = set()
            for i, raw in enumerate(raw_rules):
                rule = _parse_rule(chk, i, raw)
                if rule is None:
                    continue
                if rule.name in seen:
                    chk.bad(f"rules[{i}].alert", rule.name, "an alert name used by one rule only")
                    continue
                seen.add(rule.name)
                rules.append(rule)

    if chk.errors:
        raise RuleError(chk.errors)
    return rules, receivers, warnings


def load_rules_dir(directory: Path, *, environ: Mapping[str, str] = os.environ) -> RuleSet:
    """Load every ``*.yaml`` / ``*.yml`` file of ``directory`` (dotfiles skipped) into a :class:`RuleSet`.

    Raises :class:`RuleError` collecting the errors of all files, plus: a missing or empty
    directory, an alert or receiver name defined twice, a rule naming an unknown receiver.
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise RuleError([f"{directory}: the rules directory {what}: expected a directory of *.yaml rule files"])
    try:
        files = config_files(directory)
    except OSError as exc:
        raise RuleError([f"{directory}: cannot list the directory ({exc.strerror or exc}): "
                         "expected a readable directory of *.yaml rule files"]) from None
    if not files:
        raise RuleError([f"{directory}: no rule files (*.yaml, *.yml): expected at least one, e.g. routing.yaml"])
    errors: list[str] = []
    warnings: list[str] = []
    rules: list[Rule] = []
    receivers: dict[str, Receiver] = {}
    rule_sources: dict[str, str] = {}
    for file in files:
        try:
            file_rules, file_receivers, file_warnings = load_rules_file(file, environ=environ)
        except RuleError as exc:
            errors.extend(exc.errors)
            continue
        warnings.extend(file_warnings)
        for name, receiver in file_receivers.items():
            if name in receivers:
                errors.append(f"{receiver.source}.name = {name!r}: expected a receiver name defined once; "
                              f"it is also defined at {receivers[name].source}")
            else:
                receivers[name] = receiver
        for rule in file_rules:
            if rule.name in rule_sources:
                errors.append(f"{rule.source}.alert = {rule.name!r}: expected an alert name defined once; "
                              f"it is also defined at {rule_sources[rule.name]}")
            else:
                rule_sources[rule.name] = rule.source
                rules.append(rule)
    if not errors:
        for rule in rules:
            for i, name in enumerate(rule.receivers):
                if name not in receivers:
                    known = ", ".join(sorted(receivers)) or "(none defined)"
                    errors.append(f"{rule.source}.receivers[{i}] = {name!r}: expected a defined receiver: {known}")
    if errors:
        raise RuleError(errors)
    return RuleSet(rules=tuple(rules), receivers=receivers, warnings=tuple(warnings))


# --------------------------------------------------------------------------- lint


@dataclass(frozen=True)
class LintFinding:
    """One problem of one rule on one router (``router`` is None for rule-wide findings)."""

    severity: Literal["error", "warning"]
    rule: str
    router: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


@dataclass(frozen=True)
class _Range:
    low: float
    high: float
    low_why: str  # e.g. "its floor is log2 6 = 2.585 bits"
    high_why: str
    unit: str = ""
    applies: bool = True  # False: the metric is never reported for this router
    why_not: str = ""


def _log2_text(n: int) -> str:
    return f"log2 {n} = {math.log2(n):.3f} bits"


def _metric_range(metric: str, info: RouterInfo) -> _Range:
    n = info.num_slots
    k = min(info.top_k, n)
    floor, ceiling = entropy_bounds(n, info.top_k)
    indexer = info.kind == "indexer"
    context = f" (at the full context of {n} positions; shorter contexts read lower)" if indexer else ""
    per = "key position" if indexer else "expert"
    if metric == "entropy_bits":
        if indexer:
            return _Range(0.0, ceiling, f"an indexer reads as low as 0 bits on short contexts (its floor is "
                          f"{_log2_text(k)} only once contexts exceed index_topk = {k})",
                          f"its ceiling is {_log2_text(n)}{context}", " bits")
        return _Range(floor, ceiling, f"its floor is {_log2_text(k)} (every token picks {k} distinct {per}s)",
                      f"its ceiling is {_log2_text(n)}{context}", " bits")
    if metric == "normalized_entropy":
        return _Range(0.0, 1.0, "normalized entropy is at least 0 (the floor)", "normalized entropy is at most 1 "
                      "(the ceiling)")
    if metric == "max_violation":
        if indexer:
            return _Range(0.0, n - 1.0, "MaxVio is at least 0 (perfect balance)",
                          f"MaxVio is at most N - 1 = {n - 1} (every query picking the same one of {n} positions)")
        top = n / k - 1.0
        return _Range(0.0, top, "MaxVio is at least 0 (perfect balance)",
                      f"MaxVio is at most N/k - 1 = {n}/{k} - 1 = {top:.3f} (an expert picked by every token)")
    if metric == "dead_slots":
        if indexer:
            return _Range(0.0, n - 1.0, "dead slots are at least 0",
                          f"at most N - 1 = {n - 1} of its {n} key positions can be dead{context}")
        return _Range(0.0, float(n - k), "dead slots are at least 0",
                      f"at most N - k = {n} - {k} = {n - k} {per}s can be dead (every token picks {k})")
    if metric == "js_divergence":
        return _Range(0.0, 1.0, "Jensen–Shannon divergence is at least 0 bits",
                      "Jensen–Shannon divergence is at most 1 bit", " bits")
    if metric == "locality":
        if not indexer:
            return _Range(0.0, 1.0, "", "", applies=False,
                          why_not="locality is only reported for indexers, and this is an expert router")
        return _Range(0.0, 1.0, "locality is at least 0", "locality is at most 1 (a pure sliding window)")
    raise ValueError(f"unknown metric {metric!r}")


def _router_text(info: RouterInfo) -> str:
    return f"{info.name} ({info.kind}, layer {info.layer}, {info.num_slots} slots, top-{info.top_k})"


def _lint_router(rule: Rule, info: RouterInfo, tolerance_bits: float) -> list[LintFinding]:
    findings: list[LintFinding] = []
    head = f"{rule.name} ({rule.source})" if rule.source else rule.name

    def add(severity: Literal["error", "warning"], text: str) -> None:
        findings.append(LintFinding(severity, rule.name, info.name, f"{head}: {text}"))

    rng = _metric_range(rule.metric, info)
    where = _router_text(info)
    if not rng.applies:
        add("warning", f"{rule.metric} can never fire on {where}: {rng.why_not}")
        return findings
    u = rng.unit
    if rule.above is not None:
        if rule.above >= rng.high:
            add("warning", f"{rule.metric} above {_num(rule.above)}{u} can never fire on {info.name}: {rng.high_why}. "
                f"Router: {where}")
        elif rule.above < rng.low:
            add("error", f"{rule.metric} above {_num(rule.above)}{u} always fires on {info.name}: {rng.low_why}. "
                f"Router: {where}")
        elif rule.above == rng.low:
            add("warning", f"{rule.metric} above {_num(rule.above)}{u} fires on {info.name} unless it sits exactly at "
                f"its minimum: {rng.low_why}. Router: {where}")
        if rule.resolve_below is not None and rule.resolve_below < rng.low and rule.above < rng.high:
            add("error", f"{rule.metric} resolve_below {_num(rule.resolve_below)}{u} can never be reached on "
                f"{info.name}, so once firing the alert never resolves: {rng.low_why}. Router: {where}")
    if rule.below is not None:
        if rule.below <= rng.low:
            add("warning", f"{rule.metric} below {_num(rule.below)}{u} can never fire on {info.name}: {rng.low_why}. "
                f"Router: {where}")
        elif rule.below > rng.high:
            add("error", f"{rule.metric} below {_num(rule.below)}{u} always fires on {info.name}: {rng.high_why}. "
                f"Router: {where}")
        elif rule.below == rng.high:
            add("warning", f"{rule.metric} below {_num(rule.below)}{u} fires on {info.name} unless it is perfectly "
                f"balanced: {rng.high_why}. Router: {where}")
        if rule.resolve_above is not None and rule.resolve_above > rng.high and rule.below > rng.low:
            add("error", f"{rule.metric} resolve_above {_num(rule.resolve_above)}{u} can never be reached on "
                f"{info.name}, so once firing the alert never resolves: {rng.high_why}. Router: {where}")

    if rule.min_tokens is not None and rule.metric != "locality":
        needed = minimum_window_tokens(info.num_slots, info.top_k, tolerance_bits)
        if rule.min_tokens < needed:
            k = min(info.top_k, info.num_slots)
            bias = (info.num_slots - 1) / (2.0 * rule.min_tokens * k * math.log(2.0))
            add("warning", f"minimum window too small on {info.name}: min_tokens {rule.min_tokens} lets windows of "
                f"{rule.min_tokens} tokens be judged, where even a perfectly balanced router reads about "
                f"{bias:.3f} bits low (small-window bias (N-1)/(2·T·k·ln 2) with N={info.num_slots}, k={k}, "
                f"T={rule.min_tokens}); recommended min_tokens >= {needed} (bias <= {tolerance_bits:g} bits), "
                "or leave min_tokens out to use the router's own minimum. Router: " + where)
    return findings


def _selector_text(selector: Selector) -> str:
    parts = []
    if selector.kind is not None:
        parts.append(f"kind: {selector.kind}")
    if selector.layers is not None:
        parts.append(f"layers: [{selector.layers[0]}, {selector.layers[1]}]")
    if selector.router is not None:
        parts.append(f"router: {selector.router!r}")
    return "{" + ", ".join(parts) + "}" if parts else "{} (every router)"


def lint(rules: RuleSet, routers: Sequence[RouterInfo], *, tolerance_bits: float = 0.05) -> list[LintFinding]:
    """Check each rule against each router its selector matches (``business_line`` is ignored).

    Errors: a threshold that pages for ever on that router ("always fires", "never resolves").
    Warnings: a threshold that can never fire there (the rule is inert on that router, which is
    worth knowing but harms nothing - the shipped "above 6.5 bits" on 64 experts is one), a
    ``min_tokens`` below the router's trusted minimum (:func:`~mla_watch.routing.minimum_window_tokens`),
    a threshold at the very edge of the range, a selector that matches none of the routers.
    One finding per (rule, router) problem, in rule order then router order.
    """
    findings: list[LintFinding] = []
    for rule in rules.rules:
        selector = dataclasses.replace(rule.selector, business_line=None)
        matched = [info for info in routers if selector.matches(info.as_dict())]
        if not matched:
            head = f"{rule.name} ({rule.source})" if rule.source else rule.name
            kinds = sorted({info.kind for info in routers})
            layers = sorted({info.layer for info in routers})
            span = f"layers {layers[0]}..{layers[-1]}" if layers else "no layers"
            findings.append(LintFinding(
                "warning", rule.name, None,
                f"{head}: selector {_selector_text(rule.selector)} matches none of the model's {len(routers)} "
                f"routers (kinds: {', '.join(kinds) or 'none'}; {span}); this rule will never be evaluated",
            ))
            continue
        for info in matched:
            findings.extend(_lint_router(rule, info, tolerance_bits))
    return findings
