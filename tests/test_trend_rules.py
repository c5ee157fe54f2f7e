"""Trend rules: the slope / predict_linear arithmetic, `trend:` / `predict:` in rule files, the engine, the linter."""

from __future__ import annotations

import logging
import re
from functools import partial

import pytest

from harness.helpers import FakeClock, engine_record, write_rules
from mla_watch.alerting.alert_engine import AlertEngine
from mla_watch.alerting.lint import lint
from mla_watch.alerting.rules import RuleError, load_rules_dir
from mla_watch.alerting.trend import MIN_POINTS, TrendSource, crossing_in, enough_data, fit, format_crossing
from mla_watch.alerting.vocabulary import TEMPLATE_FIELDS, Rule, RuleSet, Selector, Trend
from mla_watch.routing.routers import RouterInfo
from tests.memory_history import MemoryHistory

GATE = "model.layers.2.mlp.gate"
T0 = 1_700_000_000.0
HOUR = 3600.0


# --------------------------------------------------------------------------- arithmetic


def test_fit_is_least_squares_with_the_intercept_at_now() -> None:
    times = [T0 + i * 600.0 for i in range(7)]
    values = [6.0 - 0.01 * (t - T0) / HOUR + (0.002 if i % 2 else -0.002) for i, t in enumerate(times)]
    line = fit(times, values, times[-1])
    assert line.slope * HOUR == pytest.approx(-0.01, abs=1e-3)
    assert line.value_at(times[-1]) == pytest.approx(6.0 - 0.01, abs=2e-3)
    # predict_linear: the value 3 days after now, from the intercept at now
    assert line.value_at(times[-1] + 3 * 86400) == pytest.approx(6.0 - 0.01 - 0.72, abs=0.05)


def test_a_flat_or_single_time_series_has_slope_zero_and_a_line_needs_two_points() -> None:
    assert fit([T0, T0, T0], [1.0, 2.0, 3.0], T0).slope == 0.0
    with pytest.raises(ValueError):
        fit([T0], [1.0], T0)


def test_crossing_times() -> None:
    falling = fit([T0, T0 + HOUR], [6.0, 5.9], T0 + HOUR)  # -0.1 bits an hour, 5.9 now
    assert crossing_in(falling, 5.0, T0 + HOUR, below=True) == pytest.approx(9 * HOUR)
    assert crossing_in(falling, 6.0, T0 + HOUR, below=True) == 0.0  # past it already
    assert crossing_in(falling, 6.5, T0 + HOUR, below=False) is None  # heading away
    assert [format_crossing(s) for s in (None, 0.0, 20 * 60.0, 3 * HOUR + 1200, 52 * HOUR, 48 * HOUR)] == [
        "never",
        "now",
        "20m",
        "3h 20m",
        "2d 4h",
        "2d",
    ]


def test_enough_data_needs_points_spanning_half_the_look_back() -> None:
    over = 6 * HOUR
    assert enough_data([T0 + i * 700.0 for i in range(MIN_POINTS)], 3500.0)
    assert not enough_data([T0 + i * 60.0 for i in range(100)], over)  # 100 points bunched in 99 minutes
    assert not enough_data([T0, T0 + 5 * HOUR], over)  # spans it, but two points are not a trend
    assert enough_data([T0 + i * HOUR for i in range(MIN_POINTS)], over)


def test_the_memory_history_is_a_trend_source() -> None:
    history = MemoryHistory()
    history.add(T0, [engine_record(5.9, name=GATE, line=None)])  # js_divergence None: no baseline
    history.add(T0 + 10, [engine_record(5.8, name=GATE, line=None)])
    assert isinstance(history, TrendSource)
    assert history.points(GATE, "all", "entropy_bits", T0 + 1, T0 + 10) == ([T0 + 10], [5.8])
    assert history.points(GATE, "all", "js_divergence", T0, T0 + 10) == ([], [])


# --------------------------------------------------------------------------- rule files


def rule_file(body: str) -> str:
    """A rules file: receiver ``oncall`` and one rule, Falling, on entropy_bits, whose other keys are ``body``."""
    return (
        "receivers: [{name: oncall, type: alertmanager_webhook, url: 'http://127.0.0.1:9/hook'}]\n"
        f"rules:\n  - {{alert: Falling, metric: entropy_bits, {body}}}\n"
    )


@pytest.mark.parametrize(
    ("body", "trend", "below"),
    [
        ("trend: {over: 6h, per: day}, below: -0.5", Trend("slope", 6 * HOUR, per_seconds=86400.0), -0.5),
        ("trend: {over: 6h}, below: -0.02", Trend("slope", 6 * HOUR), -0.02),
        ("predict: {over: 6h, ahead: 3d}, below: 5.0", Trend("predict", 6 * HOUR, ahead_seconds=3 * 86400.0), 5.0),
        # the spelling: the threshold inside the block
        ("predict: {over: 6h, ahead: 3d, below: 5.0}", Trend("predict", 6 * HOUR, ahead_seconds=3 * 86400.0), 5.0),
    ],
)
def test_trend_and_predict_blocks_parse(tmp_path, body, trend, below) -> None:
    (rule,) = load_rules_dir(write_rules(tmp_path, rule_file(body), name="r.yaml")).rules
    assert rule.trend == trend and rule.below == below


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("trend: {over: 6h}, predict: {over: 6h, ahead: 1d}, below: 1", "rules[Falling].predict = "),
        ("trend: {over: 6h, per: week}, below: -1", "rules[Falling].trend.per = 'week': expected hour or day"),
        ("trend: {per: hour}, below: -1", "rules[Falling].trend.over: missing: expected the look-back"),
        ("trend: {over: 0s}, below: -1", "rules[Falling].trend.over = '0s': expected a duration > 0"),
        ("predict: {over: 6h}, below: 5", "rules[Falling].predict.ahead: missing"),
        ("predict: {over: 6h, ahead: soon}, below: 5", "rules[Falling].predict.ahead = 'soon': expected a duration"),
        (
            "predict: {over: 6h, ahead: 1d, below: 5}, above: 6",
            "rules[Falling].above = 6: expected the thresholds in one place",
        ),
        ("predict: {over: 6h, ahead: 1d, below: 5, resolve_above: 4}", "rules[Falling].predict.resolve_above = 4.0"),
        ("predict: {over: 6h, ahead: 1d, when: 5}", "rules[Falling].predict"),
        ("predict: 3d, below: 5", "rules[Falling].predict = '3d': expected a mapping"),
    ],
)
def test_trend_errors_name_file_key_value_and_expectation(tmp_path, body, expected) -> None:
    with pytest.raises(RuleError) as caught:
        load_rules_dir(write_rules(tmp_path, rule_file(body), name="r.yaml"))
    assert expected in str(caught.value) and "r.yaml" in str(caught.value), str(caught.value)


def test_trend_template_fields_are_known_and_checked(tmp_path) -> None:
    assert {"current", "slope_per_hour", "slope_per_day", "predicted", "crossing_in"} <= set(TEMPLATE_FIELDS)
    ok = "predict: {over: 6h, ahead: 3d, below: 5}, annotations: {summary: '{predicted:.2f} in {crossing_in}'}"
    assert load_rules_dir(write_rules(tmp_path, rule_file(ok), name="r.yaml")).rules[0].annotations
    bad = "predict: {over: 6h, ahead: 3d, below: 5}, annotations: {summary: '{crossing_in:.1f}'}"
    with pytest.raises(RuleError, match="a format spec that suits each field"):
        load_rules_dir(write_rules(tmp_path, rule_file(bad), name="r.yaml"))


# --------------------------------------------------------------------------- the engine


record = partial(engine_record, name=GATE, layer=2, min_tokens=152, num_slots=64)


def falling_rule(**kw) -> Rule:
    args = {
        "name": "Falling",
        "metric": "entropy_bits",
        "selector": Selector(kind="expert"),
        "below": 5.0,
        "resolve_above": 5.2,
        "for_seconds": HOUR,
        "trend": Trend("predict", 6 * HOUR, ahead_seconds=3 * 86400.0),
        "annotations": {
            "summary": "{current:.2f} now, {predicted:.2f} in 3d, {slope_per_day:+.2f}/d, "
            "below {threshold} in {crossing_in}"
        },
    }
    args.update(kw)
    return Rule(**args)


def drive(
    engine: AlertEngine,
    history: MemoryHistory,
    clock: FakeClock,
    bits_at,
    hours: float,
    start: float = 0.0,
    tokens: int = 4096,
) -> list:
    """Every 15 simulated minutes from ``start`` for ``hours``: record, evaluate; the notify actions."""
    actions = []
    for i in range(int(hours * 4)):
        clock.now = T0 + (start + i / 4) * HOUR
        rec = record(bits_at(start + i / 4), tokens=tokens)
        history.add(clock.now, [rec])
        actions += [a for a in engine.evaluate([rec]) if a.kind == "notify"]
    return actions


def test_a_predict_rule_warns_on_a_steady_fall_and_resolves_with_hysteresis(tmp_path) -> None:
    clock, history = FakeClock(T0), MemoryHistory()
    engine = AlertEngine(
        RuleSet((falling_rule(),), {}), clock=clock, trend_source=history, state_path=tmp_path / "state.json"
    )
    assert drive(engine, history, clock, lambda h: 5.9, 12) == []  # flat: predicted 5.9
    pages = drive(engine, history, clock, lambda h: 5.9 - 0.02 * (h - 12), 12, start=12)  # -0.48 bits a day
    (page,) = pages
    assert page.alert.status == "firing" and page.alert.value < 5.0
    current, predicted, per_day, crossing = re.fullmatch(
        r"(\S+) now, (\S+) in 3d, (\S+)/d, below 5.0 in (\d+d \d+h|\d+d)", page.alert.annotations["summary"]
    ).groups()
    assert 5.7 < float(current) < 5.9 and float(predicted) == pytest.approx(page.alert.value, abs=0.01)
    assert -0.48 < float(per_day) < 0 and crossing < "3d"  # the line's own crossing, within the 3 days
    # a restart keeps it firing without paging again
    engine = AlertEngine(
        RuleSet((falling_rule(),), {}), clock=clock, trend_source=history, state_path=tmp_path / "state.json"
    )
    assert drive(engine, history, clock, lambda h: 5.9 - 0.02 * (h - 12), 2, start=24) == []
    assert [a.state for a in engine.alerts()] == ["firing"]
    # level again: the prediction climbs back; it resolves only at or above 5.2 (hysteresis)
    resolved = drive(engine, history, clock, lambda h: 5.66, 12, start=26)
    assert [a.alert.status for a in resolved] == ["resolved"]


def test_a_slope_rule_judges_the_slope_per_unit() -> None:
    clock, history = FakeClock(T0), MemoryHistory()
    rule = falling_rule(
        trend=Trend("slope", 6 * HOUR, per_seconds=86400.0),
        below=-0.2,
        resolve_above=None,
        for_seconds=0.0,
        annotations={"summary": "{value:.2f} {slope_per_hour:.3f} {crossing_in}"},
    )
    engine = AlertEngine(RuleSet((rule,), {}), clock=clock, trend_source=history)
    assert drive(engine, history, clock, lambda h: 5.9 - 0.005 * h, 8) == []  # -0.12 a day
    (page,) = drive(engine, history, clock, lambda h: 5.86 - 0.02 * (h - 8), 6, start=8)  # -0.48 a day
    assert page.alert.value < -0.2 and page.alert.annotations["summary"].endswith("n/a")


def test_too_little_history_and_small_windows_are_not_judged() -> None:
    clock, history = FakeClock(T0), MemoryHistory()
    engine = AlertEngine(RuleSet((falling_rule(for_seconds=0.0),), {}), clock=clock, trend_source=history)
    # a steep fall, but only 2.75 hours of a 6-hour look-back: less than half of it
    assert drive(engine, history, clock, lambda h: 5.9 - 0.1 * h, 2.75) == []
    assert engine.alerts() == []
    # min_tokens is judged on the current record's window
    assert drive(engine, history, clock, lambda h: 5.9 - 0.1 * h, 1, start=2.75, tokens=100) == []
    assert len(drive(engine, history, clock, lambda h: 5.9 - 0.1 * h, 0.25, start=3.75)) == 1


def test_without_a_trend_source_trend_rules_are_never_judged(caplog) -> None:
    clock, history = FakeClock(T0), MemoryHistory()
    with caplog.at_level(logging.WARNING, logger="mla_watch.alerting.alert_engine"):
        engine = AlertEngine(RuleSet((falling_rule(for_seconds=0.0),), {}), clock=clock)
    assert "is a trend rule, and this alert engine has no routing history" in caplog.text
    assert drive(engine, history, clock, lambda h: 5.9 - 0.1 * h, 8) == []


# --------------------------------------------------------------------------- the linter


def test_lint_trend_rules(tmp_path) -> None:
    router = RouterInfo(GATE, 2, "expert", 64, 6)
    rules = [
        falling_rule(name="Ok", trend=Trend("predict", 6 * HOUR, ahead_seconds=3 * 86400.0)),
        falling_rule(name="Short", trend=Trend("predict", 30.0, ahead_seconds=3600.0)),
        falling_rule(name="Far", trend=Trend("predict", 6 * HOUR, ahead_seconds=60 * 86400.0)),
        falling_rule(name="Flat", trend=Trend("slope", 6 * HOUR), below=0.1, resolve_above=None),
        falling_rule(name="Steep", trend=Trend("slope", 6 * HOUR), below=-1.0, resolve_above=None),
        falling_rule(
            name="Locality", metric="locality", trend=Trend("slope", 6 * HOUR), below=-0.1, resolve_above=None
        ),
        falling_rule(
            name="Ceiling", trend=Trend("predict", 6 * HOUR, ahead_seconds=86400.0), below=6.5, resolve_above=None
        ),
    ]
    findings = lint(RuleSet(tuple(rules), {}), [router], with_history=True)
    by_rule = {rule.name: [f for f in findings if f.rule == rule.name] for rule in rules}
    assert by_rule["Ok"] == []
    (short,) = by_rule["Short"]
    assert short.severity == "warning" and "over: 30s can never be judged" in short.message
    assert "at the history interval of 10s" in short.message
    (far,) = by_rule["Far"]
    assert "ahead: 8w4d, further ahead than the history keeps (4w2d)" in far.message
    (flat,) = by_rule["Flat"]
    assert flat.severity == "error" and "a steady series has slope 0" in flat.message
    (steep,) = by_rule["Steep"]
    assert steep.severity == "warning" and "more than the metric's whole range" in steep.message
    (locality,) = by_rule["Locality"]
    assert "can never fire" in locality.message
    (ceiling,) = by_rule["Ceiling"]
    assert ceiling.severity == "error" and "predicted 1d ahead below 6.5 bits always fires" in ceiling.message
    # longer history intervals make a look-back too short; without a history every trend rule is flagged
    assert any(
        "can never be judged" in f.message
        for f in lint(RuleSet((rules[0],), {}), [router], history_interval_seconds=2 * HOUR, with_history=True)
    )
    (missing,) = lint(RuleSet((rules[0],), {}), [router])
    assert "an alert engine without one (no trend_source) never judges it" in missing.message
