"""The sidecar's Prometheus metrics, on a registry of its own.

Routing gauges are computed at scrape time from the rolling windows (a custom collector),
so a scrape always sees the current window and never a stale copy. Series per router carry
``router``, ``layer``, ``kind`` and ``business_line`` (``"all"`` sums every line). The opt-in
per-expert window counts come from the same snapshot, and a router shard's series alone
(``GET /metrics?shard=K/N``) from :meth:`RoutingCollector.families`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mla_watch.common.describe import describe_value
from mla_watch.common.state_writes import StateWrites
from mla_watch.routing.baselines import Baselines
from mla_watch.routing.footprint import FootprintSampler
from mla_watch.routing.positions import PositionCounts
from mla_watch.routing.series import (
    BUSINESS_LINE,
    EXPERT_WINDOW_SELECTIONS,
    EXPERT_WINDOW_TOKENS,
    FILE,
    FLEET_ROLLOUT_STEPS,
    FLEET_STORE_UP,
    LAYER,
    NOTIFICATIONS_HELD,
    PREFIX,
    ROUTER,
    ROUTER_VERSION_DIGEST,
    ROUTER_VERSION_INFO,
    ROUTER_VERSION_NUMBER,
    ROUTING_SLOTS,
    SERIES_LABELS,
    STATE_WRITE_ERRORS,
    STATE_WRITE_FAILING,
    baseline_gauge,
    routing_gauge,
)
from mla_watch.routing.shards import RouterShard
from mla_watch.routing.stats import BASELINE_METRICS, STATISTICS
from mla_watch.routing.windows import ALL_LINES, RoutingSnapshot
from mla_watch.server.expert_counts import DEFAULT_EXPERT_SERIES_BUDGET, ExpertCounts, ExpertSelection

__all__ = [
    "BASELINE_GAUGES",
    "EXPERTS_PARAM",
    "SHARD_PARAM",
    "BadMetricsParam",
    "MetricsView",
    "ReferenceCollector",
    "RoutingCollector",
    "ServerMetrics",
    "metrics_view",
]

# GET /metrics?shard=K/N: a router shard's series alone; ?experts=none: without the per-expert window counts.
SHARD_PARAM = "shard"
EXPERTS_PARAM = "experts"
_EXPERTS_VALUES = ("all", "none")
_PER_EXPERT_FAMILIES = frozenset({EXPERT_WINDOW_SELECTIONS, EXPERT_WINDOW_TOKENS})

# The healthy values of a router and line's learned baseline (routing/baselines.py): rules relative to it, exported
# to Prometheus, scale these.
BASELINE_GAUGES: dict[str, str] = {
    statistic.key: f"The healthy baseline of this router and line. {statistic.help}"
    for statistic in STATISTICS
    if statistic.key in BASELINE_METRICS
}


class _FootprintCollector(Collector):
    """``batch_expert_footprint{business_line,batch_size}`` and ``batch_footprint_ratio{batch_size}`` at scrape time."""

    DRAWS = 32  # decode steps drawn per line and batch size at each scrape (seeded: a scrape repeats its figures)

    def __init__(self, sampler: Callable[[], FootprintSampler | None]) -> None:
        self._sampler = sampler

    def collect(self) -> Iterable[GaugeMetricFamily]:
        footprint = GaugeMetricFamily(
            PREFIX + "batch_expert_footprint",
            "Mean distinct experts per MoE layer that one decode step of "
            "batch_size concurrent requests of this business line (all: every line mixed) reads, drawn from recent "
            "requests' routing.",
            labels=[BUSINESS_LINE, "batch_size"],
        )
        ratio = GaugeMetricFamily(
            PREFIX + "batch_footprint_ratio",
            "Expert weight bytes a decode step of batch_size requests reads "
            "with business lines batched apart, over mixed (below 1: grouping by line reads less).",
            labels=["batch_size"],
        )
        sampler = self._sampler()
        if sampler is not None and sampler.business_lines:
            table = sampler.table(draws=self.DRAWS)
            for index, size in enumerate(table.batch_sizes):
                for line, values in table.lines.items():
                    footprint.add_metric([line, str(size)], values[index])
                footprint.add_metric([ALL_LINES, str(size)], table.mixed[index])
                ratio.add_metric([str(size)], table.ratio[index])
        yield footprint
        yield ratio


class _PositionCollector(Collector):
    """``routing_position_tokens`` and ``routing_position_js_divergence`` per router, line and position bucket
    (serve --position-metrics: routers x lines x buckets series each, hence opt-in)."""

    def __init__(self, positions: Callable[[], PositionCounts | None]) -> None:
        self._positions = positions

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = [ROUTER, LAYER, BUSINESS_LINE, "position_bucket"]
        tokens = GaugeMetricFamily(
            PREFIX + "routing_position_tokens",
            "Tokens this router routed at positions of this bucket (counts halve every hour).",
            labels=labels,
        )
        drift = GaugeMetricFamily(
            PREFIX + "routing_position_js_divergence",
            "Jensen-Shannon divergence, in bits, of this position bucket's routing from the line's in-range routing.",
            labels=labels,
        )
        positions = self._positions()
        if positions is not None:
            for line in [None, *positions.business_lines]:
                document = positions.as_dict(line)
                for router in document["routers"]:
                    for bucket in router["buckets"]:
                        values = [router["name"], str(router["layer"]), line or ALL_LINES, bucket["bucket"]]
                        tokens.add_metric(values, float(bucket["tokens"]))
                        if bucket["js_divergence"] is not None:
                            drift.add_metric(values, float(bucket["js_divergence"]))
        yield tokens
        yield drift


class RoutingCollector(Collector):
    """Exports the routing statistics of the snapshot ``snapshot()`` returns, at scrape time, and with ``experts``
    the per-expert window counts of the same snapshot."""

    def __init__(self, snapshot: Callable[[], RoutingSnapshot], experts: ExpertCounts | None = None) -> None:
        self._snapshot = snapshot
        self.experts = experts

    def collect(self) -> Iterable[Metric]:
        return self.families()

    def families(self, shard: RouterShard | None = None) -> list[Metric]:
        """Every family of one snapshot; only the series of ``shard``'s routers when given."""
        labels = list(SERIES_LABELS)
        families = {
            statistic.key: GaugeMetricFamily(routing_gauge(statistic.key), statistic.help, labels=labels)
            for statistic in STATISTICS
        }
        baselines = {
            metric: GaugeMetricFamily(baseline_gauge(metric), text, labels=labels)
            for metric, text in BASELINE_GAUGES.items()
        }
        slots = GaugeMetricFamily(
            ROUTING_SLOTS,
            "Slots the router chooses from: experts, or key "
            "positions counted (what a rule's `slots` selector matches).",
            labels=labels,
        )
        records = self._snapshot().records
        for record in records:
            if shard is not None and not shard.holds(record.router.layer):
                continue
            values = [record.router.name, str(record.router.layer), record.router.kind, record.line_label]
            for key, family in families.items():
                value = getattr(record.stats, key)
                if value is not None:
                    family.add_metric(values, float(value))
            slots.add_metric(values, float(record.stats.num_slots))
            if record.baseline is not None:
                for metric, value in record.baseline.values.items():
                    if metric in baselines:
                        baselines[metric].add_metric(values, float(value))
        experts = self.experts.families(records, shard) if self.experts is not None else []
        return [*families.values(), slots, *baselines.values(), *experts]

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class _FiringCollector(Collector):
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            PREFIX + "alerts_firing", "Alert instances firing, by rule and severity.", labels=["alertname", "severity"]
        )
        for (alertname, severity), count in sorted(self._engine.firing_counts().items()):
            family.add_metric([alertname, severity], count)
        causes = GaugeMetricFamily(
            PREFIX + "alerts_firing_by_cause",
            "Alert instances firing, by rule and cause (model, traffic, undetermined).",
            labels=["alertname", "cause"],
        )
        for (alertname, cause), count in sorted(self._engine.firing_causes().items()):
            causes.add_metric([alertname, cause], count)
        return [family, causes]


class _StateWritesCollector(Collector):
    """Which files of the state directory cannot be written now (1), or could not be before (0); failed writes per
    file; notifications held in memory because the outbox's file could not take them."""

    def __init__(self, writes: StateWrites, held: Callable[[], int] | None) -> None:
        self._writes = writes
        self._held = held

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        failing = GaugeMetricFamily(
            STATE_WRITE_FAILING,
            "1 while this file of the state directory cannot be "
            "written (a full or read-only disk): what it holds is kept in memory.",
            labels=[FILE],
        )
        errors = CounterMetricFamily(
            STATE_WRITE_ERRORS, "Writes of this file of the state directory that failed.", labels=[FILE]
        )
        now_failing = {entry["file"] for entry in self._writes.failing()}
        for name, count in sorted(self._writes.error_counts().items()):
            failing.add_metric([name], 1.0 if name in now_failing else 0.0)
            errors.add_metric([name], count)
        families: list[GaugeMetricFamily | CounterMetricFamily] = [failing, errors]
        if self._held is not None:
            held = GaugeMetricFamily(
                NOTIFICATIONS_HELD,
                "Notifications held in memory because the outbox's file "
                "could not take them (a full or read-only disk); delivered all the same.",
            )
            held.add_metric([], self._held())
            families.append(held)
        return families

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class _BaselinesCollector(Collector):
    """Healthy baselines found not to be their line's traffic (and so learned again), by line and by what said so."""

    def __init__(self, baselines: Baselines) -> None:
        self._baselines = baselines

    def collect(self) -> Iterable[CounterMetricFamily]:
        found = CounterMetricFamily(
            PREFIX + "baselines_unrepresentative",
            "Learned healthy baselines found not to be "
            "their line's traffic and dropped to be learned again, by line and by what found "
            "it: clients (the clients it was learned from fail the bar in force) or reference "
            "(the line's reference prompts).",
            labels=[BUSINESS_LINE, "reason"],
        )
        for (line, reason), count in sorted(self._baselines.found_counts().items()):
            found.add_metric([line, reason], count)
        return [found]

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []


class ReferenceCollector(Collector):
    """The routing of the reference prompts' latest readings (``business_line``: the set), apart from live traffic's
    series: ``mla_watch_reference_routing_*``, with ``js_divergence`` from their healthy baseline."""

    def __init__(self, prober: Callable[[], Any]) -> None:
        self._prober = prober

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        from mla_watch.references.readings import compare

        labels = list(SERIES_LABELS)
        families = {
            statistic.key: GaugeMetricFamily(
                f"{PREFIX}reference_{statistic.gauge}",
                f"Over the reference prompts' latest reading. {statistic.help}",
                labels=labels,
            )
            for statistic in STATISTICS
        }
        taken = GaugeMetricFamily(
            f"{PREFIX}reference_reading_timestamp_seconds",
            "When the latest reading of each set of reference prompts ended (seconds since the epoch).",
            labels=[BUSINESS_LINE],
        )
        count = CounterMetricFamily(f"{PREFIX}reference_readings", "Readings of reference prompts taken.")
        prober = self._prober()
        if prober is not None:
            count.add_metric([], prober.readings_taken)
            for name, reading in sorted(prober.readings().items()):
                taken.add_metric([name], reading.taken_at)
                baseline = prober.baselines.of(reading)
                for record in reading.score.routers.values():
                    comparison = compare(record.router, [reading], [baseline])
                    if comparison is None:
                        continue
                    values = [record.router.name, str(record.router.layer), record.router.kind, name]
                    for key, family in families.items():
                        value = getattr(comparison.stats, key)
                        if value is not None:
                            family.add_metric(values, float(value))
        return [*families.values(), taken, count]

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class ServerMetrics:
    """Every metric the server exports, registered on ``registry``.

    With ``expert_counts``, also the opt-in per-expert window counts of :mod:`mla_watch.server.expert_counts`,
    within ``expert_series_budget`` series.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        routing_snapshot: Callable[[], RoutingSnapshot],
        *,
        expert_counts: ExpertSelection | None = None,
        expert_series_budget: int = DEFAULT_EXPERT_SERIES_BUDGET,
    ) -> None:
        self.registry = registry
        p = PREFIX
        self.requests = Counter(
            p + "requests",
            "Generation requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.bad_requests = Counter(
            p + "bad_requests", "Requests refused for bad input, by reason.", ["endpoint", "reason"], registry=registry
        )
        self.policy_adjustments = Counter(
            p + "policy_adjustments",
            "Sampling values the policy clamped into its range.",
            [BUSINESS_LINE, "task", "param"],
            registry=registry,
        )
        self.policy_defaults = Counter(
            p + "policy_defaults",
            "Sampling parameters a request left out, filled in with the policy's default.",
            [BUSINESS_LINE, "task", "param"],
            registry=registry,
        )
        self.policy_rejections = Counter(
            p + "policy_rejections",
            "Requests a reject policy refused.",
            [BUSINESS_LINE, "task", "param"],
            registry=registry,
        )
        self.policy_reloads = Counter(
            p + "policy_reloads", "Policy reload attempts by outcome.", ["outcome"], registry=registry
        )
        self.policy_version = Gauge(p + "policy_version", "Version of the policies in force.", registry=registry)
        self.completion_tokens = Counter(
            p + "completion_tokens", "Tokens generated.", [BUSINESS_LINE], registry=registry
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens processed.", [BUSINESS_LINE], registry=registry
        )
        self.request_seconds = Histogram(
            p + "request_duration_seconds",
            "Time to answer a generation request.",
            ["endpoint"],
            registry=registry,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.queue_depth = Gauge(p + "queue_depth", "Jobs queued or running on the model.", registry=registry)
        self.overloaded = Counter(p + "overloaded", "Requests refused because the queue was full.", registry=registry)
        self.timeouts = Counter(p + "request_timeouts", "Requests that ran past their deadline.", registry=registry)
        self.client_disconnects = Counter(
            p + "client_disconnects", "Streams whose client went away.", registry=registry
        )
        self.ingested = Counter(
            p + "ingested_snapshots", "Routing snapshots received from remote probes.", ["source"], registry=registry
        )
        self.attention_fallback = Gauge(
            p + "attention_fallback",
            "1 when the configured attention was refused by the start-up self-test.",
            registry=registry,
        )
        self.notifications = Counter(
            p + "notifications",
            "Notification deliveries by receiver and outcome.",
            ["receiver", "outcome"],
            registry=registry,
        )
        self.retune_jobs = Counter(
            p + "retune_jobs",
            "Router re-tuning jobs by the strategy that decided them "
            "and outcome (promoted, rejected, failed, cooldown).",
            ["strategy", "outcome"],
            registry=registry,
        )
        self.router_promotions = Counter(
            p + "router_promotions",
            "Router versions swapped into the live model, by kind (promote, rollback).",
            ["kind"],
            registry=registry,
        )
        self.router_version = Gauge(
            p + "router_version", "Router version live in the model (0: as started).", registry=registry
        )
        self.router_version_info = Gauge(
            ROUTER_VERSION_INFO,
            "The router version serving (1): its number (in a "
            "fleet, the fleet's) and a content hash of its router tensors.",
            [ROUTER_VERSION_NUMBER, ROUTER_VERSION_DIGEST],
            registry=registry,
        )
        self._version_info: tuple[str, str] | None = None
        self._version_lock = threading.Lock()
        self.fleet_store_up = Gauge(
            FLEET_STORE_UP, "1 while the fleet's store answers (serve --fleet), else 0.", registry=registry
        )
        self.fleet_rollout_steps = Counter(
            FLEET_ROLLOUT_STEPS,
            "Fleet rollout steps this replica took, by outcome (passed, failed).",
            ["outcome"],
            registry=registry,
        )
        self.captured_samples = Counter(
            p + "retune_captured_samples", "Requests recorded by traffic capture.", [BUSINESS_LINE], registry=registry
        )
        self._registry = registry
        self.expert_counts = ExpertCounts(expert_counts, expert_series_budget) if expert_counts is not None else None
        self.routing = RoutingCollector(routing_snapshot, self.expert_counts)
        registry.register(self.routing)

    def serving_version(self, version: int | str | None, digest: str) -> None:
        """``router_version_info``: one series, for the version and digest serving now."""
        labels = ("" if version is None else str(version), digest)
        with self._version_lock:
            if labels == self._version_info:
                return
            if self._version_info is not None:
                self.router_version_info.remove(*self._version_info)
            self.router_version_info.labels(*labels).set(1)
            self._version_info = labels

    def watch_reference(self, prober: Callable[[], Any]) -> None:
        """Export the reference prompts' readings (``prober()``: the prober, or ``None`` before it starts)."""
        self._registry.register(ReferenceCollector(prober))

    def watch_baselines(self, baselines: Baselines) -> None:
        """Export the healthy baselines found unrepresentative (``baselines_unrepresentative_total``)."""
        self._registry.register(_BaselinesCollector(baselines))

    def watch_footprint(self, sampler: Callable[[], FootprintSampler | None]) -> None:
        """Export the expert footprint of a batch (``sampler()``: the model worker's, or ``None`` before it starts)."""
        self._registry.register(_FootprintCollector(sampler))

    def watch_positions(self, positions: Callable[[], PositionCounts | None]) -> None:
        """Export routing by position bucket (``positions()``: the probe's counts, or ``None`` before it starts)."""
        self._registry.register(_PositionCollector(positions))

    def watch_state_writes(self, writes: StateWrites, held: Callable[[], int] | None = None) -> None:
        """Export the state directory's write health (``held()``: notifications the outbox holds in memory)."""
        self._registry.register(_StateWritesCollector(writes, held))

    def watch_alerts(self, engine: Any) -> None:
        """Export ``alerts_firing{alertname,severity}`` from the rule engine at scrape time."""
        self._registry.register(_FiringCollector(engine))

    def view(self, shard: RouterShard | None = None, experts: bool = True) -> MetricsView:
        """What ``GET /metrics`` answers with these parameters (see :func:`metrics_view`)."""
        return MetricsView(self, shard, experts)

    def count_adjustments(self, decision: Any) -> None:
        for adjustment in decision.adjustments:
            counter = self.policy_defaults if adjustment.defaulted else self.policy_adjustments
            counter.labels(decision.business_line, decision.task, adjustment.param).inc()


@dataclass(frozen=True)
class MetricsView:
    """The families one ``GET /metrics`` renders: every family of the registry, or only ``shard``'s routers' (their
    routing gauges, baselines and per-expert window counts: what the fleet rules of that shard read), with or
    without the per-expert window counts. ``prometheus_client.generate_latest`` takes it as a registry."""

    metrics: ServerMetrics
    shard: RouterShard | None
    experts: bool

    def collect(self) -> Iterator[Metric]:
        shard = self.shard
        families = self.metrics.routing.families(shard) if shard is not None else self.metrics.registry.collect()
        for family in families:
            if self.experts or family.name not in _PER_EXPERT_FAMILIES:
                yield family


class BadMetricsParam(ValueError):
    """A query parameter of ``GET /metrics`` that names nothing it can answer: ``param`` and the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def metrics_view(metrics: ServerMetrics, params: dict[str, str]) -> MetricsView:
    """The view ``GET /metrics`` answers for its query ``params``; :class:`BadMetricsParam` naming a bad one, its
    value and what was expected. Other parameters are ignored, as Prometheus' client libraries ignore them."""
    shard = None
    if SHARD_PARAM in params:
        try:
            shard = RouterShard.parse(params[SHARD_PARAM], f"{SHARD_PARAM}=")
        except ValueError as error:
            raise BadMetricsParam(SHARD_PARAM, str(error)) from None
    experts = params.get(EXPERTS_PARAM, "all")
    if experts not in _EXPERTS_VALUES:
        raise BadMetricsParam(
            EXPERTS_PARAM,
            f"{EXPERTS_PARAM}={describe_value(experts)}: expected all (the default) "
            "or none (every family but the per-expert window counts)",
        )
    return metrics.view(shard, experts == "all")
