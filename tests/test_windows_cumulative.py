"""RouterWindows' cumulative totals per (router, business line): what per-expert counters are built on."""

from __future__ import annotations

import numpy as np
import pytest

from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.windows import RouterWindows

GATE = RouterInfo("model.layers.1.mlp.gate", 1, "expert", 8, 2)
INDEXER = RouterInfo("model.layers.1.self_attn.indexer", 1, "indexer", 16, 4)


def delta(counts: list[int], tokens: int) -> CountDelta:
    return CountDelta(np.array(counts, dtype=np.int64), tokens)


def test_totals_sum_every_delta_per_router_and_line_while_the_window_rolls() -> None:
    windows = RouterWindows([GATE, INDEXER], window_tokens=4)
    rng = np.random.default_rng(7)
    expected: dict[tuple[str, str], np.ndarray] = {}
    tokens: dict[tuple[str, str], int] = {}
    for step in range(40):
        line = ("code_assistant", "customer_service")[step % 2]
        counts = rng.integers(0, 5, size=GATE.num_slots)
        windows.add(GATE.name, line, CountDelta(counts.copy(), 3))
        expected[(GATE.name, line)] = expected.get((GATE.name, line), 0) + counts
        tokens[(GATE.name, line)] = tokens.get((GATE.name, line), 0) + 3
    for key, counts in expected.items():
        total = windows.cumulative(*key)
        assert total is not None
        np.testing.assert_array_equal(total.counts, counts)
        assert total.tokens == tokens[key] == 60
        # The window kept only its last few tokens; the totals kept everything.
        window = windows.window_totals(*key)
        assert window is not None and window.tokens < total.tokens
        assert int(window.counts.sum()) < int(total.counts.sum())
    assert windows.cumulative(INDEXER.name, "code_assistant") is None
    assert windows.cumulative(GATE.name, "doc_summary") is None


def test_reset_forgets_windows_but_never_lowers_the_totals() -> None:
    windows = RouterWindows([GATE], window_tokens=None)
    windows.add(GATE.name, "code_assistant", delta([1, 0, 2, 0, 0, 0, 1, 0], 2))
    windows.reset()
    assert windows.counts("code_assistant")[GATE.name].sum() == 0  # reset behaves as before
    windows.add(GATE.name, "code_assistant", delta([0, 1, 0, 0, 0, 0, 1, 0], 1))
    total = windows.cumulative(GATE.name, "code_assistant")
    assert total is not None and total.tokens == 3
    assert total.counts.tolist() == [1, 1, 2, 0, 0, 0, 2, 0]
    assert windows.counts("code_assistant")[GATE.name].tolist() == [0, 1, 0, 0, 0, 0, 1, 0]


def test_a_refused_delta_changes_neither_the_window_nor_the_totals() -> None:
    windows = RouterWindows([GATE], window_tokens=None)
    windows.add(GATE.name, "code_assistant", delta([1, 1, 0, 0, 0, 0, 0, 0], 1))
    with pytest.raises(ValueError):
        windows.add(GATE.name, "code_assistant", delta([1, 1, 1], 1))  # wrong length
    with pytest.raises(KeyError):
        windows.add("no.such.router", "code_assistant", delta([1] * 8, 1))
    total = windows.cumulative(GATE.name, "code_assistant")
    assert total is not None and total.counts.tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and total.tokens == 1
    assert windows.counts("code_assistant")[GATE.name].tolist() == total.counts.tolist()


def test_all_pairs_at_once_in_first_report_order_as_copies() -> None:
    windows = RouterWindows([GATE, INDEXER], window_tokens=None)
    windows.add(INDEXER.name, "doc_summary", CountDelta(np.ones(16, dtype=np.int64), 4))
    windows.add(GATE.name, "code_assistant", delta([2, 0, 0, 0, 0, 0, 0, 0], 1))
    windows.add(INDEXER.name, "code_assistant", CountDelta(np.ones(16, dtype=np.int64), 4))
    windows.add(GATE.name, "doc_summary", delta([0, 0, 0, 0, 0, 0, 0, 2], 1))
    totals = windows.cumulative_totals()
    assert list(totals) == [
        (INDEXER.name, "doc_summary"),
        (GATE.name, "code_assistant"),
        (INDEXER.name, "code_assistant"),
        (GATE.name, "doc_summary"),
    ]
    totals[(GATE.name, "code_assistant")].counts[0] = 99  # the caller's copy
    one = windows.cumulative(GATE.name, "code_assistant")
    assert one is not None
    one.counts[1] = 99
    again = windows.cumulative(GATE.name, "code_assistant")
    assert again is not None and again.counts.tolist() == [2, 0, 0, 0, 0, 0, 0, 0]


def test_an_empty_delta_opens_the_pair_at_zero() -> None:
    windows = RouterWindows([GATE], window_tokens=None)
    windows.add(GATE.name, "customer_service", delta([0] * 8, 0))
    total = windows.cumulative(GATE.name, "customer_service")
    assert total is not None and total.tokens == 0 and total.counts.tolist() == [0] * 8
    assert windows.business_lines == ["customer_service"]
