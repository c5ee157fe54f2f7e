"""Routing statistics for learned routers: MoE expert gates and DSA indexers.

For one router over a window, let ``c_j`` be how often slot ``j`` was selected
(``j = 0..N-1``), ``p_j = c_j / sum(c)`` and ``H = -sum(p_j * log2 p_j)`` in bits.

* **Expert routers** (MoE gates): slots are experts, ``N = n_routed_experts`` and
  ``k`` experts are picked per token.  Every token picks ``k`` distinct experts, so
  ``log2 k <= H <= log2 N`` (64 experts, top-6: 2.585 ... 6.000 bits).
* **DSA indexers**: each query selects ``min(index_topk, t + 1)`` of its ``t + 1``
  visible keys; slots are key positions.  The ceiling grows with context, so the
  statistics use the *effective* slots (index of the last slot with a nonzero count,
  plus one; at least one): ceiling ``log2(effective)``, floor
  ``log2(min(top_k, effective))``.  *Locality* is the share of selections that fall
  within the query's most recent ``index_topk`` positions, over queries that had a
  real choice - at least ``2 * index_topk`` visible keys, where picks at random would put at most
  half there (``local_selections / choice_selections``; ``None`` when no query had one).

Because entropy is insensitive near the top, the module also reports the normalized
entropy, MaxVio (relative overload of the busiest slot), dead slots and the
Jensen–Shannon divergence (bits) from a recorded healthy baseline.

Small windows read low: the plug-in estimator is biased downwards by roughly
``(N - 1) / (2 * n * ln 2)`` bits for ``n`` selections (Miller–Madow), so a perfectly
uniform 64/6 router reads about 5.49 bits over 16 tokens.
:func:`minimum_window_tokens` gives the token count above which that bias is within a
tolerance; readings over fewer tokens are flagged ``too_small`` (but still computed).

:class:`RollingWindow` (the sum of the most recent count deltas, bounded by a token
budget and/or an age limit) and :class:`WindowTotals` live in :mod:`mla_watch.routing.rolling`
and are re-exported here; the shared argument checks live in :mod:`mla_watch.routing.checks`.

This module depends on numpy and scipy only (no torch): it is imported by processes
that never load a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from mla_watch.routing.checks import as_counts, check_local_choice, check_nonnegative_int, check_positive_int
from mla_watch.routing.rolling import RollingWindow, WindowTotals

__all__ = [
    "BASELINE_METRICS",
    "KINDS",
    "RULE_METRICS",
    "STATISTICS",
    "Kind",
    "RollingWindow",
    "RoutingStats",
    "Statistic",
    "WindowTotals",
    "compute_stats",
    "dead_slots",
    "entropy_bits",
    "entropy_bounds",
    "entropy_rows",
    "expected_uniform_entropy_bits",
    "js_divergence_bits",
    "js_divergence_rows",
    "max_violation",
    "minimum_window_tokens",
    "normalized_entropy",
]

Kind = Literal["expert", "indexer"]

KINDS: tuple[str, ...] = ("expert", "indexer")
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------
# scalar metrics
# ---------------------------------------------------------------------------


def entropy_bits(counts: ArrayLike) -> float:
    """Plug-in Shannon entropy (bits) of the selection frequencies in ``counts``.

    Returns 0.0 for an empty vector or one with no selections.
    """
    arr = as_counts(counts)
    total = float(arr.sum())
    if total <= 0.0:
        return 0.0
    p = arr[arr > 0] / total
    h = float(-np.sum(p * np.log2(p)))
    return max(h, 0.0)


def entropy_bounds(num_slots: int, top_k: int) -> tuple[float, float]:
    """``(floor, ceiling) = (log2 min(top_k, num_slots), log2 num_slots)`` in bits."""
    n = check_positive_int(num_slots, "num_slots")
    k = check_positive_int(top_k, "top_k")
    return math.log2(min(k, n)), math.log2(n)


def normalized_entropy(entropy: float, floor: float, ceiling: float) -> float:
    """``(entropy - floor) / (ceiling - floor)`` clipped to ``[0, 1]``; 1.0 when ceiling == floor."""
    if ceiling <= floor:
        return 1.0
    value = (float(entropy) - float(floor)) / (float(ceiling) - float(floor))
    return min(max(value, 0.0), 1.0)


def max_violation(counts: ArrayLike) -> float:
    """MaxVio: ``(max_j c_j - mean_j c_j) / mean_j c_j`` over all slots; 0.0 with no selections."""
    arr = as_counts(counts)
    if arr.size == 0:
        return 0.0
    mean = float(arr.mean())
    if mean <= 0.0:
        return 0.0
    return max((float(arr.max()) - mean) / mean, 0.0)


def dead_slots(counts: ArrayLike) -> int:
    """Number of slots that were never selected."""
    arr = as_counts(counts)
    return int(np.count_nonzero(arr == 0))


def js_divergence_bits(counts: ArrayLike, baseline: ArrayLike) -> float:
    """Jensen–Shannon divergence (bits, in ``[0, 1]``) between two count vectors.

    Both vectors are normalized to distributions first.  They must have the same
    length (:func:`compute_stats` pads indexer vectors) and each must contain at least
    one selection; otherwise ``ValueError``.
    """
    p = as_counts(counts, "counts")
    q = as_counts(baseline, "baseline")
    if p.shape[0] != q.shape[0]:
        raise ValueError(f"counts has length {p.shape[0]} but baseline has length {q.shape[0]}")
    if not p.sum() > 0:
        raise ValueError("counts has no selections; Jensen–Shannon divergence is undefined")
    if not q.sum() > 0:
        raise ValueError("baseline has no selections; Jensen–Shannon divergence is undefined")
    from scipy.spatial.distance import jensenshannon  # here: scipy.spatial takes ~0.5 s to import, --help none

    with np.errstate(invalid="ignore", divide="ignore"):
        distance = float(jensenshannon(p, q, base=2))
    if not math.isfinite(distance):  # tiny negative sum under the square root
        return 0.0
    return min(max(distance * distance, 0.0), 1.0)


def js_divergence_rows(counts: np.ndarray, baselines: np.ndarray) -> np.ndarray:
    """:func:`js_divergence_bits` of each row pair of two ``[n, slots]`` count arrays at once (bits); a row pair
    where either row has no selection reads NaN."""
    p = np.asarray(counts, dtype=np.float64)
    q = np.asarray(baselines, dtype=np.float64)
    p_sum, q_sum = p.sum(axis=1, keepdims=True), q.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p, q = p / p_sum, q / q_sum
        m = (p + q) / 2
        half = [
            np.where(x > 0, x * np.log2(np.where(x > 0, x, 1) / np.where(m > 0, m, 1)), 0.0).sum(axis=1) for x in (p, q)
        ]
    divergence = np.clip((half[0] + half[1]) / 2, 0.0, 1.0)
    return np.where((p_sum[:, 0] > 0) & (q_sum[:, 0] > 0), divergence, np.nan)


def entropy_rows(counts: np.ndarray) -> np.ndarray:
    """:func:`entropy_bits` of each row of a ``[n, slots]`` count array at once (0 for a row of no selection)."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, c / np.where(total > 0, total, 1), 0.0)
        return -np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0.0).sum(axis=1) + 0.0


def minimum_window_tokens(num_slots: int, top_k: int, tolerance_bits: float = 0.05) -> int:
    """Smallest token count ``T >= 1`` with Miller–Madow bias ``(N-1)/(2 T k ln 2) <= tolerance_bits``.

    ``k`` is capped at ``N`` (a token cannot select more slots than exist).
    For 64 experts, top-6 and 0.05 bits this is 152 tokens.
    """
    n = check_positive_int(num_slots, "num_slots")
    k = min(check_positive_int(top_k, "top_k"), n)
    tol = float(tolerance_bits)
    if not (math.isfinite(tol) and tol > 0.0):
        raise ValueError(f"tolerance_bits must be a positive finite number, got {tolerance_bits!r}")
    if n == 1:
        return 1

    def bias(tokens: int) -> float:
        return (n - 1) / (2.0 * tokens * k * _LN2)

    t = max(1, math.ceil((n - 1) / (2.0 * k * _LN2 * tol)))
    # guard against floating-point rounding at the boundary
    while t > 1 and bias(t - 1) <= tol:
        t -= 1
    while bias(t) > tol:
        t += 1
    return t


def expected_uniform_entropy_bits(num_slots: int, top_k: int, tokens: int) -> float:
    """Expected plug-in entropy of a perfectly uniform router over ``tokens`` tokens.

    Miller–Madow approximation ``max(floor, log2 N - (N-1)/(2 * tokens * k * ln 2))``,
    with ``k`` capped at ``N``.  Use it to explain low readings on small windows.
    """
    floor, ceiling = entropy_bounds(num_slots, top_k)
    t = check_positive_int(tokens, "tokens")
    k = min(int(top_k), int(num_slots))
    bias = (int(num_slots) - 1) / (2.0 * t * k * _LN2)
    return max(floor, ceiling - bias)


def _effective_slots(counts: np.ndarray) -> int:
    nonzero = np.flatnonzero(counts)
    return int(nonzero[-1]) + 1 if nonzero.size else 1


# ---------------------------------------------------------------------------
# combined statistics
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Statistic:
    """One statistic of :class:`RoutingStats`: its key (the attribute, and the key of every record), its Prometheus
    gauge (``mla_watch_`` + ``gauge``) with its help, and whether an alert rule may watch it."""

    key: str
    gauge: str
    help: str
    judged: bool = True


# The one list of routing statistics: records, alert rules, the metrics, the Prometheus export, the history and
# the baselines all read it.
STATISTICS: tuple[Statistic, ...] = (
    Statistic("entropy_bits", "routing_entropy_bits", "Routing entropy over the current window, in bits."),
    Statistic(
        "floor_bits", "routing_entropy_floor_bits", "Lowest possible routing entropy: log2 of the top-k.", judged=False
    ),
    Statistic(
        "ceiling_bits",
        "routing_entropy_ceiling_bits",
        "Highest possible routing entropy: log2 of the slots.",
        judged=False,
    ),
    Statistic("normalized_entropy", "routing_normalized_entropy", "(entropy - floor) / (ceiling - floor)."),
    Statistic("bits_below_ceiling", "routing_bits_below_ceiling", "Ceiling minus entropy, in bits."),
    Statistic("max_violation", "routing_max_violation", "MaxVio: (max load - mean load) / mean load."),
    Statistic("dead_slots", "routing_dead_slots", "Slots (experts or key positions) never chosen in the window."),
    Statistic("tokens", "routing_window_tokens", "Tokens in the current window.", judged=False),
    Statistic(
        "selections",
        "routing_window_selections",
        "Selections in the current window (each token's top-k picks).",
        judged=False,
    ),
    Statistic("js_divergence", "routing_js_divergence", "Jensen-Shannon divergence from the baseline, in bits."),
    Statistic(
        "long_context_drift",
        "routing_long_context_drift_bits",
        "Jensen-Shannon divergence, in bits, of the first position bucket that leaves the line's in-range "
        "routing (else the largest of the judged buckets); only where positions are counted.",
    ),
    Statistic(
        "locality", "routing_indexer_locality", "Share of indexer choices within the most recent index_topk keys."
    ),
    Statistic(
        "too_small",
        "routing_window_too_small",
        "1 while the window holds fewer tokens than the trusted minimum.",
        judged=False,
    ),
)
# What an alert rule's `metric` may name.
RULE_METRICS: tuple[str, ...] = tuple(statistic.key for statistic in STATISTICS if statistic.judged)
# What a healthy baseline keeps the value of: the rule metrics but the drifts, which are measured from a reference.
BASELINE_METRICS: tuple[str, ...] = tuple(
    key for key in RULE_METRICS if key not in ("js_divergence", "long_context_drift")
)


@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics of one router over one window."""

    kind: Kind
    num_slots: int  # N (for indexers: effective slots)
    top_k: int
    tokens: int
    selections: int
    entropy_bits: float
    floor_bits: float
    ceiling_bits: float
    normalized_entropy: float
    max_violation: float
    dead_slots: int
    js_divergence: float | None
    locality: float | None
    min_tokens: int
    too_small: bool
    # Routing by position (routing/positions.py), where it is counted: the drift of the first bucket that leaves the
    # line's in-range routing, and that bucket ("256-511").
    long_context_drift: float | None = None
    long_context_edge: str | None = None
    # What that drift compares, and who sent the tokens it was read on (``client-a 61%, client-b 39%``).
    long_context_compared: str | None = None
    long_context_clients: str | None = None

    @property
    def no_signal(self) -> str | None:
        """Why this window's figures say nothing about the router's health, or ``None`` when they do.

        An indexer none of whose queries saw twice the keys it may pick selected all or nearly all of them: its
        entropy and locality describe the contexts' lengths, not the indexer. A window under its trusted
        minimum reads low.
        """
        if self.selections == 0:
            return "no traffic in the window"
        if self.kind == "indexer" and self.locality is None:
            return (
                f"no query saw 2 x index_topk = {2 * self.top_k} keys or more: the indexer picked all or "
                "nearly all it saw, so its choices carry no signal"
            )
        if self.too_small:
            return f"{self.tokens} tokens, under this router's trusted minimum of {self.min_tokens}"
        return None

    @property
    def bits_below_ceiling(self) -> float:
        """How far the entropy sits below its ceiling: a threshold in these units fits any geometry."""
        return max(self.ceiling_bits - self.entropy_bits, 0.0) if self.selections else 0.0

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly plain-type dictionary of all fields."""
        return {
            "kind": str(self.kind),
            "num_slots": int(self.num_slots),
            "top_k": int(self.top_k),
            "tokens": int(self.tokens),
            "selections": int(self.selections),
            "entropy_bits": float(self.entropy_bits),
            "floor_bits": float(self.floor_bits),
            "ceiling_bits": float(self.ceiling_bits),
            "normalized_entropy": float(self.normalized_entropy),
            "bits_below_ceiling": float(self.bits_below_ceiling),
            "max_violation": float(self.max_violation),
            "dead_slots": int(self.dead_slots),
            "js_divergence": None if self.js_divergence is None else float(self.js_divergence),
            "locality": None if self.locality is None else float(self.locality),
            "min_tokens": int(self.min_tokens),
            "too_small": bool(self.too_small),
            "no_signal": self.no_signal,
            "long_context_drift": None if self.long_context_drift is None else float(self.long_context_drift),
            "long_context_edge": self.long_context_edge,
            "long_context_compared": self.long_context_compared,
            "long_context_clients": self.long_context_clients,
        }


def compute_stats(
    counts: ArrayLike,
    *,
    kind: Kind,
    top_k: int,
    tokens: int,
    baseline: ArrayLike | None = None,
    local_selections: int = 0,
    choice_selections: int = 0,
    min_tokens: int | None = None,
    tolerance_bits: float = 0.05,
    distinct_picks: bool = True,
) -> RoutingStats:
    """Compute :class:`RoutingStats` for one router's selection counts over a window.

    For ``kind == "expert"`` the slots are all ``len(counts)`` experts and a baseline
    of a different length is a ``ValueError``.  For ``kind == "indexer"`` the slots are
    the effective key positions (up to the last selected one) and the baseline is
    zero-padded to match.  ``locality`` is only reported for indexers.  With no
    selections at all every metric is finite: entropy 0, normalized 0, MaxVio 0, all
    slots dead, no divergence.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    k = check_positive_int(top_k, "top_k")
    n_tokens = check_nonnegative_int(tokens, "tokens")
    local, choice = check_local_choice(local_selections, choice_selections)
    arr = as_counts(counts)

    if kind == "expert":
        if arr.size == 0:
            raise ValueError("counts must have at least one slot for kind='expert', got length 0")
        n = int(arr.size)
        slot_counts = arr
    else:
        n = _effective_slots(arr)
        slot_counts = arr[:n] if arr.size >= n else np.zeros(n, dtype=np.float64)

    floor, ceiling = entropy_bounds(n, k)
    total = float(slot_counts.sum())
    selections = round(total)
    if not distinct_picks:
        # A hash router's lookup table may give one token the same expert twice: no log2 k floor.
        floor = 0.0
    elif kind == "indexer" and n_tokens > 0 and selections < k * n_tokens:
        # On short contexts a query sees fewer keys than it may pick. The pooled distribution's largest
        # share is at most 1 / (mean picks per query), so log2 of the picks actually made is the floor.
        made = selections / n_tokens
        floor = math.log2(made) if made > 1 else 0.0

    if min_tokens is None:
        needed = minimum_window_tokens(n, k, tolerance_bits)
    else:
        needed = check_nonnegative_int(min_tokens, "min_tokens")

    js: float | None = None
    if baseline is not None:
        base = as_counts(baseline, "baseline")
        if kind == "expert":
            if base.shape[0] != n:
                raise ValueError(f"counts has length {n} but baseline has length {base.shape[0]}")
            p, q = slot_counts, base
        else:
            length = max(n, int(base.shape[0]))
            p = np.zeros(length, dtype=np.float64)
            p[:n] = slot_counts
            q = np.zeros(length, dtype=np.float64)
            q[: base.shape[0]] = base
        if total > 0:
            js = js_divergence_bits(p, q)
        elif not q.sum() > 0:
            raise ValueError("baseline has no selections; Jensen–Shannon divergence is undefined")

    if total > 0:
        h = entropy_bits(slot_counts)
        norm = normalized_entropy(h, floor, ceiling)
        vio = max_violation(slot_counts)
    else:
        h, norm, vio = 0.0, 0.0, 0.0

    locality: float | None = None
    if kind == "indexer" and choice > 0:
        locality = local / choice

    return RoutingStats(
        kind=kind,
        num_slots=n,
        top_k=k,
        tokens=n_tokens,
        selections=selections,
        entropy_bits=h,
        floor_bits=floor,
        ceiling_bits=ceiling,
        normalized_entropy=norm,
        max_violation=vio,
        dead_slots=dead_slots(slot_counts),
        js_divergence=js,
        locality=locality,
        min_tokens=needed,
        too_small=n_tokens < needed,
    )
