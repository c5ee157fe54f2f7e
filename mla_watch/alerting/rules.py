"""Alert rules and receivers from YAML (``rules/*.yaml``), and the rule linter.

A rules file has two optional top-level keys, ``receivers`` and ``rules``::

    receivers:
      - name: oncall
        type: alertmanager_webhook      # alertmanager_webhook | alertmanager_api | slack | pagerduty
        url: ${MLA_WATCH_ONCALL_URL}    # ${VAR} is expanded from the environment
        headers: {Authorization: "Bearer ${ONCALL_TOKEN}"}
        timeout: 5s
        group_by: [alertname, router, layer, business_line]
        group_wait: 30s                 # then group_interval (5m) between a group's notifications
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

The parsing of thresholds and trend/predict blocks lives in :mod:`mla_watch.alerting.thresholds`,
that of selectors in :mod:`mla_watch.alerting.selector`.

No torch here.
"""

from __future__ import annotations

import difflib
import os
import re
import string
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from mla_watch.alerting.durations import duration_key, format_duration, parse_duration
from mla_watch.alerting.receivers import parse_receiver
from mla_watch.alerting.selector import SELECTOR_NAME_RE, parse_selector
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.thresholds import format_number, number_key, parse_baseline_thresholds, parse_trend
from mla_watch.alerting.vocabulary import (
    ACTIONS,
    LABEL_NAME_RE,
    METRICS,
    RETUNE_STRATEGIES,
    TEMPLATE_FIELDS,
    TREND_METRICS,
    Receiver,
    Rule,
    RuleError,
    RuleSet,
)
from mla_watch.common.yaml_directory import read_yaml_directory
from mla_watch.common.yamlcheck import Checker as _Checker
from mla_watch.common.yamlcheck import fmt as _fmt
from mla_watch.common.yamlcheck import read_yaml_document
from mla_watch.routing.series import SERIES_LABELS

__all__ = [
    "RETUNE_STRATEGIES",
    "SEVERITIES",
    "RuleError",
    "format_duration",
    "format_number",
    "load_rules_dir",
    "load_rules_file",
    "parse_duration",
    "render_annotations",
]

SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
RESERVED_LABELS: tuple[str, ...] = ("alertname", "severity", *SERIES_LABELS, "cause")

_TOP_KEYS = ("receivers", "rules")
_RULE_KEYS = (
    "alert",
    "metric",
    "select",
    "below",
    "above",
    "resolve_above",
    "resolve_below",
    "for",
    "keep_firing_for",
    "min_tokens",
    "severity",
    "actions",
    "retune_strategy",
    "labels",
    "annotations",
    "receivers",
    "trend",
    "predict",
    "lint_expect",
    "on_traffic",
)
_ON_TRAFFIC_KEYS = ("severity", "receivers")
LINT_CODES = ("never_fires",)  # findings a rule may declare it expects (lint_expect)


# --------------------------------------------------------------------------- templates

_SAMPLE_FIELDS: dict[str, object] = {
    "alertname": "RoutingEntropyLow",
    "metric": "entropy_bits",
    "value": 4.5,
    "threshold": 5.0,
    "resolve_threshold": 5.2,
    "router": "model.layers.1.mlp.gate",
    "layer": 1,
    "kind": "expert",
    "business_line": "code_assistant",
    "floor_bits": 2.585,
    "ceiling_bits": 6.0,
    "tokens": 4096,
    "min_tokens": 152,
    "severity": "critical",
    "status_url": "http://127.0.0.1:8000/v1/routing",
    "current": 5.4,
    "slope_per_hour": -0.01,
    "slope_per_day": -0.24,
    "predicted": 4.7,
    "crossing_in": "1d 16h",
    "healthy": 0.6,
    "position_bucket": "256-511",
    "position_compared": "each client's prompt tokens at 256-511 against its own at 64-255",
    "position_clients": "client-a 61%, client-b 39%",
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


# --------------------------------------------------------------------------- rules


def _names_list(chk: _Checker, path: str, raw: object, allowed: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        chk.bad(path, raw, f"a non-empty list of {what}")
        return ()
    out: list[str] = []
    for i, item in enumerate(items):
        if allowed is not None and item not in allowed:
            chk.bad(f"{path}[{i}]", item, "one of: " + ", ".join(allowed))
        elif allowed is None and (not isinstance(item, str) or not SELECTOR_NAME_RE.match(item)):
            chk.bad(f"{path}[{i}]", item, f"one of the {what}")
        elif item in out:
            chk.bad(f"{path}[{i}]", item, f"each of the {what} once")
        else:
            out.append(item)
    return tuple(out)


def _rule_path(chk: _Checker, index: int, raw: object) -> str:
    """How messages name a rule: by its alert name where it has a valid one (``rules[RoutingEntropyLow]``),
    else by its index (``rules[3]``)."""
    name = raw.get("alert") if isinstance(raw, dict) else None
    if isinstance(name, str) and LABEL_NAME_RE.fullmatch(name):
        return chk.show_as(f"rules[{index}]", f"rules[{name}]")
    return f"rules[{index}]"


def _parse_rule(chk: _Checker, index: int, raw: object) -> Rule | None:
    path = _rule_path(chk, index, raw)
    data = chk.mapping(path, raw, _RULE_KEYS, "a rule with keys " + ", ".join(_RULE_KEYS))
    if data is None:
        return None
    before = len(chk.errors)

    name = data.get("alert")
    if "alert" not in data:
        chk.missing(f"{path}.alert", "the alert name, e.g. RoutingEntropyLow")
    elif not isinstance(name, str) or not LABEL_NAME_RE.fullmatch(name):
        chk.bad(f"{path}.alert", name, "an alert name matching ^[A-Za-z_][A-Za-z0-9_]*$")

    metric = data.get("metric")
    if "metric" not in data:
        chk.missing(f"{path}.metric", "one of: " + ", ".join(METRICS))
    elif metric not in METRICS:
        chk.bad(f"{path}.metric", metric, "one of: " + ", ".join(METRICS))

    selector = parse_selector(chk, f"{path}.select", data.get("select"))

    trend, tdata, tpath = parse_trend(chk, data, path)
    if trend is not None and metric in METRICS and metric not in TREND_METRICS:
        chk.bad(
            f"{path}.metric",
            metric,
            "a metric the routing history keeps, for a trend rule: one of " + ", ".join(TREND_METRICS),
        )
    given_relative = any(isinstance(tdata.get(key), dict) for key in ("below", "above"))  # named if broken
    tdata, scales = parse_baseline_thresholds(chk, tdata, tpath)
    if scales and trend is not None:
        chk.bad(
            f"{tpath}.{next(iter(scales))}",
            data.get(next(iter(scales))) or "a baseline threshold",
            "a number: a trend rule judges a slope or a prediction, not a level against the healthy baseline",
        )
    below = number_key(chk, tdata, "below", tpath)
    above = number_key(chk, tdata, "above", tpath)
    resolve_above = number_key(chk, tdata, "resolve_above", tpath)
    resolve_below = number_key(chk, tdata, "resolve_below", tpath)
    if tdata.get("below") is None and tdata.get("above") is None and not scales and not given_relative:
        chk.missing(f"{tpath}.below", "a threshold: below and/or above (a number)")
    if below is not None and above is not None and not below < above:
        chk.bad(
            f"{tpath}.below", below, f"a value < above ({format_number(above)}); otherwise every value is out of band"
        )
    if "resolve_above" in tdata and tdata.get("below") is None:
        chk.bad(
            f"{tpath}.resolve_above",
            tdata["resolve_above"],
            "no resolve_above without below (it is the "
            "hysteresis of a 'below' rule; an 'above' rule uses resolve_below)",
        )
    elif resolve_above is not None and below is not None:
        if resolve_above < below:
            chk.bad(f"{tpath}.resolve_above", resolve_above, f"a value >= below ({format_number(below)})")
        elif above is not None and resolve_above > above:
            chk.bad(f"{tpath}.resolve_above", resolve_above, f"a value <= above ({format_number(above)})")
    if "resolve_below" in tdata and tdata.get("above") is None:
        chk.bad(
            f"{tpath}.resolve_below",
            tdata["resolve_below"],
            "no resolve_below without above (it is the "
            "hysteresis of an 'above' rule; a 'below' rule uses resolve_above)",
        )
    elif resolve_below is not None and above is not None:
        if resolve_below > above:
            chk.bad(f"{tpath}.resolve_below", resolve_below, f"a value <= above ({format_number(above)})")
        elif below is not None and resolve_below < below:
            chk.bad(f"{tpath}.resolve_below", resolve_below, f"a value >= below ({format_number(below)})")

    for threshold, resolve in (("above", "resolve_below"), ("below", "resolve_above")):
        if resolve in scales and threshold not in scales:
            chk.bad(
                f"{tpath}.{resolve}",
                data.get(resolve),
                f"a number, as {threshold} is one (a resolve level "
                f"relative to the baseline could pass a fixed {threshold})",
            )
        elif resolve in scales and threshold in scales:
            outer, inner = scales[threshold], scales[resolve]
            wider = (
                (inner.times > outer.times or inner.plus > outer.plus)
                if threshold == "above"
                else (inner.times < outer.times or inner.plus < outer.plus)
            )
            if wider:
                chk.bad(
                    f"{tpath}.{resolve}",
                    data.get(resolve),
                    f"baseline_times and baseline_plus on the healthy side of {threshold}'s (hysteresis)",
                )
    for_seconds = duration_key(chk, data, "for", path, 0.0)
    keep_seconds = duration_key(chk, data, "keep_firing_for", path, 0.0)

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
            chk.bad(
                f"{path}.retune_strategy", data["retune_strategy"], "no retune_strategy unless actions include retune"
            )
        else:
            strategies = _names_list(
                chk, f"{path}.retune_strategy", data["retune_strategy"], RETUNE_STRATEGIES, "re-tune strategies"
            )

    labels: dict[str, str] = {}
    if data.get("labels") is not None:
        raw_labels = chk.mapping(f"{path}.labels", data["labels"], None, "label name -> text")
        for key, value in (raw_labels or {}).items():
            if not isinstance(key, str) or not LABEL_NAME_RE.fullmatch(key) or key.startswith("__"):
                chk.bad(f"{path}.labels", key, "label names of letters, digits and '_' (not starting with '__')")
            elif key in RESERVED_LABELS:
                chk.bad(
                    f"{path}.labels.{key}",
                    value,
                    "no override of a label the engine sets: "
                    + ", ".join(RESERVED_LABELS)
                    + " (use severity: for the severity)",
                )
            elif not isinstance(value, str):
                chk.bad(f"{path}.labels.{key}", value, "a string (quote it)")
            else:
                labels[key] = value

    annotations: dict[str, str] = {}
    if data.get("annotations") is not None:
        raw_ann = chk.mapping(f"{path}.annotations", data["annotations"], None, "annotation name -> template")
        for key, value in (raw_ann or {}).items():
            if not isinstance(key, str) or not LABEL_NAME_RE.fullmatch(key):
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

    traffic_severity, traffic_receivers = _parse_on_traffic(chk, f"{path}.on_traffic", data.get("on_traffic"))

    lint_expect: dict[str, str] = {}
    if data.get("lint_expect") is not None:
        raw_expect = chk.mapping(
            f"{path}.lint_expect",
            data["lint_expect"],
            LINT_CODES,
            'finding -> why it is expected, e.g. {never_fires: "kept as the seed wrote it"}',
        )
        for key, value in (raw_expect or {}).items():
            if not isinstance(value, str) or not value.strip() or len(value) > 300:
                chk.bad(f"{path}.lint_expect.{key}", value, "a sentence (at most 300 characters) saying why")
            else:
                lint_expect[key] = value.strip()

    if len(chk.errors) != before:
        return None
    return Rule(  # no error: name and metric are checked strings
        name=cast(str, name),
        metric=cast(str, metric),
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
        source=f"{chk.label}: rules[{index}]",
        trend=trend,
        baseline=scales,
        lint_expect=lint_expect,
        traffic_severity=traffic_severity,
        traffic_receivers=traffic_receivers,
    )


def _parse_on_traffic(chk: _Checker, path: str, raw: object) -> tuple[str, tuple[str, ...] | None]:
    """``on_traffic: {severity, receivers}``: what an alert caused by the traffic, not the model, is (its severity,
    ``warning`` by default) and where it goes (by default where the rule's alerts go)."""
    if raw is None:
        return "warning", None
    data = chk.mapping(path, raw, _ON_TRAFFIC_KEYS, "{severity: warning, receivers: [line_owners]}")
    if data is None:
        return "warning", None
    severity = data.get("severity", "warning")
    if severity not in SEVERITIES:
        chk.bad(f"{path}.severity", severity, "one of: " + ", ".join(SEVERITIES))
    receivers = None
    if "receivers" in data:
        receivers = _names_list(chk, f"{path}.receivers", data["receivers"], None, "receiver names")
    return str(severity), receivers


def load_rules_file(
    path: Path, *, environ: Mapping[str, str] = os.environ
) -> tuple[list[Rule], dict[str, Receiver], list[str]]:
    """Load and validate one rules file: ``(rules, receivers by name, warnings)``.

    Raises :class:`RuleError` listing every problem in the file. Receivers named by rules
    are checked by :func:`load_rules_dir` (they may live in another file).
    """
    path = Path(path)
    label = str(path)
    document = read_yaml_document(path, label, RuleError, may_hold_secrets=True)
    chk = _Checker(label, lines=document.lines)
    data = document.data
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
                receiver = parse_receiver(chk, f"receivers[{i}]", raw, environ, warnings)
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
                    chk.bad(f"{_rule_path(chk, i, raw)}.alert", rule.name, "an alert name used by one rule only")
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
    read = read_yaml_directory(
        directory,
        lambda file: load_rules_file(file, environ=environ),
        RuleError,
        kind="rule",
        at_least="one, e.g. routing.yaml",
    )
    errors = read.errors
    warnings: list[str] = []
    rules: list[Rule] = []
    receivers: dict[str, Receiver] = {}
    rule_sources: dict[str, str] = {}
    for _, (file_rules, file_receivers, file_warnings) in read.loaded:
        warnings.extend(file_warnings)
        for name, receiver in file_receivers.items():
            if name in receivers:
                errors.append(
                    f"{receiver.source}.name = {name!r}: expected a receiver name defined once; "
                    f"it is also defined at {receivers[name].source}"
                )
            else:
                receivers[name] = receiver
        for rule in file_rules:
            if rule.name in rule_sources:
                errors.append(
                    f"{rule.source}.alert = {rule.name!r}: expected an alert name defined once; "
                    f"it is also defined at {rule_sources[rule.name]}"
                )
            else:
                rule_sources[rule.name] = rule.source
                rules.append(rule)
    if not errors:
        for rule in rules:
            for i, name in enumerate(rule.receivers):
                if name not in receivers:
                    known = ", ".join(sorted(receivers)) or "(none defined)"
                    errors.append(f"{rule.source}.receivers[{i}] = {name!r}: expected a defined receiver: {known}")
            for i, name in enumerate(rule.traffic_receivers or ()):
                if name not in receivers:
                    known = ", ".join(sorted(receivers)) or "(none defined)"
                    errors.append(
                        f"{rule.source}.on_traffic.receivers[{i}] = {name!r}: expected a defined receiver: {known}"
                    )
    if errors:
        raise RuleError(errors)
    return RuleSet(rules=tuple(rules), receivers=receivers, warnings=tuple(warnings))
