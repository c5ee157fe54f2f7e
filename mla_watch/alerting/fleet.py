"""Fleet routing statistics as Prometheus recording rules, and the alerts judged on them.

Every replica of an engine has its own sidecar. Entropy, MaxVio and dead experts of the fleet's summed
counts are not averages of per-replica values, so these rules rebuild them from the opt-in per-expert
counters (``serve --export-expert-counts``):

* ``mla_watch_expert_selections_total{router, layer, kind, business_line, expert}`` and
  ``mla_watch_expert_tokens_total{router, layer, kind, business_line}``, cumulative per replica.

Over a window ``W`` each replica's counts are the exact delta ``(c - c offset W) >= 0 or c * 1``, per series,
never ``increase()``: that extrapolates every replica's series by its own factor (how far its first and
last samples sit from the window's edges), which skews the fleet's mix. A series newer than ``W`` counts
whole; a series reset within ``W`` counts what came after the reset. Arithmetic drops ``__name__`` and
``or`` matches label sets without it, so both sides of the ``or`` pair up series by series.

The fleet is every replica sharing the fleet labels (``job`` by default); a replica is told apart by the
replica label (``instance``). The statistics are :func:`mla_watch.routing.compute_stats`' own definitions
over the summed deltas, recorded only while the fleet's window holds a selection (empty shares have no
entropy); dead slots are recorded always (0 is a sample, not an absent series). Beside them, each
replica's divergence from the fleet, ``KL(p_replica || p_fleet)`` in bits, whose selection-weighted sum is
the generalized Jensen-Shannon divergence of the replicas (``H_fleet = sum_r w_r H_r + JSD``).

Trust: the fleet's trusted minimum of tokens is the sidecar's :func:`~mla_watch.routing.minimum_window_tokens`
(Miller-Madow bias within 0.05 bits), computed in PromQL from the slots (the counters' experts) and the
floor gauge (``log2 min(top_k, slots)``), or a rule's own ``min_tokens``. A router whose picks need not be
distinct (floor 0) is taken as one pick per token: a stricter minimum than its sidecar's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.model import Rule, RuleSet
from mla_watch.alerting.promexport import (
    BASELINE_NAMES,
    FLOOR_BITS,
    convert_template,
    enough_history,
    label_value,
    level_expression,
    promql_number,
    promql_string,
    rule_matchers,
    trend_expression,
    yaml_entry,
)
from mla_watch.routing.series import (
    BUSINESS_LINE,
    DEFAULT_JOB,
    EXPERT,
    EXPERT_SELECTIONS,
    EXPERT_TOKENS,
    INSTANCE,
    JOB,
    KIND,
    LAYER,
    PREFIX,
    ROUTER,
    ROUTER_LABELS,
    ROUTING_SLOTS,
    SERIES_LABELS,
    routing_gauge,
    total_name,
)

__all__ = [
    "DEFAULT_FLEET_LABELS",
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_OUTLIER_BITS",
    "DEFAULT_OUTLIER_FACTOR",
    "DEFAULT_REPLICA_LABEL",
    "DEFAULT_WINDOW_SECONDS",
    "FLEET_BITS_BELOW_CEILING",
    "FLEET_CEILING_BITS",
    "FLEET_DEAD_SLOTS",
    "FLEET_ENTROPY_BITS",
    "FLEET_EXPERT_SELECTIONS",
    "FLEET_EXPERT_SHARE",
    "FLEET_FLOOR_BITS",
    "FLEET_GROUP_NAME",
    "FLEET_JS_DIVERGENCE",
    "FLEET_MAX_VIOLATION",
    "FLEET_MEDIAN_REPLICA_KL",
    "FLEET_METRICS",
    "FLEET_MIN_TOKENS",
    "FLEET_NORMALIZED_ENTROPY",
    "FLEET_REPLICAS",
    "FLEET_SCALE_NOTE",
    "FLEET_SELECTIONS",
    "FLEET_SLOTS",
    "FLEET_TOKENS",
    "MIN_OUTLIER_REPLICAS",
    "OUTLIER_ALERT",
    "OUTLIER_FOR_SECONDS",
    "RECORDING_NAMES",
    "REPLICA_EXPERT_SELECTIONS",
    "REPLICA_KL_BITS",
    "REPLICA_SELECTIONS",
    "REPLICA_TOKENS",
    "SCOPE_LABEL",
    "SELECTIONS_COUNTER",
    "TOKENS_COUNTER",
    "FleetOptions",
    "fleet_groups",
    "fleet_notes",
    "parse_label_list",
    "window_delta",
]

# The per-expert counters a sidecar exports with --export-expert-counts (the inputs).
SELECTIONS_COUNTER = total_name(EXPERT_SELECTIONS)
TOKENS_COUNTER = total_name(EXPERT_TOKENS)
# What only the fleet's recordings compute: no sidecar exports these.
_KL_BITS = PREFIX + "routing_fleet_kl_bits"
_MIN_WINDOW_TOKENS = PREFIX + "routing_min_window_tokens"
_REPLICA_JSD_BITS = PREFIX + "routing_replica_jsd_bits"
_REPLICAS = PREFIX + "routing_replicas"


def _recording(level: str, metric: str, operations: str) -> str:
    """A recording's name, ``level:metric:operations`` (Prometheus' convention)."""
    return f"{level}:{metric}:{operations}"


# Recording names: `replica` keeps the fleet labels and the replica label, `fleet` the fleet labels; both keep
# router, layer, kind and business_line (and expert, for the per-expert ones).
REPLICA_EXPERT_SELECTIONS = _recording("replica", EXPERT_SELECTIONS, "window_delta")
REPLICA_TOKENS = _recording("replica", EXPERT_TOKENS, "window_delta")
REPLICA_SELECTIONS = _recording("replica", EXPERT_SELECTIONS, "window_delta_sum")
REPLICA_KL_BITS = _recording("replica", _KL_BITS, "window")
FLEET_EXPERT_SELECTIONS = _recording("fleet", EXPERT_SELECTIONS, "window_delta")
FLEET_TOKENS = _recording("fleet", EXPERT_TOKENS, "window_delta")
FLEET_SELECTIONS = _recording("fleet", EXPERT_SELECTIONS, "window_delta_sum")
FLEET_SLOTS = _recording("fleet", ROUTING_SLOTS, "count")
FLEET_CEILING_BITS = _recording("fleet", routing_gauge("ceiling_bits"), "log2_slots")
FLEET_FLOOR_BITS = _recording("fleet", routing_gauge("floor_bits"), "max")
FLEET_MIN_TOKENS = _recording("fleet", _MIN_WINDOW_TOKENS, "bias_bound")
FLEET_EXPERT_SHARE = _recording("fleet", EXPERT_SELECTIONS, "window_share")
FLEET_ENTROPY_BITS = _recording("fleet", routing_gauge("entropy_bits"), "window")
FLEET_NORMALIZED_ENTROPY = _recording("fleet", routing_gauge("normalized_entropy"), "window")
FLEET_BITS_BELOW_CEILING = _recording("fleet", routing_gauge("bits_below_ceiling"), "window")
FLEET_MAX_VIOLATION = _recording("fleet", routing_gauge("max_violation"), "window")
FLEET_DEAD_SLOTS = _recording("fleet", routing_gauge("dead_slots"), "window")
FLEET_JS_DIVERGENCE = _recording("fleet", _REPLICA_JSD_BITS, "window")
FLEET_REPLICAS = _recording("fleet", _REPLICAS, "count")
FLEET_MEDIAN_REPLICA_KL = _recording("fleet", _KL_BITS, "median")

# What a fleet twin judges, per rule metric. Drift from a baseline and indexer locality have no fleet form: the
# baselines' counts stay in each sidecar, and indexers export no per-slot counters.
FLEET_METRICS: dict[str, str] = {
    "entropy_bits": FLEET_ENTROPY_BITS,
    "normalized_entropy": FLEET_NORMALIZED_ENTROPY,
    "bits_below_ceiling": FLEET_BITS_BELOW_CEILING,
    "max_violation": FLEET_MAX_VIOLATION,
    "dead_slots": FLEET_DEAD_SLOTS,
}

FLEET_GROUP_NAME = "mla_watch_fleet"
OUTLIER_ALERT = "RoutingReplicaOutlier"
SCOPE_LABEL = "scope"  # "fleet" on the twins, "replica" on every per-replica alert: Alertmanager routes on it
DEFAULT_FLEET_LABELS: tuple[str, ...] = (JOB,)
DEFAULT_REPLICA_LABEL = INSTANCE
DEFAULT_WINDOW_SECONDS = 3600.0
# An hour's window moves by 1/60 a minute: judging it more often buys nothing and costs, per evaluation, a pass
# over every replica's per-expert series (bench/fleet_rules.py).
DEFAULT_INTERVAL_SECONDS = 60.0
# A replica whose routing carries 0.1 bits of its own against the fleet's mix, and 3 times its peers' median:
# one collapsed replica of three (8 experts top-2, two experts left) reads 1 bit, its healthy peers 0.19.
DEFAULT_OUTLIER_BITS = 0.1
DEFAULT_OUTLIER_FACTOR = 3.0
# With two replicas the median is their midpoint, which no factor >= 2 lets one of them exceed: say so, not judge.
MIN_OUTLIER_REPLICAS = 3
OUTLIER_FOR_SECONDS = 600.0  # a replica's window is an hour long: ten minutes of it apart is no blip
# What one fleet group can take, measured with real Prometheus on 2 cores (bench/fleet_rules.py, docs/fleet.md): its
# replica-level recordings read every replica's per-expert series in one query each, and Prometheus stops a query
# at its --query.timeout (2m by default); a recording stopped so records nothing.
FLEET_SCALE_NOTE = (
    f"One Prometheus evaluates {FLEET_GROUP_NAME} over every replica's per-expert series at once: on 2 cores,\n"
    "10 replicas x 1 business line of DeepSeek-V3 (149,060 series) took 7 s a round; 10 x 4 lines (596,240)\n"
    "ran past Prometheus' 2-minute --query.timeout and recorded nothing. Keep a group near 150,000\n"
    "per-expert series per 2 cores: export fewer lines, split the fleet (--fleet-labels), or give Prometheus\n"
    "more cores and a longer --query.timeout (docs/fleet.md, \"Series cost\")."
)
TOLERANCE_BITS = 0.05  # the sidecar's minimum_window_tokens tolerance
_RESERVED = frozenset({*SERIES_LABELS, EXPERT, "le", "quantile", "alertname", "severity", SCOPE_LABEL})
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_LABELS = 8
_MAX_LABEL_CHARS = 64
_MAX_INTERVAL_SECONDS = 3600.0
_MAX_WINDOW_SECONDS = 31 * 86400.0  # Prometheus keeps 15 days by default: a month is already beyond it

RECORDING_NAMES: tuple[str, ...] = (
    REPLICA_EXPERT_SELECTIONS, REPLICA_TOKENS, REPLICA_SELECTIONS, FLEET_EXPERT_SELECTIONS, FLEET_TOKENS,
    FLEET_SELECTIONS, FLEET_SLOTS, FLEET_CEILING_BITS, FLEET_FLOOR_BITS, FLEET_MIN_TOKENS, FLEET_EXPERT_SHARE,
    FLEET_ENTROPY_BITS, FLEET_NORMALIZED_ENTROPY, FLEET_BITS_BELOW_CEILING, FLEET_MAX_VIOLATION, FLEET_DEAD_SLOTS,
    REPLICA_KL_BITS, FLEET_JS_DIVERGENCE, FLEET_REPLICAS, FLEET_MEDIAN_REPLICA_KL,
)


def _check_label(name: str, flag: str, given: str) -> str:
    if len(name) > _MAX_LABEL_CHARS or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise ValueError(f"{flag} {given[:200]!r}: {name[:80]!r} is not a Prometheus label name; expected "
                         "letters, digits and '_', not starting with a digit or '__'")
    if name in _RESERVED:
        raise ValueError(f"{flag} {given[:200]!r}: {name!r} is a label the rules set or aggregate by themselves; "
                         "expected the label(s) your scrape config puts on every target")
    return name


def parse_label_list(text: str, flag: str = "--fleet-labels") -> tuple[str, ...]:
    """Comma-separated label names (``job`` or ``namespace,deployment``); ``ValueError`` naming ``flag``."""
    names = tuple(part.strip() for part in text.split(",")) if len(text) <= 1024 else ()
    if not names or any(not name for name in names) or len(names) > _MAX_LABELS:
        raise ValueError(f"{flag} {text[:200]!r}: expected 1 to {_MAX_LABELS} label names separated by ',' "
                         "(e.g. job, or namespace,deployment)")
    for name in names:
        _check_label(name, flag, text)
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} {text!r}: a label is named twice; expected each label once")
    return names


@dataclass(frozen=True)
class FleetOptions:
    """How the fleet rules select, group and judge (the ``rules export --fleet*`` flags)."""

    window_seconds: float = DEFAULT_WINDOW_SECONDS
    fleet_labels: tuple[str, ...] = DEFAULT_FLEET_LABELS
    replica_label: str = DEFAULT_REPLICA_LABEL
    outlier_bits: float = DEFAULT_OUTLIER_BITS
    outlier_factor: float = DEFAULT_OUTLIER_FACTOR
    outlier_for_seconds: float = OUTLIER_FOR_SECONDS
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    job: str = DEFAULT_JOB  # the counters are selected with job="<job>", as the per-replica rules are

    def __post_init__(self) -> None:
        w = self.window_seconds
        if not (math.isfinite(w) and 60.0 <= w <= _MAX_WINDOW_SECONDS):
            raise ValueError(f"--fleet-window {format_duration(w) if math.isfinite(w) else w!r}: expected a "
                             "duration from 1m to 31d (e.g. 1h), several scrape intervals long")
        joined = ",".join(self.fleet_labels)
        parse_label_list(joined)
        _check_label(self.replica_label, "--replica-label", self.replica_label)
        if self.replica_label in self.fleet_labels:
            raise ValueError(f"--replica-label {self.replica_label!r}: it is also one of --fleet-labels "
                             f"{joined!r}; expected the label that tells replicas of one fleet apart")
        if not (math.isfinite(self.outlier_bits) and self.outlier_bits > 0):
            raise ValueError(f"--outlier-bits {self.outlier_bits!r}: expected a positive number of bits (e.g. 0.1)")
        if not (math.isfinite(self.outlier_factor) and self.outlier_factor >= 1):
            raise ValueError(f"--outlier-factor {self.outlier_factor!r}: expected a number >= 1 (e.g. 3)")
        i = self.interval_seconds
        if not (math.isfinite(i) and 1.0 <= i <= min(w, _MAX_INTERVAL_SECONDS)):
            raise ValueError(f"--fleet-interval {format_duration(i) if math.isfinite(i) else i!r}: expected a "
                             f"duration from 1s to {format_duration(min(w, _MAX_INTERVAL_SECONDS))} "
                             "(at most --fleet-window and 1h; e.g. 1m)")
        if not (math.isfinite(self.outlier_for_seconds) and 0 <= self.outlier_for_seconds <= _MAX_WINDOW_SECONDS):
            raise ValueError(f"--outlier-for {self.outlier_for_seconds!r}: expected a duration from 0s to 31d "
                             "(e.g. 10m)")

    @property
    def window(self) -> str:
        return format_duration(self.window_seconds)

    @property
    def fleet_key(self) -> str:
        """The labels of a fleet series (``job, router, layer, kind, business_line``)."""
        return ", ".join((*self.fleet_labels, *SERIES_LABELS))

    @property
    def replica_key(self) -> str:
        """The labels of a replica series: the fleet's and the replica label."""
        return ", ".join((*self.fleet_labels, self.replica_label, *SERIES_LABELS))

    @property
    def router_key(self) -> str:
        return ", ".join((*self.fleet_labels, *ROUTER_LABELS))


def window_delta(series: str, window: str) -> str:
    """The exact increase of each counter series of ``series`` over ``window``: no extrapolation; a series
    newer than the window counts whole, a reset within it counts what came after."""
    return f"({series} - {series} offset {window}) >= 0 or {series} * 1"


def _recordings(o: FleetOptions) -> list[tuple[str, str, str]]:
    """(name, expression, what it means) of every recording, in evaluation order."""
    experts = ", ".join([*([f"{JOB}={promql_string(o.job)}"] if o.job else []), f"{KIND}={promql_string('expert')}"])
    selections = f"{SELECTIONS_COUNTER}{{{experts}}}"
    tokens = f"{TOKENS_COUNTER}{{{experts}}}"
    floor = f"{FLOOR_BITS}{{{experts}}}"
    fk, rk = o.fleet_key, o.replica_key
    w = o.window
    # minimum_window_tokens: the smallest T with (N - 1) / (2 T k ln 2) <= tolerance, k = min(top_k, N) = 2^floor
    min_tokens = (f"clamp_min(ceil(({FLEET_SLOTS} - 1) / on({fk}) (2 * round(2 ^ {FLEET_FLOOR_BITS}) * "
                  f"{promql_number(math.log(2.0))} * {promql_number(TOLERANCE_BITS)})), 1)")
    mean = f"(({FLEET_SELECTIONS} > 0) / on({fk}) {FLEET_SLOTS})"
    replica_weight = f"({REPLICA_SELECTIONS} / on({fk}) group_left() ({FLEET_SELECTIONS} > 0))"
    return [
        (REPLICA_EXPERT_SELECTIONS, f"sum by ({rk}, {EXPERT}) (\n  {window_delta(selections, w)}\n)",
         f"selections of each expert by each replica over the last {w}"),
        (REPLICA_TOKENS, f"sum by ({rk}) (\n  {window_delta(tokens, w)}\n)", f"tokens of each replica over {w}"),
        (REPLICA_SELECTIONS, f"sum by ({rk}) ({REPLICA_EXPERT_SELECTIONS})", "selections of each replica"),
        (FLEET_EXPERT_SELECTIONS, f"sum by ({fk}, {EXPERT}) ({REPLICA_EXPERT_SELECTIONS})",
         "selections of each expert, every replica summed"),
        (FLEET_TOKENS, f"sum by ({fk}) ({REPLICA_TOKENS})", "tokens of the fleet: routing_window_tokens"),
        (FLEET_SELECTIONS, f"sum by ({fk}) ({FLEET_EXPERT_SELECTIONS})", "selections of the fleet"),
        (FLEET_SLOTS, f"count by ({fk}) ({FLEET_EXPERT_SELECTIONS})", "experts (every slot is exported): N"),
        (FLEET_CEILING_BITS, f"log2({FLEET_SLOTS})", "entropy ceiling log2 N"),
        (FLEET_FLOOR_BITS, f"{FLEET_SLOTS} * 0 + on({o.router_key}) group_left()\n"
                           f"  max by ({o.router_key}) ({floor})",
         "entropy floor log2 min(top_k, N), from the replicas' floor gauge"),
        (FLEET_MIN_TOKENS, min_tokens, "the trusted minimum of tokens (the sidecar's minimum_window_tokens)"),
        (FLEET_EXPERT_SHARE, f"{FLEET_EXPERT_SELECTIONS} / on({fk}) group_left() ({FLEET_SELECTIONS} > 0)",
         "p_j: each expert's share of the fleet's selections"),
        # Only nonzero shares enter the sum: 0 * log2 0 is 0, where PromQL would give NaN.
        (FLEET_ENTROPY_BITS, f"clamp_min(\n  -sum by ({fk}) ({FLEET_EXPERT_SHARE} * log2({FLEET_EXPERT_SHARE} > 0)),"
                             "\n  0\n)", "routing entropy H = -sum p_j log2 p_j, in bits"),
        (FLEET_NORMALIZED_ENTROPY,
         f"clamp(\n  ({FLEET_ENTROPY_BITS} - on({fk}) {FLEET_FLOOR_BITS})\n"
         f"  / on({fk}) (({FLEET_CEILING_BITS} - on({fk}) {FLEET_FLOOR_BITS}) > 0),\n  0, 1\n)\n"
         f"or\n{FLEET_ENTROPY_BITS} * 0 + 1", "(H - floor) / (ceiling - floor) in [0, 1]; 1 when they are equal"),
        (FLEET_BITS_BELOW_CEILING, f"clamp_min({FLEET_CEILING_BITS} - on({fk}) {FLEET_ENTROPY_BITS}, 0)",
         "ceiling - H"),
        (FLEET_MAX_VIOLATION,
         f"clamp_min(\n  (max by ({fk}) ({FLEET_EXPERT_SELECTIONS}) - on({fk}) {mean}) / on({fk}) {mean},\n  0\n)",
         "MaxVio = (max load - mean load) / mean load"),
        (FLEET_DEAD_SLOTS, f"count by ({fk}) ({FLEET_EXPERT_SELECTIONS} == 0)\nor\n{FLEET_SLOTS} * 0",
         "experts no replica selected in the window (0 is a sample)"),
        # KL_r = sum_j p_rj log2(p_rj / q_j) with p_rj = s_rj / S_r, written as (1 / S_r) sum_j s_rj log2(s_rj / q_j)
        # - log2 S_r: one pass over the replicas' per-expert deltas, and no replica share recorded per expert.
        (REPLICA_KL_BITS,
         f"clamp_min(\n  sum by ({rk}) (\n    {REPLICA_EXPERT_SELECTIONS}\n"
         f"    * log2(({REPLICA_EXPERT_SELECTIONS} > 0) / on({fk}, {EXPERT}) group_left() {FLEET_EXPERT_SHARE})\n  )\n"
         f"  / on({rk}) ({REPLICA_SELECTIONS} > 0)\n  - on({rk}) log2({REPLICA_SELECTIONS}),\n  0\n)",
         "KL(p_replica || p_fleet) in bits: how far one replica routes from the fleet's mix"),
        (FLEET_JS_DIVERGENCE, f"sum by ({fk}) (\n  {REPLICA_KL_BITS} * on({rk}) {replica_weight}\n)",
         "generalized Jensen-Shannon divergence of the replicas: sum_r w_r KL_r, w_r = share of selections"),
        (FLEET_REPLICAS, f"count by ({fk}) ({REPLICA_KL_BITS})", "replicas with selections in the window"),
        (FLEET_MEDIAN_REPLICA_KL, f"quantile by ({fk}) (0.5, {REPLICA_KL_BITS})", "the median replica's KL"),
    ]


def fleet_notes(o: FleetOptions) -> list[str]:
    """What the header of a rule file with the fleet rules says about them (one bullet each)."""
    return [
        f"The group {FLEET_GROUP_NAME} records each fleet's routing statistics over the last {o.window} from the\n"
        f"per-expert counters (serve --export-expert-counts), summed by ({', '.join(o.fleet_labels)}) over the "
        f"replicas ({o.replica_label}),\nwith exact window deltas, not increase(). A fleet window under the trusted "
        "minimum of tokens\nis not judged.",
        f"Each alert is judged on the fleet too ({SCOPE_LABEL}=\"fleet\"; per-replica alerts carry "
        f"{SCOPE_LABEL}=\"replica\"), and\n{OUTLIER_ALERT} names a replica that routes apart from its peers: "
        "route them with deploy/alertmanager.yaml.",
        FLEET_SCALE_NOTE,
    ]


def _fleet_healthy(rule: Rule, o: FleetOptions, by: str | None, matchers: str) -> str:
    """The replicas' healthy baseline, averaged: the fleet's summed counts are at least as balanced as the
    replicas' selection-weighted mean (MaxVio) and have no more dead experts than any replica, so a threshold
    scaled from it is, if anything, late rather than early."""
    inner = BASELINE_NAMES[rule.metric] + matchers
    return f"avg by ({by}) ({inner})" if by is not None else f"avg({inner})"


def _twin_expression(rule: Rule, o: FleetOptions) -> str:
    fk = o.fleet_key
    fleet_matchers = rule_matchers(rule, "")
    raw = FLEET_METRICS[rule.metric] + fleet_matchers
    series = trend_expression(rule, raw)
    baseline_matchers = rule_matchers(rule, o.job)
    conditions = []
    for key, op in (("below", "<"), ("above", ">")):
        if getattr(rule, key) is not None:
            level = level_expression(rule, key, healthy=_fleet_healthy(rule, o, fk, baseline_matchers))
            on = f" on({fk})" if key in rule.baseline else ""
            conditions.append(f"{series} {op}{on} {level}")
    expr = conditions[0] if len(conditions) == 1 else "((" + ") or (".join(conditions) + "))"
    slots = rule.selector.slots
    if slots is not None:
        s = FLEET_SLOTS + fleet_matchers
        if slots.high == slots.low:
            test = f"{s} != {slots.low}" if slots.exclude else f"{s} == {slots.low}"
        elif slots.exclude:
            test = " or ".join([f"{s} < {slots.low}", *([f"{s} > {slots.high}"] if slots.high is not None else [])])
        else:
            test = f"\nand on({fk})\n".join(
                [f"{s} >= {slots.low}", *([f"{s} <= {slots.high}"] if slots.high is not None else [])])
        expr = f"{expr}\nand on({fk})\n({test})"
    if rule.trend is not None:
        expr = f"{expr}\nand on({fk})\n{enough_history(rule, raw, fk)}"
    guard = (f"{FLEET_TOKENS} >= {rule.min_tokens}" if rule.min_tokens is not None
             else f"{FLEET_TOKENS} >= on({fk}) {FLEET_MIN_TOKENS}")
    return f"{expr}\nand on({fk})\n{guard}"


def _twin_queries(rule: Rule, o: FleetOptions) -> dict[str, Callable[[str], str]]:
    """How a twin's annotations read the fleet's figures (the per-replica rules read the sidecars' gauges)."""
    metric = FLEET_METRICS[rule.metric]
    queries: dict[str, Callable[[str], str]] = {
        "floor_bits": lambda s: FLEET_FLOOR_BITS + s,
        "ceiling_bits": lambda s: FLEET_CEILING_BITS + s,
        "tokens": lambda s: FLEET_TOKENS + s,
        "current": lambda s: metric + s,
    }
    if rule.metric in BASELINE_NAMES:
        queries["healthy"] = lambda s: _fleet_healthy(rule, o, None, s)
    relative = next(iter(key for key in ("below", "above") if key in rule.baseline), None)
    if relative is not None:
        queries["threshold"] = queries["resolve_threshold"] = lambda s: level_expression(
            rule, relative, healthy=_fleet_healthy(rule, o, None, s))
    if rule.trend is not None:
        window = format_duration(rule.trend.over_seconds)
        queries["slope_per_hour"] = lambda s: f"deriv({metric}{s}[{window}]) * 3600"
        queries["slope_per_day"] = lambda s: f"deriv({metric}{s}[{window}]) * 86400"
    return queries


def _twin(rule: Rule, o: FleetOptions) -> str:
    notes: list[str] = []
    entry: dict[str, object] = {"alert": rule.name, "expr": _twin_expression(rule, o)}
    if rule.for_seconds > 0:
        entry["for"] = format_duration(rule.for_seconds)
    if rule.keep_firing_for_seconds > 0:
        entry["keep_firing_for"] = format_duration(rule.keep_firing_for_seconds)
    entry["labels"] = {"severity": rule.severity, **dict(rule.labels), SCOPE_LABEL: "fleet"}
    labels = (*o.fleet_labels, *SERIES_LABELS)
    queries = _twin_queries(rule, o)
    annotations = {key: convert_template(text, rule, notes, queries=queries, query_labels=labels)
                   for key, text in rule.annotations.items()}
    annotations["fleet"] = (f"Every replica of {' / '.join(label_value(label) for label in o.fleet_labels)}"
                            f" summed over the last {o.window}.")
    entry["annotations"] = annotations
    comments = [f"{rule.name} on the fleet: every replica's counts summed over {o.window}"]
    for level, op in ((rule.resolve_above, ">="), (rule.resolve_below, "<=")):
        if level is not None:
            comments.append(f"hysteresis not exported: the sidecar resolves at {op} {promql_number(level)}")
    comments.extend(notes)
    return "".join(f"      # {text}\n" for text in comments) + yaml_entry(entry)


def _outlier(o: FleetOptions) -> str:
    fk, rk = o.fleet_key, o.replica_key
    expr = (f"{REPLICA_KL_BITS}\n  > on({fk}) group_left()\n"
            f"  clamp_min({promql_number(o.outlier_factor)} * {FLEET_MEDIAN_REPLICA_KL}, "
            f"{promql_number(o.outlier_bits)})\n"
            f"and on({rk})\n({REPLICA_TOKENS} >= on({fk}) group_left() {FLEET_MIN_TOKENS})\n"
            f"and on({fk})\n({FLEET_REPLICAS} >= {MIN_OUTLIER_REPLICAS})")
    replica = label_value(o.replica_label)
    where = f"{label_value(ROUTER)} (layer {label_value(LAYER)}, {label_value(BUSINESS_LINE)})"
    selector = ",".join(f'{label}="%s"' for label in (*o.fleet_labels, *SERIES_LABELS))
    args = " ".join(f"$labels.{label}" for label in (*o.fleet_labels, *SERIES_LABELS))
    median = (f"{{{{ with printf `{FLEET_MEDIAN_REPLICA_KL}{{{selector}}}` {args} | query }}}}"
              '{{ . | first | value | printf "%.3f" }}{{ else }}n/a{{ end }}')
    entry: dict[str, object] = {
        "alert": OUTLIER_ALERT,
        "expr": expr,
        "labels": {"severity": "warning", SCOPE_LABEL: "replica"},
        "annotations": {
            "summary": f"Replica {replica} routes apart from its fleet on {where}: "
                       '{{ $value | printf "%.3f" }} bits',
            "description": (f"Over the last {o.window} the routing of {where} on replica {replica} is "
                            '{{ $value | printf "%.3f" }} bits (KL) from the fleet\'s mix, where the median '
                            f"replica reads {median} bits: above {promql_number(o.outlier_bits)} bits and "
                            f"{promql_number(o.outlier_factor)} times the median. One replica is broken, not the "
                            "model: compare its router version and re-tunes with its peers'."),
            "runbook_url": "https://github.com/mla-watch/mla_watch/blob/main/docs/fleet.md#the-outlier-rule",
        },
    }
    if o.outlier_for_seconds > 0:
        entry = {"alert": entry["alert"], "expr": entry["expr"], "for": format_duration(o.outlier_for_seconds),
                 **{k: v for k, v in entry.items() if k not in ("alert", "expr")}}
    comments = [f"{OUTLIER_ALERT}: one replica's KL from the fleet, large absolutely and against its peers' median",
                f"judged with at least {MIN_OUTLIER_REPLICAS} replicas and the trusted minimum of tokens"]
    return "".join(f"      # {text}\n" for text in comments) + yaml_entry(entry)


def fleet_groups(rules: RuleSet, options: FleetOptions) -> list[str]:
    """The group ``mla_watch_fleet`` (recordings, then the fleet twins of ``rules`` and the outlier alert) as an
    item of a top-level ``groups:`` list, for :func:`mla_watch.alerting.promexport.export_rules`."""
    lines = [f"  - name: {FLEET_GROUP_NAME}\n    interval: {format_duration(options.interval_seconds)}\n    rules:\n"]
    for name, expr, meaning in _recordings(options):
        lines.append(f"      # {meaning}\n" + yaml_entry({"record": name, "expr": expr}))
    skipped = []
    for rule in rules.rules:
        if rule.metric not in FLEET_METRICS or rule.selector.kind == "indexer":
            skipped.append(rule.name)
            continue
        lines.append(_twin(rule, options))
    if skipped:
        lines.append(f"      # no fleet form (drift from a sidecar's baseline, or indexers): {', '.join(skipped)}\n")
    lines.append(_outlier(options))
    return ["".join(lines)]
