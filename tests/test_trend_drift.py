"""Proof on the bundled model: a slow routing drift warns (RoutingEntropyFalling) days before it pages.

Four simulated days through the real model and probe (harness/drift_replay.py): the correction bias of
four experts of one router rises by 0.003 every simulated hour, on top of ordinary hourly noise, and
its entropy sinks from ~5.6 bits to below RoutingEntropyLow's 5.0. The same four days with the noise
alone raise no trend alert at all.
"""

from __future__ import annotations

import pytest

import mla_watch
from harness.drift_replay import DRIFTING_ROUTER, replay

TREND_ALERTS = ("RoutingEntropyFalling", "RoutingCollapseForecast")
DAYS = 4


@pytest.fixture(scope="module")
def model():
    model, _ = mla_watch.load_model("bundled", device="cpu")
    return model


@pytest.mark.slow
def test_a_slow_drift_warns_a_day_before_the_threshold_rule_pages(model) -> None:
    drift = replay(model, hours=DAYS * 24, drift_per_hour=0.003)
    low, falling = drift.first("RoutingEntropyLow"), drift.first("RoutingEntropyFalling")
    assert low is not None, f"the drift never reached 5.0 bits: {drift.entropy[-1]}"
    assert falling is not None
    assert low.hours - falling.hours >= 24, (falling, low)
    assert "below 5.0 bits in" in falling.summary
    # the warning is about the drifting router; the others' routing does not sink below 5.0
    assert {f.router for f in drift.firings if f.alertname == "RoutingEntropyLow"} == {DRIFTING_ROUTER}


@pytest.mark.slow
def test_a_healthy_replay_of_the_same_length_raises_no_trend_alert(model) -> None:
    healthy = replay(model, hours=DAYS * 24, drift_per_hour=0.0)
    assert healthy.steps == DAYS * 24 * 3
    assert [f for f in healthy.firings if f.alertname in TREND_ALERTS] == []
    assert min(bits for _, bits in healthy.entropy) > 5.3  # healthy indeed: far from the threshold
