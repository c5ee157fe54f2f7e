"""The sidecar's Prometheus series: names and label sets.

What a sidecar exports on ``/metrics`` (:mod:`mla_watch.server.metrics`, :mod:`mla_watch.server.expert_counts`)
and what the rule files exported for Prometheus select (:mod:`mla_watch.alerting.promexport`,
:mod:`mla_watch.alerting.fleet`) are named here, once, so that an exported rule always selects a series a sidecar
writes. A routing statistic names its own gauge in :data:`mla_watch.routing.stats.STATISTICS`;
:func:`routing_gauge` puts the prefix on it.

Names only: no ``prometheus_client`` here, so the rule export imports nothing of the server.
"""

from __future__ import annotations

from mla_watch.routing.stats import STATISTICS

__all__ = [
    "BUSINESS_LINE",
    "DEFAULT_JOB",
    "EXPERT",
    "EXPERT_LABELS",
    "EXPERT_OVERFLOW_SELECTIONS",
    "EXPERT_SERIES",
    "EXPERT_SERIES_BUDGET",
    "EXPERT_WINDOW_SELECTIONS",
    "EXPERT_WINDOW_TOKENS",
    "FILE",
    "FLEET_ROLLOUT_STEPS",
    "FLEET_STORE_UP",
    "INSTANCE",
    "JOB",
    "KIND",
    "LAYER",
    "NOTIFICATIONS_HELD",
    "PREFIX",
    "ROUTER",
    "ROUTER_LABELS",
    "ROUTER_VERSION_DIGEST",
    "ROUTER_VERSION_INFO",
    "ROUTER_VERSION_NUMBER",
    "ROUTING_SLOTS",
    "SERIES_LABELS",
    "STATE_WRITE_ERRORS",
    "STATE_WRITE_FAILING",
    "baseline_gauge",
    "routing_gauge",
    "total_name",
]

PREFIX = "mla_watch_"

# The labels of a routing series.
ROUTER = "router"  # the router's module name
LAYER = "layer"
KIND = "kind"  # expert or indexer
BUSINESS_LINE = "business_line"  # a line's name, or "all" for every line summed
EXPERT = "expert"  # an expert slot's index, on the per-expert counters
# The labels Prometheus puts on every series it scrapes: the scrape config (job) and the target (instance).
JOB = "job"
INSTANCE = "instance"
# The job the exported rules select unless told otherwise: what deploy/servicemonitor.yaml and podmonitor.yaml name
# the sidecars' targets.
DEFAULT_JOB = "mla_watch"

ROUTER_LABELS: tuple[str, ...] = (ROUTER, LAYER, KIND)  # one router whatever the line: its floor and ceiling
SERIES_LABELS: tuple[str, ...] = (*ROUTER_LABELS, BUSINESS_LINE)  # one router's routing of one business line
EXPERT_LABELS: tuple[str, ...] = (*SERIES_LABELS, EXPERT)  # one expert slot of that

ROUTING_SLOTS = PREFIX + "routing_slots"
# The opt-in per-expert window counts (serve --export-expert-counts), gauges of each router and line's window.
EXPERT_WINDOW_SELECTIONS = PREFIX + "expert_window_selections"
EXPERT_WINDOW_TOKENS = PREFIX + "expert_window_tokens"
EXPERT_OVERFLOW_SELECTIONS = PREFIX + "expert_overflow_window_selections"
EXPERT_SERIES = PREFIX + "expert_series"
EXPERT_SERIES_BUDGET = PREFIX + "expert_series_budget"

# The router version a sidecar serves (value 1; every sidecar, in a fleet or not): its number and a content hash of
# the router tensors serving (mla_watch.common.tensor_files.router_digest), so that a fleet's replicas can be told
# apart by what they serve.
ROUTER_VERSION_INFO = PREFIX + "router_version_info"
ROUTER_VERSION_NUMBER = "version"
ROUTER_VERSION_DIGEST = "digest"
# A fleet member (serve --fleet): whether its store answers, and the rollout steps it took by outcome.
FLEET_STORE_UP = PREFIX + "fleet_store_up"
FLEET_ROLLOUT_STEPS = PREFIX + "fleet_rollout_steps"
# The state directory's writes (mla_watch.common.state_writes): per file (its name inside the state directory, such
# as alerts.json or routers), whether it cannot be written now and how many writes failed; and the notifications
# held in memory because the outbox's file could not take them.
FILE = "file"
STATE_WRITE_FAILING = PREFIX + "state_write_failing"
STATE_WRITE_ERRORS = PREFIX + "state_write_errors"  # a counter: its samples are total_name(STATE_WRITE_ERRORS)
NOTIFICATIONS_HELD = PREFIX + "notifications_held"

_ROUTING_GAUGES: dict[str, str] = {statistic.key: PREFIX + statistic.gauge for statistic in STATISTICS}


def routing_gauge(key: str) -> str:
    """The gauge of the routing statistic ``key`` (``entropy_bits``: ``mla_watch_routing_entropy_bits``)."""
    return _ROUTING_GAUGES[key]


def baseline_gauge(key: str) -> str:
    """The gauge of the healthy baseline of the statistic ``key`` per router and line (routing/baselines.py)."""
    return f"{PREFIX}routing_baseline_{key}"


def total_name(counter: str) -> str:
    """The name of a counter's samples, as Prometheus scrapes them."""
    return counter + "_total"
