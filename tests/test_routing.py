"""Tests for mla_watch.routing.stats: entropy figures, bounds, properties, indexers and rolling windows."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.helpers import FakeClock
from mla_watch.routing.stats import (
    RollingWindow,
    RoutingStats,
    WindowTotals,
    compute_stats,
    dead_slots,
    entropy_bits,
    entropy_bounds,
    expected_uniform_entropy_bits,
    js_divergence_bits,
    max_violation,
    minimum_window_tokens,
    normalized_entropy,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def simulate_topk(
    rng: np.random.Generator, num_slots: int, top_k: int, tokens: int, weights: np.ndarray | None = None
) -> np.ndarray:
    """Counts of a router that picks ``top_k`` distinct slots per token."""
    counts = np.zeros(num_slots, dtype=np.int64)
    for _ in range(tokens):
        counts[rng.choice(num_slots, size=top_k, replace=False, p=weights)] += 1
    return counts


@st.composite
def topk_counts(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """(counts, top_k) from a possibly skewed top-k router with at least one token."""
    n = draw(st.integers(1, 64))
    k = draw(st.integers(1, n))
    tokens = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    concentration = draw(st.sampled_from([0.05, 0.5, 5.0, 1000.0]))
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(n, concentration))
    weights = np.clip(weights, 1e-12, None)
    weights /= weights.sum()
    return simulate_topk(rng, n, k, tokens, weights), k


# ---------------------------------------------------------------------------
# exact figures
# ---------------------------------------------------------------------------


def test_uniform_64_slots_is_six_bits() -> None:
    assert entropy_bits([10] * 64) == pytest.approx(6.0, abs=1e-12)


def test_only_top_k_experts_chosen_reads_log2_k() -> None:
    counts = [0] * 64
    for j in (3, 10, 17, 40, 41, 63):
        counts[j] = 100
    assert entropy_bits(counts) == pytest.approx(math.log2(6), abs=1e-12)
    assert entropy_bits(counts) == pytest.approx(2.585, abs=1e-3)


def test_entropy_bounds_exact() -> None:
    assert entropy_bounds(64, 6) == pytest.approx((math.log2(6), 6.0))
    assert entropy_bounds(256, 8) == pytest.approx((3.0, 8.0))
    # k larger than N is capped at N
    assert entropy_bounds(4, 8) == pytest.approx((2.0, 2.0))


@pytest.mark.parametrize(("num_slots", "top_k", "param"), [(0, 6, "num_slots"), (64, 0, "top_k"), (-3, 2, "num_slots")])
def test_entropy_bounds_rejects_bad_parameters(num_slots: int, top_k: int, param: str) -> None:
    bad = num_slots if param == "num_slots" else top_k
    with pytest.raises(ValueError, match=rf"{param}.*{bad}"):
        entropy_bounds(num_slots, top_k)


def test_max_violation_one_expert_at_twice_the_mean() -> None:
    counts = [128, 0] + [64] * 62  # mean 64, max 128
    assert max_violation(counts) == pytest.approx(1.0, abs=1e-12)
    assert max_violation([5] * 8) == pytest.approx(0.0, abs=1e-12)
    assert max_violation([0] * 8) == 0.0


def test_one_hot_expert_still_reads_near_six_bits() -> None:
    counts = [100] * 63 + [200]  # one expert carrying twice the load of the others
    h = entropy_bits(counts)
    assert 5.98 < h < 6.0


def test_half_experts_dead_reads_five_bits() -> None:
    counts = [50] * 32 + [0] * 32
    assert entropy_bits(counts) == pytest.approx(5.0, abs=1e-12)
    assert dead_slots(counts) == 32


def test_minimum_window_tokens_design_figure() -> None:
    assert minimum_window_tokens(64, 6) == 152
    # the defining inequality holds at T and fails at T - 1
    t = minimum_window_tokens(256, 8, 0.02)
    assert 255 / (2 * t * 8 * math.log(2)) <= 0.02 < 255 / (2 * (t - 1) * 8 * math.log(2))
    assert minimum_window_tokens(1, 1) == 1
    with pytest.raises(ValueError, match="tolerance_bits"):
        minimum_window_tokens(64, 6, 0.0)


def test_expected_uniform_entropy_small_window_figures() -> None:
    assert expected_uniform_entropy_bits(64, 6, 16) == pytest.approx(5.49, abs=0.1)
    assert expected_uniform_entropy_bits(64, 6, 256) == pytest.approx(5.97, abs=0.02)
    # never below the floor, even for a single token of a huge router
    assert expected_uniform_entropy_bits(4096, 2, 1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="tokens"):
        expected_uniform_entropy_bits(64, 6, 0)


def test_normalized_entropy_edges() -> None:
    assert normalized_entropy(4.0, 2.0, 6.0) == pytest.approx(0.5)
    assert normalized_entropy(3.0, 3.0, 3.0) == 1.0
    assert normalized_entropy(7.0, 2.0, 6.0) == 1.0
    assert normalized_entropy(1.0, 2.0, 6.0) == 0.0


def test_entropy_rejects_bad_vectors() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        entropy_bits([1, -1, 2])
    with pytest.raises(ValueError, match="1-D"):
        entropy_bits([[1, 2], [3, 4]])
    assert entropy_bits([]) == 0.0
    assert entropy_bits([0, 0, 0]) == 0.0


def test_no_warnings_from_zero_counts() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert entropy_bits([0, 4, 0, 4]) == pytest.approx(1.0)
        js_divergence_bits([0, 4, 0, 4], [4, 0, 4, 0])
        compute_stats([0, 0, 0, 0], kind="expert", top_k=2, tokens=0, baseline=[1, 1, 1, 1])


# ---------------------------------------------------------------------------
# small-window simulation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "reps", "expected"), [(16, 12, 5.49), (64, 6, 5.89), (256, 3, 5.97)])
def test_uniform_router_small_window_reads_low(tokens: int, reps: int, expected: float) -> None:
    rng = np.random.default_rng(1234 + tokens)
    readings = [entropy_bits(simulate_topk(rng, 64, 6, tokens)) for _ in range(reps)]
    assert float(np.mean(readings)) == pytest.approx(expected, abs=0.1)
    # and the Miller–Madow expectation explains the reading
    assert float(np.mean(readings)) == pytest.approx(expected_uniform_entropy_bits(64, 6, tokens), abs=0.1)


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------


@FAST
@given(topk_counts())
def test_topk_router_metrics_within_bounds(sample: tuple[np.ndarray, int]) -> None:
    counts, k = sample
    n = counts.size
    floor, ceiling = entropy_bounds(n, k)
    h = entropy_bits(counts)
    assert floor - 1e-9 <= h <= ceiling + 1e-9
    assert 0.0 <= normalized_entropy(h, floor, ceiling) <= 1.0
    assert max_violation(counts) >= 0.0
    assert 0 <= dead_slots(counts) <= n
    stats = compute_stats(counts, kind="expert", top_k=k, tokens=int(counts.sum()) // k)
    assert stats.floor_bits - 1e-9 <= stats.entropy_bits <= stats.ceiling_bits + 1e-9
    assert 0.0 <= stats.normalized_entropy <= 1.0


@FAST
@given(topk_counts(), st.integers(0, 2**32 - 1))
def test_js_divergence_properties(sample: tuple[np.ndarray, int], seed: int) -> None:
    counts, k = sample
    other = simulate_topk(np.random.default_rng(seed), counts.size, k, 5)
    js = js_divergence_bits(counts, other)
    assert 0.0 <= js <= 1.0
    assert js_divergence_bits(counts, counts) == pytest.approx(0.0, abs=1e-12)
    assert js_divergence_bits(other, counts) == pytest.approx(js, abs=1e-12)


@FAST
@given(topk_counts(), st.integers(0, 2**32 - 1), st.integers(1, 1000))
def test_entropy_invariant_to_permutation_and_scaling(sample: tuple[np.ndarray, int], seed: int, factor: int) -> None:
    counts, _ = sample
    h = entropy_bits(counts)
    permuted = np.random.default_rng(seed).permutation(counts)
    assert entropy_bits(permuted) == pytest.approx(h, abs=1e-9)
    assert entropy_bits(counts * factor) == pytest.approx(h, abs=1e-9)


def test_js_divergence_known_values() -> None:
    assert js_divergence_bits([1, 0], [0, 1]) == pytest.approx(1.0)
    assert js_divergence_bits([2, 2], [7, 7]) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match=r"3.*2"):
        js_divergence_bits([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="baseline"):
        js_divergence_bits([1, 2], [0, 0])


# ---------------------------------------------------------------------------
# compute_stats
# ---------------------------------------------------------------------------


def test_compute_stats_expert_fields_and_json() -> None:
    counts = [100] * 32 + [0] * 32
    stats = compute_stats(counts, kind="expert", top_k=6, tokens=100, baseline=[1] * 64)
    assert isinstance(stats, RoutingStats)
    assert stats.num_slots == 64
    assert stats.selections == 3200
    assert stats.entropy_bits == pytest.approx(5.0)
    assert stats.floor_bits == pytest.approx(math.log2(6))
    assert stats.ceiling_bits == pytest.approx(6.0)
    assert stats.normalized_entropy == pytest.approx((5.0 - math.log2(6)) / (6.0 - math.log2(6)))
    assert stats.max_violation == pytest.approx(1.0)
    assert stats.dead_slots == 32
    # JS between uniform-over-half and uniform-over-all, computed from the definition
    p = np.array([1 / 32] * 32 + [0] * 32)
    q = np.full(64, 1 / 64)
    m = (p + q) / 2
    expected = 0.5 * np.sum(p[p > 0] * np.log2(p[p > 0] / m[p > 0])) + 0.5 * np.sum(q * np.log2(q / m))
    assert stats.js_divergence == pytest.approx(expected)
    assert stats.locality is None
    assert stats.min_tokens == 152
    assert stats.too_small is True
    d = stats.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert all(type(v) in (str, int, float, bool, type(None)) for v in d.values())
    assert set(d) == set(RoutingStats.__dataclass_fields__) | {"bits_below_ceiling", "no_signal"}  # derived
    assert d["bits_below_ceiling"] == pytest.approx(1.0)
    assert d["no_signal"] == "100 tokens, under this router's trusted minimum of 152"


def test_no_signal_names_why_a_window_says_nothing() -> None:
    assert compute_stats([0] * 64, kind="expert", top_k=6, tokens=0).no_signal == "no traffic in the window"
    healthy = compute_stats([100] * 64, kind="expert", top_k=6, tokens=1000)
    assert healthy.no_signal is None
    # contexts of 40 keys, index_topk 64: every query selected all the keys it saw
    short = compute_stats([40 - j for j in range(40)], kind="indexer", top_k=64, tokens=40)
    assert short.locality is None and "2 x index_topk = 128" in short.no_signal
    # with some queries past index_topk the indexer chose, and its locality is a signal
    long = compute_stats(
        [1] * 300, kind="indexer", top_k=4, tokens=300, min_tokens=100, local_selections=200, choice_selections=1000
    )
    assert long.locality == pytest.approx(0.2) and long.no_signal is None


def test_compute_stats_expert_locality_ignored_and_window_flag() -> None:
    stats = compute_stats([5] * 64, kind="expert", top_k=6, tokens=200, local_selections=3, choice_selections=4)
    assert stats.locality is None
    assert stats.too_small is False
    assert stats.js_divergence is None
    custom = compute_stats([5] * 64, kind="expert", top_k=6, tokens=200, min_tokens=500)
    assert custom.min_tokens == 500 and custom.too_small is True
    at_minimum = compute_stats([5] * 64, kind="expert", top_k=6, tokens=152)
    assert at_minimum.too_small is False
    assert compute_stats([5] * 64, kind="expert", top_k=6, tokens=151).too_small is True


def test_compute_stats_no_selections_is_nan_free() -> None:
    stats = compute_stats(np.zeros(64, dtype=int), kind="expert", top_k=6, tokens=0, baseline=np.ones(64))
    assert stats.entropy_bits == 0.0
    assert stats.normalized_entropy == 0.0
    assert stats.max_violation == 0.0
    assert stats.dead_slots == 64
    assert stats.selections == 0
    assert stats.js_divergence is None
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in stats.as_dict().values())


def test_compute_stats_expert_baseline_length_mismatch() -> None:
    with pytest.raises(ValueError, match=r"64.*32"):
        compute_stats([1] * 64, kind="expert", top_k=6, tokens=10, baseline=[1] * 32)


def test_compute_stats_rejects_bad_kind_and_counts() -> None:
    with pytest.raises(ValueError, match="kind"):
        compute_stats([1, 2], kind="gate", top_k=1, tokens=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k"):
        compute_stats([1, 2], kind="expert", top_k=0, tokens=1)
    with pytest.raises(ValueError, match="local_selections"):
        compute_stats([1, 2], kind="indexer", top_k=1, tokens=1, local_selections=5, choice_selections=2)


# ---------------------------------------------------------------------------
# indexers
# ---------------------------------------------------------------------------


def test_an_indexer_floor_comes_from_the_picks_actually_made_so_entropy_never_reads_below_it() -> None:
    # Short contexts: query q sees q + 1 keys and picks them all (index_topk 64 is never reached).
    counts = np.zeros(512, dtype=int)
    for query in range(40):
        counts[: query + 1] += 1
    stats = compute_stats(counts, kind="indexer", top_k=64, tokens=40)
    assert stats.floor_bits == pytest.approx(math.log2(counts.sum() / 40))
    assert stats.floor_bits <= stats.entropy_bits <= stats.ceiling_bits
    assert 0.0 < stats.normalized_entropy < 1.0
    # Nearly every query picking the same five keys of ten reads close to the floor.
    same = np.zeros(512, dtype=int)
    same[:5] = 39
    same[:10] += 1
    near = compute_stats(same, kind="indexer", top_k=64, tokens=40)
    assert near.floor_bits < near.entropy_bits and near.normalized_entropy < 0.2


def test_indexer_effective_slots_and_bounds() -> None:
    counts = np.zeros(4096, dtype=int)
    counts[:100] = 3  # context so far only reaches position 99
    stats = compute_stats(counts, kind="indexer", top_k=2048, tokens=100)
    assert stats.num_slots == 100
    # 300 picks over 100 queries: 3 per query, so the pooled entropy could be as low as log2(3).
    assert stats.floor_bits == pytest.approx(math.log2(3))
    assert stats.ceiling_bits == pytest.approx(math.log2(100))
    assert stats.normalized_entropy == 1.0
    assert stats.dead_slots == 0

    counts[:4000] = 1
    counts[3000] = 0
    longer = compute_stats(counts, kind="indexer", top_k=2048, tokens=1)
    assert longer.num_slots == 4000
    assert longer.floor_bits == pytest.approx(11.0)  # every query picked its index_topk
    assert longer.ceiling_bits == pytest.approx(math.log2(4000))
    assert longer.dead_slots == 1  # only position 3000 among the effective slots, not the tail
    assert 0.0 < longer.normalized_entropy < 1.0


def test_indexer_dead_slots_inside_effective_range() -> None:
    stats = compute_stats([2, 0, 1, 0, 0, 0], kind="indexer", top_k=1, tokens=3)
    assert stats.num_slots == 3
    assert stats.dead_slots == 1
    assert stats.max_violation == pytest.approx(2 / 1 - 1)


def test_indexer_no_selections() -> None:
    stats = compute_stats([0, 0, 0], kind="indexer", top_k=4, tokens=0)
    assert stats.num_slots == 1
    assert stats.entropy_bits == 0.0
    assert stats.normalized_entropy == 0.0
    assert stats.dead_slots == 1
    assert stats.locality is None


def test_indexer_locality() -> None:
    stats = compute_stats([3, 1, 2], kind="indexer", top_k=2, tokens=3, local_selections=3, choice_selections=4)
    assert stats.locality == pytest.approx(0.75)
    none = compute_stats([3, 1, 2], kind="indexer", top_k=2, tokens=3, local_selections=0, choice_selections=0)
    assert none.locality is None


def test_indexer_baseline_is_zero_padded() -> None:
    short = compute_stats([3, 1], kind="indexer", top_k=1, tokens=2, baseline=[1, 2, 3, 4])
    assert short.js_divergence == pytest.approx(js_divergence_bits([3, 1, 0, 0], [1, 2, 3, 4]))
    assert short.js_divergence > 0.0
    long = compute_stats([1, 2, 3, 4], kind="indexer", top_k=1, tokens=4, baseline=[3, 1])
    assert long.js_divergence == pytest.approx(short.js_divergence)
    same = compute_stats([2, 2, 0, 0, 0], kind="indexer", top_k=1, tokens=4, baseline=[5, 5])
    assert same.js_divergence == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------
# RollingWindow
# ---------------------------------------------------------------------------


def test_window_cumulative_without_bounds() -> None:
    window = RollingWindow(3, clock=FakeClock(0.0))
    for _ in range(50):
        window.add([1, 0, 2], 1)
    totals = window.totals()
    assert isinstance(totals, WindowTotals)
    assert totals.counts.tolist() == [50, 0, 100]
    assert totals.counts.dtype == np.int64
    assert totals.tokens == 50
    assert totals.buckets == 50
    assert window.num_slots == 3


def test_window_token_eviction_at_bucket_granularity() -> None:
    window = RollingWindow(2, max_tokens=10, clock=FakeClock(0.0))
    window.add([4, 0], 4)
    window.add([0, 4], 4)
    window.add([1, 1], 4)  # 12 tokens; dropping the first would leave 8 < 10 -> keep all
    assert window.totals().tokens == 12
    assert window.totals().buckets == 3
    window.add([2, 0], 4)  # 16; dropping the first leaves 12 >= 10 -> drop; then 8 < 10 -> stop
    totals = window.totals()
    assert totals.tokens == 12
    assert totals.buckets == 3
    assert totals.counts.tolist() == [3, 5]
    window.add([0, 30], 30)  # one huge bucket: older ones go, the last is always kept
    totals = window.totals()
    assert totals.buckets == 1
    assert totals.tokens == 30
    assert totals.counts.tolist() == [0, 30]


def test_window_token_eviction_boundary_is_inclusive() -> None:
    window = RollingWindow(1, max_tokens=8, clock=FakeClock(0.0))
    for _ in range(3):
        window.add([1], 4)
    # 12 tokens; without the oldest exactly 8 remain, which still reaches max_tokens -> drop it
    totals = window.totals()
    assert totals.buckets == 2 and totals.tokens == 8 and totals.counts.tolist() == [2]


def test_window_time_eviction_with_fake_clock() -> None:
    clock = FakeClock(100.0)
    window = RollingWindow(2, max_seconds=10.0, clock=clock)
    window.add([1, 0], 1)
    clock.now = 105.0
    window.add([0, 1], 1)
    clock.now = 110.0  # first bucket exactly at the cutoff: kept
    assert window.totals().buckets == 2
    clock.now = 110.5  # totals() evicts even without an add
    totals = window.totals()
    assert totals.buckets == 1
    assert totals.counts.tolist() == [0, 1]
    assert totals.oldest == 105.0 and totals.newest == 105.0
    clock.now = 200.0
    empty = window.totals()
    assert empty.buckets == 0 and empty.tokens == 0
    assert empty.counts.tolist() == [0, 0]
    assert empty.oldest is None and empty.newest is None


def test_window_both_bounds() -> None:
    clock = FakeClock(0.0)
    window = RollingWindow(1, max_tokens=5, max_seconds=10.0, clock=clock)
    for t in range(6):
        clock.now = float(t)
        window.add([1], 2)
    totals = window.totals()  # token rule: 3 buckets hold 6 >= 5 tokens; 2 would hold only 4
    assert totals.buckets == 3 and totals.tokens == 6
    assert totals.oldest == 3.0 and totals.newest == 5.0
    clock.now = 14.5  # time rule: cutoff 4.5 drops buckets at 3 and 4
    totals = window.totals()
    assert totals.buckets == 1 and totals.tokens == 2 and totals.oldest == 5.0


def test_window_ignores_empty_adds_and_clears() -> None:
    window = RollingWindow(2, clock=FakeClock(0.0))
    window.add([0, 0], 0)
    assert window.totals().buckets == 0
    window.add([0, 0], 3)  # tokens without selections still count
    window.add([2, 0], 0)  # and so do selections reported without tokens
    window.add(np.array([1, 2]), 1, local_selections=1, choice_selections=2)
    totals = window.totals()
    assert totals.buckets == 3 and totals.tokens == 4
    assert totals.counts.tolist() == [3, 2]
    assert totals.local_selections == 1 and totals.choice_selections == 2
    window.clear()
    cleared = window.totals()
    assert cleared.buckets == 0 and cleared.tokens == 0 and cleared.counts.tolist() == [0, 0]


def test_window_totals_is_a_copy() -> None:
    window = RollingWindow(2, clock=FakeClock(0.0))
    window.add([1, 1], 1)
    window.totals().counts[:] = 99
    assert window.totals().counts.tolist() == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_slots": 0}, "num_slots"),
        ({"num_slots": 4, "max_tokens": 0}, "max_tokens"),
        ({"num_slots": 4, "max_tokens": -5}, "max_tokens"),
        ({"num_slots": 4, "max_seconds": 0.0}, "max_seconds"),
        ({"num_slots": 4, "max_seconds": -1.0}, "max_seconds"),
    ],
)
def test_window_rejects_bad_construction(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        RollingWindow(**kwargs)  # type: ignore[arg-type]


def test_window_rejects_bad_adds() -> None:
    window = RollingWindow(3, clock=FakeClock(0.0))
    with pytest.raises(ValueError, match=r"length 2.*num_slots=3"):
        window.add([1, 2], 1)
    with pytest.raises(ValueError, match="non-negative"):
        window.add([1, -2, 0], 1)
    with pytest.raises(ValueError, match="whole numbers"):
        window.add([1.5, 0, 0], 1)
    with pytest.raises(ValueError, match="tokens"):
        window.add([1, 0, 0], -1)
    with pytest.raises(ValueError, match="local_selections"):
        window.add([1, 0, 0], 1, local_selections=3, choice_selections=1)
    assert window.totals().buckets == 0  # nothing half-added


_ADD = st.tuples(
    st.lists(st.integers(0, 20), min_size=4, max_size=4),
    st.integers(0, 12),
    st.floats(0.0, 5.0, allow_nan=False),
    st.integers(0, 3),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_ADD, max_size=30),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.floats(0.5, 20.0, allow_nan=False)),
    st.floats(0.0, 30.0, allow_nan=False),
)
def test_window_running_sums_match_recomputation(
    adds: list, max_tokens: int | None, max_seconds: float | None, final_dt: float
) -> None:
    clock = FakeClock(0.0)
    window = RollingWindow(4, max_tokens=max_tokens, max_seconds=max_seconds, clock=clock)
    history: list[tuple[float, list[int], int, int]] = []
    for counts, tokens, dt, local in adds:
        clock.now += dt
        choice = local + 1 if tokens else 0
        local_sel = local if tokens else 0
        window.add(counts, tokens, local_selections=local_sel, choice_selections=choice)
        if tokens or any(counts):
            history.append((clock.now, counts, tokens, local_sel))
    clock.now += final_dt

    # from-scratch model: time rule, then the shortest suffix holding >= max_tokens
    start = 0
    if max_seconds is not None:
        while start < len(history) and history[start][0] < clock.now - max_seconds:
            start += 1
    if max_tokens is not None:
        for i in range(len(history) - 1, start, -1):
            if sum(h[2] for h in history[i:]) >= max_tokens:
                start = i
                break
    kept = history[start:]

    totals = window.totals()
    assert totals.buckets == len(kept)
    expected_counts = np.sum([h[1] for h in kept], axis=0) if kept else np.zeros(4)
    assert totals.counts.tolist() == [int(x) for x in expected_counts]
    assert totals.tokens == sum(h[2] for h in kept)
    assert totals.local_selections == sum(h[3] for h in kept)
    assert totals.choice_selections == sum(h[3] + 1 for h in kept if h[2])
    assert totals.oldest == (kept[0][0] if kept else None)
    assert totals.newest == (kept[-1][0] if kept else None)
    if max_tokens is not None and len(history) - start > 1:
        # dropping the oldest kept bucket would fall below the token budget
        assert totals.tokens - kept[0][2] < max_tokens
