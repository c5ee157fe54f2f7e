"""Fleet routing statistics as Prometheus recording rules, and the alerts judged on them.

Every replica of an engine has its own sidecar. Entropy, MaxVio and dead experts of the fleet's summed
counts are not averages of per-replica values, so these rules rebuild them from the opt-in per-expert
window counts (``serve --export-expert-counts``):

* ``mla_watch_expert_window_selections{router, layer, kind, business_line, expert}`` and
  ``mla_watch_expert_window_tokens{router, layer, kind, business_line}``: each replica's current window, gauges;
* and beside them, from the same scrape, the replica's routing gauges of that window: its entropy, its
  selections and its floor (``mla_watch_routing_entropy_bits``, ``..._window_selections``, ``..._entropy_floor_bits``).

The fleet's window is its replicas' windows together: the rules sum instant samples, one per series, with no
range, offset or recorded copy of a replica's per-expert series. Two groups: ``mla_watch_fleet`` (the fleet's
statistics and the alerts' fleet twins) passes over the replicas' per-expert series once per evaluation;
``mla_watch_fleet_replicas`` (each replica's divergence and the outlier alert) twice - the fleet's shares, then
each replica's cross-entropy with them, one query each - and runs less often (bench/fleet_rules.py measures both).

The fleet is every replica sharing the fleet labels (``job`` by default); a replica is told apart by the
replica label (``instance``). The statistics are :func:`mla_watch.routing.compute_stats`' own definitions
over the summed counts, recorded only while the fleet's window holds a selection (empty shares have no
entropy); dead slots are recorded always (0 is a sample, not an absent series). Beside them, each
replica's divergence from the fleet, ``KL(p_replica || p_fleet)`` in bits, computed as its cross-entropy with the
fleet's mix less its own entropy (the sidecar's gauge), whose selection-weighted sum is the generalized
Jensen-Shannon divergence of the replicas, ``JSD = H_fleet - sum_r w_r H_r``, which the fleet group records from
the replicas' entropy gauges alone.

Shards: with ``shards`` > 1 both groups are split by layer (:class:`mla_watch.routing.shards.RouterShard`),
one pair of groups per shard, each exact for its routers: one Prometheus evaluates them side by side, a ruler
spreads them over its replicas, and several Prometheus servers each scraping ``/metrics?shard=K/N`` each find one.

Trust: the fleet's trusted minimum of tokens is the sidecar's :func:`~mla_watch.routing.minimum_window_tokens`
(Miller-Madow bias within 0.05 bits), computed in PromQL from the slots (the replicas' slots gauge) and the
floor gauge (``log2 min(top_k, slots)``), or a rule's own ``min_tokens``. A router whose picks need not be
distinct (floor 0) is taken as one pick per token: a stricter minimum than its sidecar's.
"""

from __future__ import annotations

from collections.abc import Callable

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.fleet_options import (
    DEFAULT_FLEET_LABELS,
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_OUTLIER_BITS,
    DEFAULT_OUTLIER_FACTOR,
    DEFAULT_OUTLIER_INTERVAL_SECONDS,
    DEFAULT_REPLICA_LABEL,
    DEFAULT_SHARDS,
    OUTLIER_FOR_SECONDS,
    SCOPE_LABEL,
    SHARD_LABEL,
    FleetOptions,
    parse_label_list,
)
from mla_watch.alerting.fleet_recordings import (
    ENTROPY_GAUGE,
    FLEET_BITS_BELOW_CEILING,
    FLEET_CEILING_BITS,
    FLEET_DEAD_SLOTS,
    FLEET_ENTROPY_BITS,
    FLEET_EXPERT_SELECTIONS,
    FLEET_EXPERT_SHARE,
    FLEET_FLOOR_BITS,
    FLEET_JS_DIVERGENCE,
    FLEET_MAX_VIOLATION,
    FLEET_MEDIAN_REPLICA_KL,
    FLEET_MIN_TOKENS,
    FLEET_NORMALIZED_ENTROPY,
    FLEET_REPLICAS,
    FLEET_SELECTIONS,
    FLEET_SLOTS,
    FLEET_TOKENS,
    RECORDING_NAMES,
    REPLICA_KL_BITS,
    SELECTIONS_GAUGE,
    WINDOW_SELECTIONS,
    WINDOW_TOKENS,
    fleet_recordings,
    group_inputs,
    replica_recordings,
    selector,
    shard_matcher,
)
from mla_watch.alerting.fleet_recordings import TOLERANCE_BITS as TOLERANCE_BITS  # importable here as before
from mla_watch.alerting.promexport import (
    BASELINE_NAMES,
    convert_template,
    enough_history,
    label_value,
    level_expression,
    promql_number,
    rule_matchers,
    trend_expression,
    yaml_entry,
)
from mla_watch.alerting.vocabulary import Rule, RuleSet
from mla_watch.routing.series import (
    BUSINESS_LINE,
    LAYER,
    ROUTER,
    SERIES_LABELS,
)
from mla_watch.routing.shards import RouterShard

__all__ = [
    "DEFAULT_FLEET_LABELS",
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_OUTLIER_BITS",
    "DEFAULT_OUTLIER_FACTOR",
    "DEFAULT_OUTLIER_INTERVAL_SECONDS",
    "DEFAULT_REPLICA_LABEL",
    "DEFAULT_SHARDS",
    "ENTROPY_GAUGE",
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
    "REPLICA_GROUP_NAME",
    "REPLICA_KL_BITS",
    "SCOPE_LABEL",
    "SELECTIONS_GAUGE",
    "SHARD_LABEL",
    "WINDOW_SELECTIONS",
    "WINDOW_TOKENS",
    "FleetOptions",
    "fleet_group_names",
    "fleet_groups",
    "fleet_notes",
    "parse_label_list",
]

# What a fleet twin judges, per rule metric. Drift from a baseline and indexer locality have no fleet form: the
# baselines' counts stay in each sidecar, and indexers export no per-slot counts.
FLEET_METRICS: dict[str, str] = {
    "entropy_bits": FLEET_ENTROPY_BITS,
    "normalized_entropy": FLEET_NORMALIZED_ENTROPY,
    "bits_below_ceiling": FLEET_BITS_BELOW_CEILING,
    "max_violation": FLEET_MAX_VIOLATION,
    "dead_slots": FLEET_DEAD_SLOTS,
}

FLEET_GROUP_NAME = "mla_watch_fleet"
REPLICA_GROUP_NAME = FLEET_GROUP_NAME + "_replicas"  # each replica's divergence and the outlier alert
OUTLIER_ALERT = "RoutingReplicaOutlier"
# With two replicas the median is their midpoint, which no factor >= 2 lets one of them exceed: say so, not judge.
MIN_OUTLIER_REPLICAS = 3
# What one Prometheus takes, measured with real Prometheus on 2 shared cores (bench/fleet_rules.py, docs/fleet.md).
FLEET_SCALE_NOTE = (
    f"{FLEET_GROUP_NAME} reads every replica's per-expert series once an evaluation, {REPLICA_GROUP_NAME}\n"
    "twice. Measured on 2 shared cores (bench/fleet_rules.py): 10 replicas x 4 business lines of DeepSeek-V3\n"
    "(596,240 per-expert series) took 22 s of the 1m interval and 59 s of the 5m, every statistic recorded. Past\n"
    "some 600,000 per-expert series per 2 cores, split the fleet by layer (--fleet-shards N) across N Prometheus\n"
    'servers, each scraping the sidecars\' /metrics?shard=K/N (docs/fleet.md, "A hundred replicas").'
)


def _with_shard(matchers: str, shard: RouterShard | None, recorded: bool = False) -> str:
    """A rule's ``{...}`` matchers with the shard's matcher added."""
    extra = shard_matcher(shard, recorded)
    if not extra:
        return matchers
    return "{" + ", ".join(part for part in (matchers.strip("{}"), extra) if part) + "}"


def fleet_notes(o: FleetOptions) -> list[str]:
    """What the header of a rule file with the fleet rules says about them (one bullet each)."""
    split = (
        f" Split by layer into {o.shards} shards: each group name ends in _K_of_{o.shards}, and what it records "
        f'and fires\ncarries {SHARD_LABEL}="K/{o.shards}".'
        if o.shards > 1
        else ""
    )
    return [
        f"The group {FLEET_GROUP_NAME} records each fleet's routing statistics over its replicas' windows, from the\n"
        f"per-expert window counts (serve --export-expert-counts), summed by ({', '.join(o.fleet_labels)}) over "
        f"the replicas ({o.replica_label}),\nevery {format_duration(o.interval_seconds)}; "
        f"{REPLICA_GROUP_NAME} each replica's divergence from its fleet, every "
        f"{format_duration(o.outlier_interval_seconds)}.\nA fleet window under the trusted minimum of tokens is not "
        f"judged.{split}",
        f'Each alert is judged on the fleet too ({SCOPE_LABEL}="fleet"; per-replica alerts carry '
        f'{SCOPE_LABEL}="replica"), and\n{OUTLIER_ALERT} names a replica that routes apart from its peers: '
        "route them with deploy/alertmanager.yaml.",
        FLEET_SCALE_NOTE,
    ]


def _fleet_healthy(rule: Rule, o: FleetOptions, by: str | None, matchers: str) -> str:
    """The replicas' healthy baseline, averaged: the fleet's summed counts are at least as balanced as the
    replicas' selection-weighted mean (MaxVio) and have no more dead experts than any replica, so a threshold
    scaled from it is, if anything, late rather than early."""
    inner = BASELINE_NAMES[rule.metric] + matchers
    return f"avg by ({by}) ({inner})" if by is not None else f"avg({inner})"


def _twin_expression(rule: Rule, o: FleetOptions, shard: RouterShard | None) -> str:
    fk = o.fleet_key
    fleet_matchers = _with_shard(rule_matchers(rule, ""), shard, recorded=True)
    raw = FLEET_METRICS[rule.metric] + fleet_matchers
    series = trend_expression(rule, raw)
    baseline_matchers = _with_shard(rule_matchers(rule, o.job), shard)
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
                [f"{s} >= {slots.low}", *([f"{s} <= {slots.high}"] if slots.high is not None else [])]
            )
        expr = f"{expr}\nand on({fk})\n({test})"
    if rule.trend is not None:
        expr = f"{expr}\nand on({fk})\n{enough_history(rule, raw, fk)}"
    here = shard_matcher(shard, recorded=True)
    guard = (
        f"{selector(FLEET_TOKENS, here)} >= {rule.min_tokens}"
        if rule.min_tokens is not None
        else f"{selector(FLEET_TOKENS, here)} >= on({fk}) {selector(FLEET_MIN_TOKENS, here)}"
    )
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
            rule, relative, healthy=_fleet_healthy(rule, o, None, s)
        )
    if rule.trend is not None:
        window = format_duration(rule.trend.over_seconds)
        queries["slope_per_hour"] = lambda s: f"deriv({metric}{s}[{window}]) * 3600"
        queries["slope_per_day"] = lambda s: f"deriv({metric}{s}[{window}]) * 86400"
    return queries


def _twin(rule: Rule, o: FleetOptions, shard: RouterShard | None) -> str:
    notes: list[str] = []
    entry: dict[str, object] = {"alert": rule.name, "expr": _twin_expression(rule, o, shard)}
    if rule.for_seconds > 0:
        entry["for"] = format_duration(rule.for_seconds)
    if rule.keep_firing_for_seconds > 0:
        entry["keep_firing_for"] = format_duration(rule.keep_firing_for_seconds)
    entry["labels"] = {"severity": rule.severity, **dict(rule.labels), SCOPE_LABEL: "fleet", **_shard_label(shard)}
    labels = (*o.fleet_labels, *SERIES_LABELS)
    queries = _twin_queries(rule, o)
    annotations = {
        key: convert_template(text, rule, notes, queries=queries, query_labels=labels)
        for key, text in rule.annotations.items()
    }
    annotations["fleet"] = (
        f"Every replica of {' / '.join(label_value(label) for label in o.fleet_labels)}"
        " summed: its replicas' windows together."
    )
    entry["annotations"] = annotations
    comments = [f"{rule.name} on the fleet: every replica's window counts summed"]
    for level, op in ((rule.resolve_above, ">="), (rule.resolve_below, "<=")):
        if level is not None:
            comments.append(f"hysteresis not exported: the sidecar resolves at {op} {promql_number(level)}")
    comments.extend(notes)
    return "".join(f"      # {text}\n" for text in comments) + yaml_entry(entry)


def _outlier(o: FleetOptions, shard: RouterShard | None) -> str:
    fk, rk = o.fleet_key, o.replica_key
    i = group_inputs(o, shard)
    # The trusted minimum is the fleet group's (of the routers' geometry alone, whenever it was recorded).
    expr = (
        f"{i.r(REPLICA_KL_BITS)}\n  > on({fk}) group_left()\n"
        f"  clamp_min({promql_number(o.outlier_factor)} * {i.r(FLEET_MEDIAN_REPLICA_KL)}, "
        f"{promql_number(o.outlier_bits)})\n"
        f"and on({rk})\n({i.tokens} >= on({fk}) group_left() {i.r(FLEET_MIN_TOKENS)})\n"
        f"and on({fk})\n({i.r(FLEET_REPLICAS)} >= {MIN_OUTLIER_REPLICAS})"
    )
    replica = label_value(o.replica_label)
    where = f"{label_value(ROUTER)} (layer {label_value(LAYER)}, {label_value(BUSINESS_LINE)})"
    selector = ",".join(f'{label}="%s"' for label in (*o.fleet_labels, *SERIES_LABELS))
    args = " ".join(f"$labels.{label}" for label in (*o.fleet_labels, *SERIES_LABELS))
    median = (
        f"{{{{ with printf `{FLEET_MEDIAN_REPLICA_KL}{{{selector}}}` {args} | query }}}}"
        '{{ . | first | value | printf "%.3f" }}{{ else }}n/a{{ end }}'
    )
    entry: dict[str, object] = {
        "alert": OUTLIER_ALERT,
        "expr": expr,
        "labels": {"severity": "warning", SCOPE_LABEL: "replica", **_shard_label(shard)},
        "annotations": {
            "summary": f"Replica {replica} routes apart from its fleet on {where}: "
            '{{ $value | printf "%.3f" }} bits',
            "description": (
                f"In its current window the routing of {where} on replica {replica} is "
                '{{ $value | printf "%.3f" }} bits (KL) from the fleet\'s mix, where the median '
                f"replica reads {median} bits: above {promql_number(o.outlier_bits)} bits and "
                f"{promql_number(o.outlier_factor)} times the median. One replica is broken, not the "
                "model: compare its router version and re-tunes with its peers'."
            ),
            "runbook_url": "https://github.com/mla-watch/mla_watch/blob/main/docs/fleet.md#the-outlier-rule",
        },
    }
    if o.outlier_for_seconds > 0:
        entry = {
            "alert": entry["alert"],
            "expr": entry["expr"],
            "for": format_duration(o.outlier_for_seconds),
            **{k: v for k, v in entry.items() if k not in ("alert", "expr")},
        }
    comments = [
        f"{OUTLIER_ALERT}: one replica's KL from the fleet, large absolutely and against its peers' median",
        f"judged with at least {MIN_OUTLIER_REPLICAS} replicas and the trusted minimum of tokens",
    ]
    return "".join(f"      # {text}\n" for text in comments) + yaml_entry(entry)


def _shard_label(shard: RouterShard | None) -> dict[str, str]:
    """What a shard's group records and fires is told apart by a label: every shard's group has the same rules."""
    return {} if shard is None else {SHARD_LABEL: str(shard)}


def _shards(o: FleetOptions) -> tuple[RouterShard | None, ...]:
    return (None,) if o.shards == 1 else RouterShard.split(o.shards)


def _group_name(base: str, shard: RouterShard | None) -> str:
    return base if shard is None else f"{base}_{shard.index}_of_{shard.count}"


def fleet_group_names(o: FleetOptions) -> list[str]:
    """The groups' names: ``mla_watch_fleet`` and ``mla_watch_fleet_replicas``, or each with ``_K_of_N`` per shard."""
    return [_group_name(base, shard) for shard in _shards(o) for base in (FLEET_GROUP_NAME, REPLICA_GROUP_NAME)]


def _group(
    name: str, interval: float, recordings: list[tuple[str, str, str]], shard: RouterShard | None, alerts: list[str]
) -> str:
    lines = [f"  - name: {name}\n    interval: {format_duration(interval)}\n    rules:\n"]
    labels = _shard_label(shard)
    for record, expr, meaning in recordings:
        lines.append(
            f"      # {meaning}\n"
            + yaml_entry({"record": record, "expr": expr, **({"labels": labels} if labels else {})})
        )
    return "".join(lines + alerts)


def fleet_groups(rules: RuleSet, options: FleetOptions) -> list[str]:
    """The fleet groups, each an item of a top-level ``groups:`` list, for
    :func:`mla_watch.alerting.promexport.export_rules`: per shard of the layers (one when not split), the fleet group
    (its recordings, then the fleet twins of ``rules``) and the replica group (each replica's divergence and the
    outlier alert)."""
    groups = []
    for shard in _shards(options):
        twins, skipped = [], []
        for rule in rules.rules:
            if rule.metric not in FLEET_METRICS or rule.selector.kind == "indexer":
                skipped.append(rule.name)
                continue
            twins.append(_twin(rule, options, shard))
        if skipped:
            twins.append(
                f"      # no fleet form (drift from a sidecar's baseline, or indexers): {', '.join(skipped)}\n"
            )
        groups.append(
            _group(
                _group_name(FLEET_GROUP_NAME, shard),
                options.interval_seconds,
                fleet_recordings(options, shard),
                shard,
                twins,
            )
        )
        groups.append(
            _group(
                _group_name(REPLICA_GROUP_NAME, shard),
                options.outlier_interval_seconds,
                replica_recordings(options, shard),
                shard,
                [_outlier(options, shard)],
            )
        )
    return groups
