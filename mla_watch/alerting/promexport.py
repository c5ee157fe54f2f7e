"""Export alert rules as a Prometheus rule file (``mla-watch rules export --format prometheus``).

Each :class:`~mla_watch.alerting.vocabulary.Rule` becomes a Prometheus alerting rule over the
gauges the sidecar exports on ``/metrics`` (labels ``router``, ``layer``, ``kind``,
``business_line``; ``business_line="all"`` is the aggregate over every line):

* the selector becomes label matchers (router glob -> anchored RE2 regex, layer range ->
  ``layer=~"0|1|..."``, kind -> ``kind="expert"``, every line -> ``business_line!="all"``);
* ``below`` / ``above`` become ``< x`` / ``> x``;
* ``min_tokens`` becomes ``and on(...) mla_watch_routing_window_tokens >= N``; without it the
  router's own minimum applies: ``and on(...) mla_watch_routing_window_too_small == 0``;
* ``for`` and ``keep_firing_for`` carry over (``keep_firing_for`` needs Prometheus >= 2.42);
* annotation templates (Python ``str.format``) become Go templates;
* a trend rule judges ``deriv(metric[over])`` scaled to its unit, or ``predict_linear(metric[over],
  ahead)``, guarded by ``count_over_time`` so that, as in the sidecar, too little history is not judged.

What Prometheus cannot do is said in comments in the output: it has no hysteresis (an
alert resolves as soon as the expression stops matching, then ``keep_firing_for`` holds
it), and it does not run ``retune`` actions (only the sidecar does).
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.trend import MIN_COVERAGE, MIN_POINTS
from mla_watch.alerting.vocabulary import Rule, RuleSet
from mla_watch.routing.series import (
    BUSINESS_LINE,
    DEFAULT_JOB,
    INSTANCE,
    JOB,
    KIND,
    LAYER,
    ROUTER,
    ROUTER_LABELS,
    ROUTING_SLOTS,
    SERIES_LABELS,
    baseline_gauge,
    routing_gauge,
)
from mla_watch.routing.stats import BASELINE_METRICS, RULE_METRICS
from mla_watch.routing.windows import ALL_LINES

__all__ = [
    "BASELINE_NAMES",
    "FORMATS",
    "GROUP_NAME",
    "METRIC_NAMES",
    "MIMIR_NAMESPACE",
    "OPERATOR_NAME",
    "convert_template",
    "enough_history",
    "export_prometheus",
    "export_rules",
    "glob_to_regex",
    "level_expression",
    "promql_number",
    "promql_string",
    "rule_expression",
    "rule_matchers",
    "trend_expression",
    "yaml_entry",
]

GROUP_NAME = "mla_watch_routing"
METRIC_NAMES: dict[str, str] = {key: routing_gauge(key) for key in RULE_METRICS}
# The healthy value learned per router and line (mla_watch.routing.baselines), which relative thresholds scale.
BASELINE_NAMES: dict[str, str] = {metric: baseline_gauge(metric) for metric in BASELINE_METRICS}
WINDOW_TOKENS = routing_gauge("tokens")
WINDOW_TOO_SMALL = routing_gauge("too_small")
FLOOR_BITS = routing_gauge("floor_bits")
CEILING_BITS = routing_gauge("ceiling_bits")
# One sidecar's series of one router and line: the labels an `and on(...)` joins its conditions by.
_JOIN_LABELS = ", ".join((JOB, INSTANCE, *SERIES_LABELS))
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$")
# The rule file formats: Prometheus' own (which Thanos ruler reads too), a Prometheus Operator PrometheusRule, and
# a Mimir / Cortex ruler namespace file (what `mimirtool rules load` takes).
FORMATS: tuple[str, ...] = ("prometheus", "operator", "mimir")
OPERATOR_NAME = "mla-watch-routing"
MIMIR_NAMESPACE = "mla_watch"


# --------------------------------------------------------------------------- PromQL


def _promql_string(text: str) -> str:
    """A double-quoted PromQL string literal."""
    return json.dumps(text, ensure_ascii=False)


def _number(x: float) -> str:
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def promql_string(text: str) -> str:
    """A double-quoted PromQL string literal."""
    return _promql_string(text)


def promql_number(x: float) -> str:
    """``x`` as PromQL reads it back exactly (``5`` for 5.0, ``0.05``)."""
    return _number(x)


def glob_to_regex(pattern: str) -> str:
    """An RE2 regex (Prometheus anchors it) matching what ``fnmatch.fnmatchcase(name, pattern)`` matches."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append("\\[")
                continue
            body = pattern[i:j]
            i = j + 1
            negate = body.startswith("!")
            if negate:
                body = body[1:]
            body = body.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")
            if body.startswith("^"):
                body = "\\" + body
            out.append(("[^" if negate else "[") + body + "]")
        elif c in _REGEX_SPECIAL:
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def _matcher(label: str, op: str, value: str) -> str:
    """One label matcher: ``label="value"`` (``op``: ``=``, ``!=``, ``=~``)."""
    return f"{label}{op}{_promql_string(value)}"


def _matchers(rule: Rule, job: str) -> str:
    parts: list[str] = []
    if job:
        parts.append(_matcher(JOB, "=", job))
    selector = rule.selector
    if selector.kind is not None:
        parts.append(_matcher(KIND, "=", selector.kind))
    if selector.layers is not None:
        first, last = selector.layers
        if first == last:
            parts.append(_matcher(LAYER, "=", str(first)))
        else:
            parts.append(_matcher(LAYER, "=~", "|".join(str(x) for x in range(first, last + 1))))
    if selector.router is not None:
        parts.append(_matcher(ROUTER, "=~", glob_to_regex(selector.router)))
    if selector.business_line in (None, "*"):
        parts.append(_matcher(BUSINESS_LINE, "!=", ALL_LINES))
    else:
        parts.append(_matcher(BUSINESS_LINE, "=", selector.business_line))
    return "{" + ", ".join(parts) + "}"


def job_matchers(job: str) -> str:
    """``{job="<job>"}``, or nothing where ``job`` is empty (series selected by their names alone)."""
    return "{" + _matcher(JOB, "=", job) + "}" if job else ""


def rule_matchers(rule: Rule, job: str) -> str:
    """The label matchers (``{kind="expert", ...}``) of ``rule``'s selector; ``job=`` first unless ``job`` is empty."""
    return _matchers(rule, job)


def trend_expression(rule: Rule, series: str) -> str:
    """What a rule judges of ``series`` (a selector): itself, or for a trend rule its slope per unit
    (``deriv``) or its predicted value (``predict_linear``) over the look-back."""
    trend = rule.trend
    if trend is None:
        return series
    window = f"{series}[{format_duration(trend.over_seconds)}]"
    if trend.kind == "slope":
        return f"deriv({window}) * {_number(trend.per_seconds)}"
    return f"predict_linear({window}, {_number(trend.ahead_seconds)})"


def enough_history(rule: Rule, series: str, key: str = _JOIN_LABELS) -> str:
    """The sidecar's "enough data to judge" (mla_watch.alerting.trend) in PromQL: at least MIN_POINTS
    samples in the look-back, one of them in its older half (so that they span at least half of it); ``key``: the
    labels the two counts are joined on (one sidecar's series by default)."""
    assert rule.trend is not None
    over = rule.trend.over_seconds
    half = format_duration(over * MIN_COVERAGE)
    return (
        f"count_over_time({series}[{format_duration(over)}]) >= {MIN_POINTS}\nand on({key})\n"
        f"count_over_time({series}[{half}] offset {format_duration(over - over * MIN_COVERAGE)}) > 0"
    )


def level_expression(
    rule: Rule, key: str, job: str = DEFAULT_JOB, matchers: str | None = None, healthy: str | None = None
) -> str:
    """A threshold of ``rule`` in PromQL: its number, or, relative to the healthy baseline, that scaled and
    bounded by the number (``clamp_min(2 * mla_watch_routing_baseline_max_violation{...}, 1)``). ``healthy``
    replaces the baseline series (an aggregate of it, say)."""
    bound = float(getattr(rule, key))
    scale = rule.baseline.get(key)
    if scale is None:
        return _number(bound)
    if healthy is None:
        healthy = BASELINE_NAMES[rule.metric] + (_matchers(rule, job) if matchers is None else matchers)
    scaled = healthy if scale.times == 1.0 else f"{_number(scale.times)} * {healthy}"
    if scale.plus:
        scaled = f"{scaled} {'+' if scale.plus > 0 else '-'} {_number(abs(scale.plus))}"
    clamp = "clamp_min" if key in ("above", "resolve_below") else "clamp_max"
    return f"{clamp}({scaled}, {_number(bound)})"


def rule_expression(rule: Rule, *, job: str = DEFAULT_JOB) -> str:
    """The PromQL expression of ``rule`` (what makes it fire)."""
    raw_series = METRIC_NAMES[rule.metric] + _matchers(rule, job)
    series = trend_expression(rule, raw_series)
    conditions = []
    if rule.below is not None:
        conditions.append(f"{series} < {level_expression(rule, 'below', job)}")
    if rule.above is not None:
        conditions.append(f"{series} > {level_expression(rule, 'above', job)}")
    expr = conditions[0] if len(conditions) == 1 else "(" + ") or (".join(conditions) + ")"
    window_matchers = job_matchers(job)
    if rule.min_tokens is not None:
        guard = f"{WINDOW_TOKENS}{window_matchers} >= {rule.min_tokens}"
    else:
        guard = f"{WINDOW_TOO_SMALL}{window_matchers} == 0"
    if len(conditions) > 1:
        expr = f"({expr})"
    slots = rule.selector.slots
    if slots is not None:  # the geometry the threshold is a fact about: a join on the slots gauge
        series = ROUTING_SLOTS + _matchers(rule, job)
        inside = (
            [f"{series} == {slots.low}"]
            if slots.high == slots.low
            else [f"{series} >= {slots.low}", *([f"{series} <= {slots.high}"] if slots.high is not None else [])]
        )
        if slots.exclude:
            outside = [f"{series} < {slots.low}", *([f"{series} > {slots.high}"] if slots.high is not None else [])]
            test = " or ".join(outside) if slots.high != slots.low else f"{series} != {slots.low}"
        else:
            test = f"\nand on({_JOIN_LABELS})\n".join(inside)
        expr = f"{expr}\nand on({_JOIN_LABELS})\n({test})"
    if rule.trend is not None:
        expr = f"{expr}\nand on({_JOIN_LABELS})\n{enough_history(rule, raw_series)}"
    return f"{expr}\nand on({_JOIN_LABELS})\n{guard}"


# --------------------------------------------------------------------------- annotation templates


def _printf_spec(spec: str) -> tuple[str, bool]:
    """A Python format spec as a printf verb for a float; ``(verb, percent)``. Unknown specs -> ``%v``."""
    if not spec:
        return "", False
    fill_align = ""
    body = spec
    if len(body) >= 2 and body[1] in "<>=^":
        fill_align, body = body[:2], body[2:]
    elif body[:1] in "<>=^":
        fill_align, body = body[:1], body[1:]
    flags = ""
    while body[:1] in ("+", " ", "#", "0"):
        flags += body[0]
        body = body[1:]
    kind = body[-1:] if body[-1:].isalpha() or body[-1:] == "%" else ""
    number = body[: len(body) - len(kind)].replace(",", "").replace("_", "")
    width, _, precision = number.partition(".")
    if (width and not width.isdigit()) or (precision and not precision.isdigit()):
        return "%v", False
    minus = "-" if fill_align.endswith("<") else ""
    prec = f".{precision}" if precision else ""
    if kind in ("f", "F", "e", "E", "g", "G"):
        return f"%{flags}{minus}{width}{prec}{kind}", False
    if kind in ("d", "n"):
        return f"%{flags}{minus}{width}.0f", False
    if kind == "%":
        return f"%{flags}{minus}{width}{prec or '.0'}f%%", True
    if kind == "":
        return (f"%{flags}{minus}{width}{prec}g", False) if (width or prec) else ("", False)
    return "%v", False


def _go_value(expr: str, spec: str) -> str:
    verb, percent = _printf_spec(spec)
    if percent:  # Go templates have no arithmetic: Prometheus' own percentage formatting (4 significant digits)
        return f"{{{{ {expr} | humanizePercentage }}}}"
    if not verb:
        return f"{{{{ {expr} }}}}"
    return f"{{{{ {expr} | printf {json.dumps(verb)} }}}}"


# wrap is called with one str. Callable[..., str]: the callers' lambdas bind loop values as default parameters,
# and mypy infers no such lambda against Callable[[str], str].
def _go_query(metric: str, spec: str, labels: tuple[str, ...], wrap: Callable[..., str] = str) -> str:
    """A Go template that reads ``metric`` (``wrap``-ped in a PromQL function) for the alert's router from
    Prometheus (``n/a`` when absent)."""
    selector = ",".join(f'{label}="%s"' for label in labels)
    args = " ".join(f"$labels.{label}" for label in labels)
    verb, _ = _printf_spec(spec)
    value = f". | first | value | printf {json.dumps(verb or '%g')}"
    query = f"{{{{ with printf `{wrap(metric + '{' + selector + '}')}` {args} | query }}}}"
    return f"{query}{{{{ {value} }}}}{{{{ else }}}}n/a{{{{ end }}}}"


def label_value(label: str) -> str:
    """A Go template that writes the alert's ``label`` (``{{ $labels.router }}``)."""
    return f"{{{{ $labels.{label} }}}}"


def _go_literal(text: str) -> str:
    if "{{" in text or text.endswith("{") or "}}" in text:
        return f"{{{{ {json.dumps(text)} }}}}"
    return text


def _constant(value: object, spec: str) -> str:
    if value is None:
        return "n/a"
    try:
        return format(value, spec)
    except (ValueError, TypeError):
        return str(value)


def convert_template(
    template: str,
    rule: Rule,
    notes: list[str],
    *,
    queries: Mapping[str, Callable[[str], str]] | None = None,
    query_labels: tuple[str, ...] = SERIES_LABELS,
) -> str:
    """A ``str.format`` annotation template of ``rule`` as a Prometheus (Go) template.

    Labels become ``$labels.x``, ``value`` becomes ``$value``, floor/ceiling/tokens are
    read with ``query``, the rule's constants are substituted, and fields Prometheus does
    not know render as ``n/a`` (``notes`` says which). ``queries`` maps a field to the PromQL that reads
    it, given the selector of the alert's ``query_labels`` (``{router="%s",...}``), instead of the
    sidecar's own gauges.
    """
    threshold: object
    relative = next(iter(key for key in ("below", "above") if key in rule.baseline), None)
    if relative is not None:
        threshold = None  # read from Prometheus below: it differs per router and line
    elif rule.below is not None and rule.above is not None:
        threshold = f"{_number(rule.below)} (below) / {_number(rule.above)} (above)"
    else:
        threshold = rule.below if rule.below is not None else rule.above
    constants: dict[str, object] = {
        "alertname": rule.name,
        "metric": rule.metric,
        "severity": rule.severity,
        "threshold": threshold,
        # Prometheus has no hysteresis: the alert resolves where it fires (then keep_firing_for).
        "resolve_threshold": threshold,
        "min_tokens": rule.min_tokens if rule.min_tokens is not None else "the router's own minimum",
    }
    out: list[str] = []
    for literal, field, spec, _conversion in string.Formatter().parse(template):
        if literal:
            out.append(_go_literal(literal))
        if field is None:
            continue
        spec = spec or ""
        if queries is not None and field in queries:
            out.append(_go_query("", spec or ("d" if field == "tokens" else ""), query_labels, queries[field]))
        elif field == "value":
            out.append(_go_value("$value", spec))
        elif field in SERIES_LABELS:
            out.append(label_value(field))
        elif field == "floor_bits":
            out.append(_go_query(FLOOR_BITS, spec, ROUTER_LABELS))
        elif field == "ceiling_bits":
            out.append(_go_query(CEILING_BITS, spec, ROUTER_LABELS))
        elif field == "tokens":
            out.append(_go_query(WINDOW_TOKENS, spec or "d", SERIES_LABELS))
        elif field == "current":
            out.append(_go_query(METRIC_NAMES[rule.metric], spec, SERIES_LABELS))
        elif field == "healthy":
            out.append(_go_query(BASELINE_NAMES[rule.metric], spec, SERIES_LABELS))
        elif field in ("threshold", "resolve_threshold") and relative is not None:
            out.append(
                _go_query("", spec, SERIES_LABELS, lambda s, key=relative: level_expression(rule, key, matchers=s))
            )
        elif field in ("slope_per_hour", "slope_per_day") and rule.trend is not None:
            per = 3600.0 if field == "slope_per_hour" else 86400.0
            window = format_duration(rule.trend.over_seconds)
            out.append(
                _go_query(
                    METRIC_NAMES[rule.metric],
                    spec,
                    SERIES_LABELS,
                    lambda s, w=window, p=per: f"deriv({s}[{w}]) * {_number(p)}",
                )
            )
        elif field == "predicted" and rule.trend is not None and rule.trend.kind == "predict":
            out.append(_go_value("$value", spec))
        elif field in constants:
            out.append(_go_literal(_constant(constants[field], spec)))
        else:
            out.append("n/a")
            note = f"{{{field}}} is not available in Prometheus and renders as n/a"
            if note not in notes:
                notes.append(note)
    return "".join(out)


# --------------------------------------------------------------------------- YAML output


class _Dumper(yaml.SafeDumper):
    pass


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str_representer)

_HEADER = f"""\
# Prometheus alerting rules generated by `mla-watch rules export --format prometheus`.
# Do not edit: change rules/*.yaml and export again. Check with `promtool check rules FILE`.
#
# Differences from the sidecar's own rule engine:
#  * Prometheus has no hysteresis. The sidecar resolves a "below" alert only once the metric is
#    back at or above resolve_above (resp. at or below resolve_below for "above" alerts);
#    here the alert resolves as soon as the expression stops matching, and `keep_firing_for`
#    (Prometheus >= 2.42) holds it for a while instead. {{{{resolve_threshold}}}} renders as the
#    firing threshold.
#  * Windows too small to trust are excluded with {WINDOW_TOO_SMALL} == 0
#    (the router's own minimum) or {WINDOW_TOKENS} >= min_tokens.
#  * Every-line rules exclude the aggregate series {_matcher(BUSINESS_LINE, "=", ALL_LINES)}.
#  * Only notifications: `retune` actions are run by the sidecar, never by Prometheus; route
#    these alerts with Alertmanager (the sidecar's receivers are not exported).
#  * Floor, ceiling and window tokens in annotations are queried from the sidecar's gauges.
#  * Trend rules judge deriv(metric[over]) (times 3600 or 86400: per hour or per day) or
#    predict_linear(metric[over], ahead seconds) over the scraped series, and only once it holds
#    at least 6 samples reaching back at least half the look-back, as the sidecar requires.
#    Prometheus' scrapes are its own history, so its figures can differ a little from the sidecar's.
"""


def _rule_blocks(rules: RuleSet, job: str, labels: Mapping[str, str], source_root: Path | None) -> str:
    """The group ``mla_watch_routing`` as an item of a top-level ``groups:`` list."""
    if not rules.rules:
        return f"  - name: {GROUP_NAME}\n    rules: []\n"
    lines = [f"  - name: {GROUP_NAME}\n    rules:\n"]
    root = None if source_root is None else str(source_root).rstrip("/") + "/"
    for rule in rules.rules:
        notes: list[str] = []
        entry: dict[str, object] = {"alert": rule.name, "expr": rule_expression(rule, job=job)}
        if rule.for_seconds > 0:
            entry["for"] = format_duration(rule.for_seconds)
        if rule.keep_firing_for_seconds > 0:
            entry["keep_firing_for"] = format_duration(rule.keep_firing_for_seconds)
        entry["labels"] = {"severity": rule.severity, **dict(rule.labels), **dict(labels)}
        annotations = {key: convert_template(text, rule, notes) for key, text in rule.annotations.items()}
        if annotations:
            entry["annotations"] = annotations
        source = rule.source
        if root is not None and source.startswith(root):  # the same text wherever the rules directory lies
            source = source[len(root) :]
        comments = [f"{rule.name}" + (f" (from {source})" if source else "")]
        if rule.resolve_above is not None:
            comments.append(f"hysteresis not exported: the sidecar resolves at >= {_number(rule.resolve_above)}")
        if rule.resolve_below is not None:
            comments.append(f"hysteresis not exported: the sidecar resolves at <= {_number(rule.resolve_below)}")
        if "retune" in rule.actions:
            strategies = ", ".join(rule.retune_strategies) or "default"
            comments.append(f"retune ({strategies}) runs in the sidecar only")
        comments.extend(notes)
        lines.append("".join(f"      # {text}\n" for text in comments) + yaml_entry(entry))
    return "".join(lines)


def yaml_entry(entry: Mapping[str, object]) -> str:
    """One rule (a ``record`` or ``alert`` mapping) as an item of a group's ``rules:`` list (6 spaces in)."""
    body = yaml.dump([dict(entry)], Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000)
    return "".join(f"      {line}\n" if line else "\n" for line in body.splitlines())


def export_prometheus(rules: RuleSet, *, job: str = DEFAULT_JOB) -> str:
    """A Prometheus rule file (YAML text) with one group, ``mla_watch_routing``, of ``rules``' alerts.

    Series are selected with ``job="<job>"``; pass the job name of your scrape config, or ``""``
    to select on metric names alone.
    """
    lines = [_HEADER]
    if job:
        lines.append(f"# Series are selected with job={_promql_string(job)}.\n")
    lines.append("groups:\n" + _rule_blocks(rules, job, {}, None))
    return "".join(lines)


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def export_rules(
    rules: RuleSet,
    *,
    command: str,
    file_format: str = "prometheus",
    job: str = DEFAULT_JOB,
    labels: Mapping[str, str] | None = None,
    extra_groups: Sequence[str] = (),
    notes: Sequence[str] = (),
    source_root: Path | None = None,
) -> str:
    """``rules``' alerts (with ``labels`` added to each), then ``extra_groups`` (items of a ``groups:`` list, as
    :func:`yaml_entry` indents them), as a rule file of ``file_format`` (one of :data:`FORMATS`).

    ``command`` is what regenerates the file, said in its header with ``notes``; rule sources under
    ``source_root`` are shown relative to it.
    """
    if file_format not in FORMATS:
        raise ValueError(f"file_format {file_format!r}: expected one of {', '.join(FORMATS)}")
    header = [
        f"# Prometheus alerting rules generated by `{command}`.\n",
        "# Do not edit: change rules/*.yaml and run that command again. Check with `promtool check rules`"
        + (" on its spec." if file_format == "operator" else " on its groups." if file_format == "mimir" else " FILE.")
        + "\n",
        _HEADER.split("\n", 2)[2],
    ]  # the differences from the sidecar's engine, as in export_prometheus
    for note in notes:  # a note's own lines continue its bullet
        first, *rest = note.split("\n")
        header.append(f"#  * {first}\n" + "".join(f"#    {line}\n" for line in rest))
    if job:
        header.append(f"# Series are selected with job={_promql_string(job)}.\n")
    groups = "groups:\n" + _rule_blocks(rules, job, labels or {}, source_root) + "".join(extra_groups)
    if file_format == "prometheus":
        return "".join(header) + groups
    if file_format == "mimir":
        return "".join(header) + f"namespace: {MIMIR_NAMESPACE}\n" + groups
    return (
        "".join(header) + "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n"
        f"  name: {OPERATOR_NAME}\n  labels:\n    app.kubernetes.io/name: mla-watch\n"
        "    app.kubernetes.io/component: alert-rules\nspec:\n" + _indent(groups, 2)
    )
