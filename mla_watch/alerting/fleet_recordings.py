"""The fleet groups' recording rules: what they read of each replica, the names of what they record, and the PromQL
of each recording of the fleet group (the fleet's routing statistics over its replicas' windows) and of the replica
group (each replica's divergence from its fleet). :mod:`mla_watch.alerting.fleet` judges the alerts on them and
writes the groups (its module docstring says what the statistics are)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mla_watch.alerting.fleet_options import SHARD_LABEL, FleetOptions
from mla_watch.alerting.promexport import FLOOR_BITS, promql_number, promql_string
from mla_watch.routing.series import (
    EXPERT,
    EXPERT_WINDOW_SELECTIONS,
    EXPERT_WINDOW_TOKENS,
    JOB,
    KIND,
    LAYER,
    PREFIX,
    ROUTING_SLOTS,
    routing_gauge,
)
from mla_watch.routing.shards import RouterShard

__all__ = [
    "ENTROPY_GAUGE",
    "FLEET_BITS_BELOW_CEILING",
    "FLEET_CEILING_BITS",
    "FLEET_DEAD_SLOTS",
    "FLEET_ENTROPY_BITS",
    "FLEET_EXPERT_SELECTIONS",
    "FLEET_EXPERT_SHARE",
    "FLEET_FLOOR_BITS",
    "FLEET_JS_DIVERGENCE",
    "FLEET_MAX_VIOLATION",
    "FLEET_MEDIAN_REPLICA_KL",
    "FLEET_MIN_TOKENS",
    "FLEET_NORMALIZED_ENTROPY",
    "FLEET_REPLICAS",
    "FLEET_SELECTIONS",
    "FLEET_SLOTS",
    "FLEET_TOKENS",
    "RECORDING_NAMES",
    "REPLICA_KL_BITS",
    "SELECTIONS_GAUGE",
    "TOLERANCE_BITS",
    "WINDOW_SELECTIONS",
    "WINDOW_TOKENS",
    "GroupInputs",
    "fleet_recordings",
    "group_inputs",
    "replica_recordings",
    "selector",
    "shard_matcher",
]

# What the rules read of each replica: its per-expert window counts (serve --export-expert-counts) and, of the
# same window, its entropy and selections (routing gauges every sidecar exports).
WINDOW_SELECTIONS = EXPERT_WINDOW_SELECTIONS
WINDOW_TOKENS = EXPERT_WINDOW_TOKENS
ENTROPY_GAUGE = routing_gauge("entropy_bits")
SELECTIONS_GAUGE = routing_gauge("selections")
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
FLEET_EXPERT_SELECTIONS = _recording("fleet", WINDOW_SELECTIONS, "sum")
FLEET_TOKENS = _recording("fleet", WINDOW_TOKENS, "sum")
FLEET_SELECTIONS = _recording("fleet", SELECTIONS_GAUGE, "sum")
FLEET_SLOTS = _recording("fleet", ROUTING_SLOTS, "count")
FLEET_CEILING_BITS = _recording("fleet", routing_gauge("ceiling_bits"), "log2_slots")
FLEET_FLOOR_BITS = _recording("fleet", routing_gauge("floor_bits"), "max")
FLEET_MIN_TOKENS = _recording("fleet", _MIN_WINDOW_TOKENS, "bias_bound")
FLEET_EXPERT_SHARE = _recording("fleet", WINDOW_SELECTIONS, "share")
FLEET_ENTROPY_BITS = _recording("fleet", routing_gauge("entropy_bits"), "window")
FLEET_NORMALIZED_ENTROPY = _recording("fleet", routing_gauge("normalized_entropy"), "window")
FLEET_BITS_BELOW_CEILING = _recording("fleet", routing_gauge("bits_below_ceiling"), "window")
FLEET_MAX_VIOLATION = _recording("fleet", routing_gauge("max_violation"), "window")
FLEET_DEAD_SLOTS = _recording("fleet", routing_gauge("dead_slots"), "window")
REPLICA_KL_BITS = _recording("replica", _KL_BITS, "window")
FLEET_JS_DIVERGENCE = _recording("fleet", _REPLICA_JSD_BITS, "window")
FLEET_REPLICAS = _recording("fleet", _REPLICAS, "count")
FLEET_MEDIAN_REPLICA_KL = _recording("fleet", _KL_BITS, "median")

TOLERANCE_BITS = 0.05  # the sidecar's minimum_window_tokens tolerance

RECORDING_NAMES: tuple[str, ...] = (
    FLEET_EXPERT_SELECTIONS,
    FLEET_TOKENS,
    FLEET_SELECTIONS,
    FLEET_SLOTS,
    FLEET_CEILING_BITS,
    FLEET_FLOOR_BITS,
    FLEET_MIN_TOKENS,
    FLEET_ENTROPY_BITS,
    FLEET_NORMALIZED_ENTROPY,
    FLEET_BITS_BELOW_CEILING,
    FLEET_MAX_VIOLATION,
    FLEET_DEAD_SLOTS,
    FLEET_JS_DIVERGENCE,  # the fleet group's
    FLEET_EXPERT_SHARE,
    REPLICA_KL_BITS,
    FLEET_REPLICAS,
    FLEET_MEDIAN_REPLICA_KL,  # the replica group's
)


def selector(name: str, matchers: str) -> str:
    """``name{matchers}``, or the name alone where there are none."""
    return f"{name}{{{matchers}}}" if matchers else name


def shard_matcher(shard: RouterShard | None, recorded: bool = False) -> str:
    """What selects ``shard``'s series: the sidecars' by their layer, the recordings by the shard's own label (every
    shard's group records the same names)."""
    if shard is None:
        return ""
    if recorded:
        return f"{SHARD_LABEL}={promql_string(str(shard))}"
    return f"{LAYER}=~{promql_string(shard.layer_regex())}"


@dataclass(frozen=True)
class GroupInputs:
    """What one group selects: the sidecars' series of its shard (``selections`` ...), its own recordings (``r``)."""

    selections: str
    tokens: str
    floor: str
    entropy: str
    replica_selections: str  # the routing gauges, of the pairs that export per-expert counts only
    replica_slots: str
    recorded: str

    def r(self, name: str) -> str:
        """A recording of this shard: every shard's group records the same names for its layers."""
        return selector(name, self.recorded)


def group_inputs(o: FleetOptions, shard: RouterShard | None) -> GroupInputs:
    """What ``shard``'s groups (the only ones when ``None``) select of the fleet ``o`` describes."""
    layers = shard_matcher(shard)
    matchers = ", ".join(
        [
            *([f"{JOB}={promql_string(o.job)}"] if o.job else []),
            f"{KIND}={promql_string('expert')}",
            *([layers] if layers else []),
        ]
    )
    tokens = selector(WINDOW_TOKENS, matchers)
    return GroupInputs(
        selections=selector(WINDOW_SELECTIONS, matchers),
        tokens=tokens,
        floor=selector(FLOOR_BITS, matchers),
        entropy=selector(ENTROPY_GAUGE, matchers),
        # A replica whose budget left a pair out has its routing gauges, not its per-expert counts: it is no part
        # of that pair's fleet.
        replica_selections=f"({selector(SELECTIONS_GAUGE, matchers)} and on({o.replica_key}) {tokens})",
        replica_slots=f"({selector(ROUTING_SLOTS, matchers)} and on({o.replica_key}) {tokens})",
        recorded=shard_matcher(shard, recorded=True),
    )


def fleet_recordings(o: FleetOptions, shard: RouterShard | None = None) -> list[tuple[str, str, str]]:
    """(name, expression, what it means) of every recording of ``shard``'s fleet group (the only one when ``None``),
    in evaluation order: one pass over the replicas' per-expert series, then fleet-level series only."""
    i = group_inputs(o, shard)
    r = i.r
    fk, rk = o.fleet_key, o.replica_key
    # minimum_window_tokens: the smallest T with (N - 1) / (2 T k ln 2) <= tolerance, k = min(top_k, N) = 2^floor
    min_tokens = (
        f"clamp_min(ceil(({r(FLEET_SLOTS)} - 1) / on({fk}) (2 * round(2 ^ {r(FLEET_FLOOR_BITS)}) * "
        f"{promql_number(math.log(2.0))} * {promql_number(TOLERANCE_BITS)})), 1)"
    )
    mean = f"(({r(FLEET_SELECTIONS)} > 0) / on({fk}) {r(FLEET_SLOTS)})"
    counts = r(FLEET_EXPERT_SELECTIONS)
    weight = f"({i.replica_selections} / on({fk}) group_left() ({r(FLEET_SELECTIONS)} > 0))"
    # What each evaluation reads of the fleet's per-expert sums (one replica's worth of series): the entropy twice,
    # MaxVio and the dead experts once; selections and slots come from the replicas' gauges of the same windows.
    return [
        (
            FLEET_EXPERT_SELECTIONS,
            f"sum by ({fk}, {EXPERT}) ({i.selections})",
            "selections of each expert in the replicas' windows, summed",
        ),
        (FLEET_TOKENS, f"sum by ({fk}) ({i.tokens})", "tokens of the fleet's window: its replicas' windows together"),
        (FLEET_SELECTIONS, f"sum by ({fk}) {i.replica_selections}", "selections of the fleet's window"),
        (FLEET_SLOTS, f"max by ({fk}) {i.replica_slots}", "experts N (every slot is exported, zeros included)"),
        (FLEET_CEILING_BITS, f"log2({r(FLEET_SLOTS)})", "entropy ceiling log2 N"),
        (
            FLEET_FLOOR_BITS,
            f"{r(FLEET_SLOTS)} * 0 + on({o.router_key}) group_left()\n  max by ({o.router_key}) ({i.floor})",
            "entropy floor log2 min(top_k, N), from the replicas' floor gauge",
        ),
        (FLEET_MIN_TOKENS, min_tokens, "the trusted minimum of tokens (the sidecar's minimum_window_tokens)"),
        # H = log2 S - (1/S) sum_j s_j log2 s_j; only chosen experts enter the sum (0 log2 0 is 0, not PromQL's NaN).
        (
            FLEET_ENTROPY_BITS,
            f"clamp_min(\n  log2({r(FLEET_SELECTIONS)} > 0)\n"
            f"  - on({fk}) sum by ({fk}) ({counts} * log2({counts} > 0)) / on({fk}) {r(FLEET_SELECTIONS)},\n  0\n)",
            "routing entropy H = -sum p_j log2 p_j of the summed counts, in bits",
        ),
        (
            FLEET_NORMALIZED_ENTROPY,
            f"clamp(\n  ({r(FLEET_ENTROPY_BITS)} - on({fk}) {r(FLEET_FLOOR_BITS)})\n"
            f"  / on({fk}) (({r(FLEET_CEILING_BITS)} - on({fk}) {r(FLEET_FLOOR_BITS)}) > 0),\n  0, 1\n)\n"
            f"or on({fk})\n{r(FLEET_ENTROPY_BITS)} * 0 + 1",
            "(H - floor) / (ceiling - floor) in [0, 1]; 1 when they are equal",
        ),
        (
            FLEET_BITS_BELOW_CEILING,
            f"clamp_min({r(FLEET_CEILING_BITS)} - on({fk}) {r(FLEET_ENTROPY_BITS)}, 0)",
            "ceiling - H",
        ),
        (
            FLEET_MAX_VIOLATION,
            f"clamp_min(\n  (max by ({fk}) ({counts}) - on({fk}) {mean}) / on({fk}) {mean},\n  0\n)",
            "MaxVio = (max load - mean load) / mean load",
        ),
        (
            FLEET_DEAD_SLOTS,
            f"count by ({fk}) ({counts} == 0)\nor on({fk})\n{r(FLEET_SLOTS)} * 0",
            "experts no replica selected in its window (0 is a sample)",
        ),
        # JSD = H_fleet - sum_r w_r H_r: each replica's entropy is its sidecar's gauge of the same window, so the
        # divergence costs no second pass over the per-expert series (each replica's own, KL_r, has its group).
        (
            FLEET_JS_DIVERGENCE,
            f"clamp_min(\n  {r(FLEET_ENTROPY_BITS)}\n  - on({fk})\n"
            f"  sum by ({fk}) ({i.entropy} * on({rk}) group_left() {weight}),\n  0\n)",
            "generalized Jensen-Shannon divergence of the replicas: H_fleet - sum_r w_r H_r = sum_r w_r KL_r, "
            "w_r = share of selections",
        ),
    ]


def replica_recordings(o: FleetOptions, shard: RouterShard | None = None) -> list[tuple[str, str, str]]:
    """(name, expression, what it means) of the recordings of ``shard``'s replica group: each replica's divergence
    from the fleet, from the fleet's shares taken at the same instant (not the fleet group's last recording of the
    counts, which may be of other windows). One pass over the per-expert series each for the shares and the
    divergences: no one query does both, which on a loaded Prometheus could run past its query timeout."""
    i = group_inputs(o, shard)
    r = i.r
    fk, rk = o.fleet_key, o.replica_key
    return [
        (
            FLEET_EXPERT_SHARE,
            f"sum by ({fk}, {EXPERT}) ({i.selections})\n/ on({fk}) group_left()\nsum by ({fk}) {i.replica_selections}",
            "q_j: each expert's share of the fleet's selections",
        ),
        # KL_r = sum_j p_rj log2(p_rj / q_j) = -sum_j p_rj log2 q_j - H_r: the cross-entropy with the fleet's mix
        # (the replicas' per-expert counts joined with the fleet's shares) less the replica's own entropy, which its
        # sidecar exports of the same window. An expert no replica chose has no share, and no count to weigh it.
        (
            REPLICA_KL_BITS,
            f"clamp_min(\n  sum by ({rk}) (\n    {i.selections}\n"
            f"    * on({fk}, {EXPERT}) group_left() -log2({r(FLEET_EXPERT_SHARE)} > 0)\n  )\n"
            f"  / on({rk}) ({i.replica_selections} > 0)\n  - on({rk}) {i.entropy},\n  0\n)",
            "KL(p_replica || p_fleet) in bits: how far one replica routes from the fleet's mix",
        ),
        (FLEET_REPLICAS, f"count by ({fk}) ({r(REPLICA_KL_BITS)})", "replicas with selections in their windows"),
        (FLEET_MEDIAN_REPLICA_KL, f"quantile by ({fk}) (0.5, {r(REPLICA_KL_BITS)})", "the median replica's KL"),
    ]
