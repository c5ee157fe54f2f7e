"""The alerting vocabulary shared by rule loading, the rule engine and the notifiers (no I/O).

Data flows one way: routing statistics records -> :class:`Rule` evaluation (the engine) ->
:class:`Alert` instances -> :class:`Notification` groups -> notifier plugins -> the outbox.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mla_watch.common.setting_errors import SettingsError
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER
from mla_watch.routing.stats import RULE_METRICS
from mla_watch.routing.windows import ALL_LINES

__all__ = [
    "ACTIONS",
    "DEFAULT_GROUP_BY",
    "DEFAULT_GROUP_INTERVAL_SECONDS",
    "DEFAULT_GROUP_WAIT_SECONDS",
    "LABEL_NAME_RE",
    "METRICS",
    "RETUNE_STRATEGIES",
    "TEMPLATE_FIELDS",
    "TREND_METRICS",
    "Alert",
    "AlertState",
    "BaselineScale",
    "Notification",
    "Receiver",
    "Rule",
    "RuleError",
    "RuleSet",
    "Selector",
    "SlotRange",
    "Trend",
    "breached",
    "fingerprint",
    "judged_window",
]

# Routing statistics a rule may watch: attributes of RoutingStats (mla_watch.routing.STATISTICS, judged ones).
# Relative to the router's geometry: normalized_entropy (0 at the floor, 1 at the ceiling), bits_below_ceiling,
# js_divergence (from the saved baseline); absolute: entropy_bits, whose meaning depends on the slots and top-k.
METRICS: tuple[str, ...] = RULE_METRICS
# What the routing history keeps, and so what a trend rule may watch: the metrics but long_context_drift, which the
# history's file predates (its points are packed arrays of a fixed width; one more value would make them unreadable).
TREND_METRICS: tuple[str, ...] = tuple(metric for metric in METRICS if metric != "long_context_drift")
ACTIONS: tuple[str, ...] = ("notify", "retune")
# A Prometheus label name, and so an alert name too (match it whole).
LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The labels a receiver groups alerts by unless its file says otherwise: one group per alert, router and line.
DEFAULT_GROUP_BY: tuple[str, ...] = ("alertname", ROUTER, LAYER, BUSINESS_LINE)
# How long a receiver's new group collects alerts before its first notification, and how long a group waits
# between later ones: Alertmanager's defaults, so that a rule file reads as an Alertmanager route does.
DEFAULT_GROUP_WAIT_SECONDS = 30.0
DEFAULT_GROUP_INTERVAL_SECONDS = 300.0
# The re-tuning strategies a rule's `retune_strategy` may name, in the order tried by default.
# Named here, not imported from the re-tuner: alerting never imports it (tests check the two agree).
RETUNE_STRATEGIES: tuple[str, ...] = ("bias", "router_finetune", "restore")
# Fields an annotation template may use, as str.format fields: "{value:.2f} bits on {router}".
TEMPLATE_FIELDS: tuple[str, ...] = (
    "alertname",
    "metric",
    "value",
    "threshold",
    "resolve_threshold",
    "router",
    "layer",
    "kind",
    "business_line",
    "floor_bits",
    "ceiling_bits",
    "tokens",
    "min_tokens",
    "severity",
    "status_url",
    # trend rules (n/a for the others): the metric's latest value, the
    # fitted slope, the predicted value, and when the fit crosses the threshold
    "current",
    "slope_per_hour",
    "slope_per_day",
    "predicted",
    "crossing_in",
    # the metric's healthy value learned for this router and line (n/a without one)
    "healthy",
    # why it fires: model, traffic or undetermined (mla_watch.alerting.causes)
    "cause",
    # long-context rules: the first position bucket that left in-range routing,
    # what the drift compares, and who sent the tokens it was read on
    "position_bucket",
    "position_compared",
    "position_clients",
)

AlertState = Literal["inactive", "pending", "firing", "resolved"]


@dataclass(frozen=True)
class SlotRange:
    """Routers by how many slots they choose from: ``[low, high]`` inclusive (``None``: open), or outside it."""

    low: int
    high: int | None
    exclude: bool = False

    def contains(self, slots: int) -> bool:
        inside = self.low <= slots and (self.high is None or slots <= self.high)
        return inside != self.exclude

    def __str__(self) -> str:
        text = str(self.low) if self.high == self.low else f"[{self.low}, {'null' if self.high is None else self.high}]"
        return f"{{not: {text}}}" if self.exclude else text


@dataclass(frozen=True)
class Selector:
    """Which routers a rule watches. ``None`` matches everything."""

    kind: str | None = None  # "expert" | "indexer"
    layers: tuple[int, int] | None = None  # inclusive [first, last]
    router: str | None = None  # fnmatch pattern over the router's module name, e.g. "*.mlp.gate"
    business_line: str | None = None  # a line name, "all" (every line summed), or None / "*": each line
    slots: SlotRange | None = None  # the geometry a threshold in bits is a fact about, e.g. 64 experts
    # Hash routers (a fixed lookup of the token id, DeepSeek-V4's first layers) have no learned routing to
    # judge: a rule watches them only when it says so.
    hash_routed: bool = False

    def matches(self, record: Mapping[str, Any]) -> bool:
        if self.kind is not None and record.get("kind") != self.kind:
            return False
        if bool(record.get("hash_routed", False)) != self.hash_routed:
            return False
        if self.slots is not None and not self.slots.contains(int(record.get("num_slots", 0))):
            return False
        if self.layers is not None and not self.layers[0] <= int(record.get("layer", -1)) <= self.layers[1]:
            return False
        if self.router is not None and not fnmatch.fnmatchcase(str(record.get("name")), self.router):
            return False
        if "business_line" not in record:  # a router description (lint): any line may come
            return True
        line = record["business_line"] or ALL_LINES  # records summed over every line carry None
        if self.business_line in (None, "*"):
            return line != ALL_LINES
        return line == self.business_line


@dataclass(frozen=True)
class Trend:
    """What a trend rule judges instead of the latest value (:mod:`mla_watch.alerting.trend`).

    ``slope``: the least-squares slope over the last ``over_seconds``, in metric units per
    ``per_seconds`` (an hour or a day). ``predict``: the value that line reaches ``ahead_seconds``
    from now (Prometheus' ``predict_linear``).
    """

    kind: Literal["slope", "predict"]
    over_seconds: float
    per_seconds: float = 3600.0
    ahead_seconds: float = 0.0


@dataclass(frozen=True)
class BaselineScale:
    """A threshold relative to the healthy value learned for each router and line: ``times * healthy + plus``.

    The rule's own number for that threshold bounds it (the level is never below an ``above`` rule's floor,
    never above a ``below`` rule's ceiling): a healthy value near zero must not turn noise into a page.
    """

    times: float = 1.0
    plus: float = 0.0

    def level(self, healthy: float, bound: float, upper_side: bool) -> float:
        """The threshold for a series whose healthy value is ``healthy``; ``upper_side``: an above-side threshold
        (``above``, ``resolve_below``), bounded from below by ``bound``; else bounded from above."""
        relative = self.times * healthy + self.plus
        return max(relative, bound) if upper_side else min(relative, bound)

    def describe(self, bound: float, upper_side: bool) -> str:
        parts = [f"{self.times:g} x healthy" if self.times != 1.0 else "healthy"]
        if self.plus:
            parts.append(f"{'+' if self.plus > 0 else '-'} {abs(self.plus):g}")
        return f"{' '.join(parts)}, {'at least' if upper_side else 'at most'} {bound:g}"


@dataclass(frozen=True)
class Rule:
    """One alert rule over one routing metric.

    Fires when the metric goes ``below`` or ``above`` its threshold for ``for_seconds``, and
    resolves only once it is back past the separate ``resolve_below`` / ``resolve_above``
    threshold (hysteresis) for ``keep_firing_for_seconds``. Windows with fewer tokens than
    ``min_tokens`` (default: the router's own trusted minimum) are not judged at all.
    With a ``trend``, the value judged is the metric's slope or predicted value from the routing
    history rather than its latest value; everything else is unchanged.
    """

    name: str  # the alertname
    metric: str
    selector: Selector
    below: float | None = None
    above: float | None = None
    resolve_above: float | None = None  # a "below" rule resolves at or above this (default: below)
    resolve_below: float | None = None  # an "above" rule resolves at or below this (default: above)
    for_seconds: float = 0.0
    keep_firing_for_seconds: float = 0.0
    min_tokens: int | None = None
    severity: str = "warning"
    actions: tuple[str, ...] = ("notify",)
    retune_strategies: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)  # str.format templates over TEMPLATE_FIELDS
    receivers: tuple[str, ...] = ("oncall",)
    source: str = ""  # "rules/routing.yaml: rules[0]" - for messages
    trend: Trend | None = None
    # Thresholds relative to each series' learned healthy value, by threshold key ("above", "resolve_below", ...);
    # the key's own number above is then the bound. A rule with any is not judged where no baseline is learned.
    baseline: Mapping[str, BaselineScale] = field(default_factory=dict)
    # Linter findings the rule's author expects, by code ("never_fires"), with why: reported once, as info.
    lint_expect: Mapping[str, str] = field(default_factory=dict)
    # An alert whose cause is the traffic, not the model (mla_watch.alerting.causes): its severity, and where it
    # goes (None: the rule's own receivers). A client's traffic is never a page for the model's on-call.
    traffic_severity: str = "warning"
    traffic_receivers: tuple[str, ...] | None = None

    def receivers_for(self, cause: str | None) -> tuple[str, ...]:
        """Where an alert of this rule goes when its cause is ``cause``."""
        if cause == "traffic" and self.traffic_receivers is not None:
            return self.traffic_receivers
        return self.receivers

    def levels(self, healthy: float | None) -> tuple[float | None, float | None, float, float] | None:
        """``(below, above, resolve_above, resolve_below)`` for a series whose healthy value of the metric is
        ``healthy``; ``None`` when the rule is relative to a baseline and the series has none."""
        below, above = self.below, self.above
        resolve_above = below if self.resolve_above is None else self.resolve_above
        resolve_below = above if self.resolve_below is None else self.resolve_below
        if not self.baseline:
            return below, above, resolve_above, resolve_below  # type: ignore[return-value]
        if healthy is None or healthy != healthy:
            return None
        scaled = {
            key: scale.level(healthy, getattr(self, key), key in ("above", "resolve_below"))
            for key, scale in self.baseline.items()
        }
        below, above = scaled.get("below", below), scaled.get("above", above)
        resolve_above = scaled.get("resolve_above", below if self.resolve_above is None else self.resolve_above)
        resolve_below = scaled.get("resolve_below", above if self.resolve_below is None else self.resolve_below)
        # hysteresis never inverts: a level scaled up past its resolve companion drags it along no further
        if below is not None and resolve_above is not None:
            resolve_above = max(resolve_above, below)
        if above is not None and resolve_below is not None:
            resolve_below = min(resolve_below, above)
        return below, above, resolve_above, resolve_below  # type: ignore[return-value]


@dataclass(frozen=True)
class Receiver:
    """Where notifications go. ``url`` is None when its ``${ENV_VAR}`` is unset (receiver disabled)."""

    name: str
    type: str  # a notifier's type_name (mla_watch.alerting.notifiers.NOTIFIER_TYPES)
    url: str | None
    headers: Mapping[str, str] = field(default_factory=dict)  # secrets already expanded; never log them
    hmac_secret: str | None = None  # adds X-MLA-Signature: sha256=<hex of HMAC-SHA256(body)>
    routing_key: str | None = None  # PagerDuty Events v2
    timeout_seconds: float = 5.0
    max_attempts: int = 12
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY
    repeat_interval_seconds: float = 4 * 3600.0
    send_resolved: bool = True
    resend_interval_seconds: float = 60.0  # alertmanager_api: re-post firing alerts this often
    source: str = ""
    # A new group's first notification waits group_wait (collecting the incident's alerts); every later change
    # of the group waits group_interval from the last flush. 0 s: at the next evaluation.
    group_wait_seconds: float = DEFAULT_GROUP_WAIT_SECONDS
    group_interval_seconds: float = DEFAULT_GROUP_INTERVAL_SECONDS

    def group_of(self, labels: Mapping[str, str]) -> dict[str, str]:
        """The labels of ``labels``' notification group here: those of ``group_by`` it carries, as Alertmanager
        takes them (a label an alert lacks is left out, not grouped as empty)."""
        return {name: str(labels[name]) for name in self.group_by if name in labels}


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    receivers: Mapping[str, Receiver]
    warnings: tuple[str, ...] = ()  # e.g. "receiver 'oncall' has no URL: MLA_WATCH_ONCALL_URL is unset"


_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3
_LABEL_SEPARATOR = 0xFF


def judged_window(tokens: int, rule_min_tokens: int | None, record_min_tokens: int | None) -> bool:
    """Whether a window of ``tokens`` is judged at all: a rule's ``min_tokens``, else the window's own trusted
    minimum. A smaller window is neither a breach nor a recovery."""
    return tokens >= ((record_min_tokens or 0) if rule_min_tokens is None else rule_min_tokens)


def breached(value: float, below: float | None, above: float | None) -> bool:
    """A breach of a rule's firing levels: ``value < below`` or ``value > above``."""
    return (below is not None and value < below) or (above is not None and value > above)


def fingerprint(labels: Mapping[str, str]) -> str:
    """An alert's fingerprint exactly as Prometheus and Alertmanager compute it.

    ``model.LabelSet.Fingerprint()``: FNV-1a 64-bit over the label names in sorted order, each
    name followed by the separator byte 0xff, its value, and 0xff again; 16 lower-case hex digits.
    """
    value = _FNV64_OFFSET
    for name in sorted(labels):
        for chunk in (str(name).encode(), str(labels[name]).encode()):
            for byte in chunk:
                value = ((value ^ byte) * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
            value = ((value ^ _LABEL_SEPARATOR) * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


@dataclass(frozen=True)
class Alert:
    """One alert instance (a rule x router x layer x business line) as notifiers see it."""

    labels: Mapping[str, str]  # alertname, severity, router, layer, kind, business_line, rule labels
    annotations: Mapping[str, str]
    status: Literal["firing", "resolved"]
    starts_at: float  # wall-clock seconds (time.time()) the alert started firing
    ends_at: float | None  # when it resolved (None while firing)
    value: float
    generator_url: str = ""

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


@dataclass(frozen=True)
class Notification:
    """A group of alerts for one receiver, with the key that makes redelivery idempotent."""

    receiver: str
    group_key: str  # e.g. '{}:{alertname="RoutingEntropyLow", router="...", ...}'
    group_labels: Mapping[str, str]
    alerts: tuple[Alert, ...]
    status: Literal["firing", "resolved"]  # firing if any alert fires
    external_url: str = ""


class RuleError(SettingsError):
    """The rule configuration is invalid; ``errors`` holds one complete message per problem."""

    what = "alert rules"
