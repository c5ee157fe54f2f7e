"""The shipped rules on the bundled model: healthy traffic pages no one, each fault pages (harness/detection_replay.py).

Every replay starts afresh as ``mla-watch serve`` does (windows, learned baselines, alert state and a
webhook receiver of its own) with every rule's ``for:`` at 0 s, so any breach would page. The replays
are shorter than bench/detection.py's (which prints the figures) but long enough for every line's
baseline to be learned and judged against.
"""

from __future__ import annotations

import pytest

from harness.detection_replay import FAULTS, fault_replay, healthy_replay
from mla_watch.models import corpus

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("kind", "tokens"),
    [("mixed", 14000), ("low_diversity", 12000), ("short", 6000), *[(line, 5000) for line in corpus.DOMAINS]],
)
def test_healthy_traffic_pages_no_one(bundled, kind: str, tokens: int) -> None:
    model, tokenizer = bundled
    replay = healthy_replay(model, tokenizer, kind, tokens)
    assert replay.tokens >= tokens * 0.8
    assert replay.pages == [], [(p.alertname, p.router, p.business_line, p.summary) for p in replay.pages]
    if kind != "short":  # chat-sized requests fill no line's window to the baseline's 2048 tokens this soon
        assert replay.baselines > 0 and replay.peaks  # the baseline rules judged this traffic
        assert replay.peaks["max_violation_ratio"] < 2.0 and replay.peaks["js_divergence"] < 0.05


@pytest.mark.parametrize("fault", FAULTS, ids=[fault.name for fault in FAULTS])
def test_each_fault_pages_within_its_stated_tokens(bundled, fault) -> None:
    model, tokenizer = bundled
    result = fault_replay(model, tokenizer, fault, limit_tokens=fault.within_tokens + 2000)
    assert result["false_pages_before_onset"] == 0
    assert result["paged"], result
    assert result["cause"] == "model", result  # the reference prompts route differently too
    assert result["tokens_after_onset"] <= fault.within_tokens, result
    if fault.alertname != "RoutingEntropyLow":  # what entropy alone misses
        assert result["entropy_bits_then"] > 5.0 and "RoutingEntropyLow" not in result["other_pages"], result
    if fault.alertname == "ExpertHotspot":
        assert "healthy" in result["summary"] and "n/a" not in result["summary"], result["summary"]
