"""The alert rule engine: state machine, hysteresis, actions, labels, hot reload, persistence."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from harness.helpers import FakeClock, engine_record
from mla_watch.alerting.alert_engine import Action, AlertEngine
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.vocabulary import Rule, RuleSet, Selector

GATE = "model.layers.3.mlp.gate"
INDEXER = "model.layers.3.self_attn.indexer"

rec = partial(engine_record, name=GATE, layer=3)


def low_rule(**kw: Any) -> Rule:
    args: dict[str, Any] = {
        "name": "RoutingEntropyLow",
        "metric": "entropy_bits",
        "selector": Selector(kind="expert"),
        "below": 5.0,
        "resolve_above": 5.5,
        "for_seconds": 60.0,
        "keep_firing_for_seconds": 120.0,
        "severity": "critical",
        "actions": ("notify", "retune"),
        "labels": {"team": "ml-platform"},
        "annotations": {
            "summary": "{router} layer {layer} ({business_line}): {value:.2f} bits "
            "< {threshold} (resolves at {resolve_threshold})",
            "runbook_url": "https://runbooks/entropy",
            "dashboard": "{status_url}",
        },
    }
    args.update(kw)
    return Rule(**args)


def high_rule(**kw: Any) -> Rule:
    args: dict[str, Any] = {
        "name": "RoutingEntropyHigh",
        "metric": "entropy_bits",
        "selector": Selector(),
        "above": 6.5,
        "resolve_below": 6.0,
        "for_seconds": 0.0,
        "keep_firing_for_seconds": 0.0,
        "severity": "warning",
    }
    args.update(kw)
    return Rule(**args)


def ruleset(*rules: Rule) -> RuleSet:
    return RuleSet(rules=tuple(rules), receivers={})


def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.alert.status) for a in actions]


def states(engine: AlertEngine) -> list[str]:
    return [a.state for a in engine.alerts()]


# ---------------------------------------------------------------------- lifecycle


def test_full_lifecycle_with_for_and_keep_firing_for() -> None:
    clock = FakeClock()
    rule = low_rule()
    engine = AlertEngine(ruleset(rule), clock=clock, status_url="http://sidecar:8000/v1/routing")
    t0 = clock.now
    assert engine.evaluate([rec(4.0)]) == []  # breach -> pending, nothing sent
    [inst] = engine.alerts()
    assert (inst.state, inst.active_since, inst.firing_since) == ("pending", t0, None)

    clock.advance(30)
    assert engine.evaluate([rec(4.1)]) == []  # still inside `for`
    assert states(engine) == ["pending"]

    clock.advance(30)  # 60 s breached continuously -> firing
    actions = engine.evaluate([rec(4.2)])
    assert kinds(actions) == [("notify", "firing"), ("retune", "firing")]
    notify, retune = actions
    assert notify.alert is retune.alert and notify.rule is rule and retune.rule is rule
    assert notify.record.stats.entropy_bits == 4.2
    alert = notify.alert
    assert alert.starts_at == clock.now and alert.ends_at is None and alert.value == pytest.approx(4.2)
    assert dict(alert.labels) == {
        "alertname": "RoutingEntropyLow",
        "severity": "critical",
        "router": GATE,
        "layer": "3",
        "kind": "expert",
        "business_line": "code",
        "team": "ml-platform",
    }
    assert alert.annotations["summary"] == f"{GATE} layer 3 (code): 4.20 bits < 5.0 (resolves at 5.5)"
    assert alert.annotations["runbook_url"] == "https://runbooks/entropy"
    url = (
        f"http://sidecar:8000/v1/routing#router={GATE}&layer=3&business_line=code&metric=entropy_bits"
        "&alertname=RoutingEntropyLow"
    )  # the status page opens that row with the metric that fired
    assert alert.annotations["dashboard"] == url and alert.generator_url == url
    firing_since = clock.now

    clock.advance(15)
    assert engine.evaluate([rec(3.0)]) == []  # no repeats while firing
    assert [(a.state, a.value, a.last_evaluated) for a in engine.alerts()] == [("firing", 3.0, clock.now)]
    clock.advance(15)
    assert engine.evaluate([rec(5.8)]) == []  # healthy: keep_firing_for timer starts
    clock.advance(60)
    assert engine.evaluate([rec(5.9)]) == []  # healthy 60 s < 120 s
    clock.advance(30)
    assert engine.evaluate([rec(4.0)]) == []  # a new breach cancels the timer
    clock.advance(30)
    assert engine.evaluate([rec(5.9)]) == []  # timer restarts here
    clock.advance(119)
    assert engine.evaluate([rec(5.9)]) == []
    assert states(engine) == ["firing"]
    clock.advance(1)  # healthy continuously for 120 s -> resolved
    [resolved] = engine.evaluate([rec(5.95)])
    assert (resolved.kind, resolved.alert.status) == ("notify", "resolved")
    assert resolved.alert.starts_at == firing_since and resolved.alert.ends_at == clock.now
    assert resolved.alert.labels == alert.labels and resolved.alert.fingerprint == alert.fingerprint
    assert resolved.alert.value == pytest.approx(5.95)
    [inst] = engine.alerts()
    assert (inst.state, inst.resolved_at, inst.firing_since) == ("resolved", clock.now, firing_since)

    clock.advance(60)
    assert engine.evaluate([rec(5.9)]) == []  # resolved stays resolved, no more actions
    clock.advance(3600)
    engine.evaluate([rec(5.9)])
    assert engine.alerts() == []  # resolved instances are shown for an hour only


def test_zero_for_and_keep_firing_for_act_in_the_same_evaluation() -> None:
    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock())
    assert kinds(engine.evaluate([rec(6.8)])) == [("notify", "firing")]  # actions default to ("notify",)
    assert kinds(engine.evaluate([rec(5.9)])) == [("notify", "resolved")]
    assert kinds(engine.evaluate([rec(6.8)])) == [("notify", "firing")]  # a new incident pages again
    assert engine.evaluate([]) == [] and engine.evaluations == 4  # every round counted, a round of nothing too


def test_hysteresis_band_holds_firing_and_does_not_resolve() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=0)), clock=clock)
    assert len(engine.evaluate([rec(4.9)])) == 2
    for value in (5.0, 5.2, 5.49):  # between below=5.0 and resolve_above=5.5
        clock.advance(60)
        assert engine.evaluate([rec(value)]) == []
        assert states(engine) == ["firing"]
    assert engine.active_series() == {(GATE, "code")}  # never learned as healthy while so
    clock.advance(60)
    assert kinds(engine.evaluate([rec(5.5)])) == [("notify", "resolved")]  # resolve threshold is inclusive
    assert engine.active_series() == set()


def test_band_interrupts_the_keep_firing_for_timer() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=100)), clock=clock)
    engine.evaluate([rec(4.0)])
    clock.advance(10)
    engine.evaluate([rec(5.6)])  # healthy: timer starts
    clock.advance(60)
    engine.evaluate([rec(5.2)])  # band: health no longer continuous
    clock.advance(60)
    assert engine.evaluate([rec(5.6)]) == []  # 120 s since the first healthy reading, but timer restarted
    clock.advance(100)
    assert kinds(engine.evaluate([rec(5.6)])) == [("notify", "resolved")]


def test_pending_that_recovers_before_for_emits_nothing() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule()), clock=clock)
    assert engine.evaluate([rec(4.0)]) == []
    clock.advance(59)
    assert engine.evaluate([rec(5.2)]) == []  # not breached (band) -> back to inactive, silently
    assert engine.alerts() == []
    clock.advance(1)
    assert engine.evaluate([rec(4.0)]) == []  # a new pending period starts now, not at t0
    [inst] = engine.alerts()
    assert inst.active_since == clock.now
    clock.advance(59)
    assert engine.evaluate([rec(4.0)]) == []
    clock.advance(1)
    assert len(engine.evaluate([rec(4.0)])) == 2


def test_above_rules_are_symmetrical() -> None:
    clock = FakeClock()
    rule = high_rule(
        metric="locality",
        selector=Selector(kind="indexer"),
        above=0.9,
        resolve_below=0.7,
        for_seconds=30,
        keep_firing_for_seconds=30,
        annotations={"summary": "{value:.2f} > {threshold}"},
    )
    engine = AlertEngine(ruleset(rule), clock=clock)

    def idx(value: float) -> dict[str, Any]:
        return rec(value, metric="locality", name=INDEXER, kind="indexer")

    assert engine.evaluate([idx(0.95)]) == []
    clock.advance(30)
    [fired] = engine.evaluate([idx(0.97)])
    assert fired.alert.annotations["summary"] == "0.97 > 0.9"
    assert fired.alert.labels["kind"] == "indexer" and fired.alert.labels["router"] == INDEXER
    clock.advance(30)
    assert engine.evaluate([idx(0.8)]) == []  # band (0.7, 0.9]
    clock.advance(30)
    assert engine.evaluate([idx(0.7)]) == []  # healthy: timer starts
    clock.advance(30)
    assert kinds(engine.evaluate([idx(0.6)])) == [("notify", "resolved")]
    # an expert record never matches the indexer-only selector
    assert engine.evaluate([rec(0.99, metric="locality")]) == []


def test_rule_with_both_thresholds_needs_both_sides_healthy() -> None:
    rule = Rule(
        name="Band",
        metric="entropy_bits",
        selector=Selector(),
        below=5.0,
        above=6.5,
        resolve_above=5.2,
        resolve_below=6.3,
    )
    engine = AlertEngine(ruleset(rule), clock=FakeClock())
    assert kinds(engine.evaluate([rec(6.6)])) == [("notify", "firing")]
    assert engine.evaluate([rec(6.4)]) == []  # upper band
    assert kinds(engine.evaluate([rec(6.0)])) == [("notify", "resolved")]
    assert kinds(engine.evaluate([rec(4.0)])) == [("notify", "firing")]
    assert engine.evaluate([rec(5.1)]) == []  # lower band
    assert kinds(engine.evaluate([rec(5.2)])) == [("notify", "resolved")]


# ---------------------------------------------------------------------- what is not judged


def test_too_small_windows_are_not_judged_either_way() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=0)), clock=clock)
    assert engine.evaluate([rec(3.0, tokens=255, min_tokens=256)]) == []  # would breach, but too small
    assert engine.alerts() == []
    assert len(engine.evaluate([rec(4.0, tokens=256, min_tokens=256)])) == 2  # exactly the minimum: judged
    last = engine.alerts()[0].last_evaluated
    clock.advance(60)
    assert engine.evaluate([rec(5.9, tokens=16, min_tokens=256)]) == []  # healthy, but too small: stays firing
    [inst] = engine.alerts()
    assert inst.state == "firing" and inst.value == 4.0 and inst.last_evaluated == last
    assert kinds(engine.evaluate([rec(5.9, tokens=4096)])) == [("notify", "resolved")]


def test_rule_min_tokens_overrides_the_record_minimum() -> None:
    engine = AlertEngine(ruleset(low_rule(for_seconds=0, min_tokens=1000)), clock=FakeClock())
    assert engine.evaluate([rec(4.0, tokens=999, min_tokens=10)]) == []
    assert len(engine.evaluate([rec(4.0, tokens=1000, min_tokens=5000)])) == 2


def test_none_metric_is_not_judged(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rule = high_rule(name="RoutingDrift", metric="js_divergence", above=0.1, resolve_below=0.05)
    engine = AlertEngine(ruleset(rule), clock=clock)
    with caplog.at_level(logging.WARNING):
        assert engine.evaluate([rec(None, metric="js_divergence")]) == []  # no baseline
    assert caplog.text == ""  # a None metric is normal, not a malformed record
    assert engine.alerts() == []
    assert len(engine.evaluate([rec(0.3, metric="js_divergence")])) == 1
    assert engine.evaluate([rec(None, metric="js_divergence")]) == []  # baseline dropped: not healthy either
    assert states(engine) == ["firing"]
    assert engine.active_series() == set()  # ... nor kept from learning a baseline again: it judges the drift
    assert engine.evaluate([rec(float("nan"), metric="js_divergence")]) == []
    assert states(engine) == ["firing"]


def test_a_rule_relative_to_the_baseline_judges_each_series_against_its_own() -> None:
    from mla_watch.alerting.vocabulary import BaselineScale

    rule = high_rule(
        name="ExpertHotspot",
        metric="max_violation",
        above=1.0,
        resolve_below=0.7,
        baseline={"above": BaselineScale(times=2.0), "resolve_below": BaselineScale(times=1.5)},
        annotations={"summary": "MaxVio {value:.2f}, healthy {healthy:.2f}, threshold {threshold:.2f}"},
    )
    engine = AlertEngine(ruleset(rule), clock=FakeClock())
    healthy = {"max_violation": 1.6, "dead_slots": 0.0, "tokens": 2048}
    # no baseline learned for the line yet: not judged, however high
    assert engine.evaluate([rec(9.0, metric="max_violation")]) == []
    # a line whose healthy MaxVio is 1.6: 3.0 is under twice that, and does not page
    assert engine.evaluate([rec(3.0, metric="max_violation", baseline=healthy)]) == []
    # another line, healthy at 0.2: the floor of 1.0 holds, so 0.39 (twice its healthy value) does not page ...
    calm = {**healthy, "max_violation": 0.2}
    assert engine.evaluate([rec(0.39, metric="max_violation", line="sql", baseline=calm)]) == []
    # ... while 1.2 does
    (fired,) = engine.evaluate([rec(1.2, metric="max_violation", line="sql", baseline=calm)])
    assert fired.alert.annotations["summary"] == "MaxVio 1.20, healthy 0.20, threshold 1.00"
    (fired,) = engine.evaluate([rec(3.3, metric="max_violation", baseline=healthy)])
    assert fired.alert.labels["business_line"] == "code"
    assert fired.alert.annotations["summary"] == "MaxVio 3.30, healthy 1.60, threshold 3.20"
    # Judged against the series' baseline: a series is learned only once it has none (found not to be the line's
    # traffic and dropped), and then this alert stands unjudged, saying nothing of the window: it keeps none out.
    assert engine.active_series() == set()
    # 2.5 is in the band (resolves at 1.5 x 1.6 = 2.4): still firing; 2.3 resolves
    assert engine.evaluate([rec(2.5, metric="max_violation", baseline=healthy)]) == []
    assert kinds(engine.evaluate([rec(2.3, metric="max_violation", baseline=healthy)])) == [("notify", "resolved")]


def test_missing_or_nan_values_do_not_end_a_pending_period() -> None:
    clock = FakeClock()
    rule = high_rule(name="RoutingDrift", metric="js_divergence", above=0.1, resolve_below=0.05, for_seconds=60)
    engine = AlertEngine(ruleset(rule), clock=clock)
    engine.evaluate([rec(0.3, metric="js_divergence")])
    t0 = clock.now
    for value in (None, float("nan")):
        clock.advance(30)
        assert engine.evaluate([rec(value, metric="js_divergence")]) == []
        [inst] = engine.alerts()
        assert (inst.state, inst.active_since, inst.value) == ("pending", t0, 0.3)
    assert len(engine.evaluate([rec(0.3, metric="js_divergence")])) == 1


def test_routers_that_stop_reporting_keep_their_state() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(high_rule()), clock=clock)
    engine.evaluate([rec(6.9)])
    clock.advance(3600 * 5)
    assert engine.evaluate([]) == []
    assert engine.evaluate([rec(5.0, line="sql")]) == []  # another line's data says nothing about "code"
    assert states(engine) == ["firing"]


# ---------------------------------------------------------------------- instances, labels, annotations


def test_separate_instances_per_business_line_router_and_layer() -> None:
    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock())
    records = [
        rec(6.9, line="code"),
        rec(6.9, line="sql"),
        rec(6.9, line=None),
        rec(6.0, line="chat"),
        rec(6.9, name=INDEXER, kind="indexer"),
        rec(6.9, name="model.layers.4.mlp.gate", layer=4),
    ]
    actions = engine.evaluate(records)
    assert len(actions) == 4  # every line, each on its own; the sum over lines ("all") is not a line
    keys = {(a.alert.labels["router"], a.alert.labels["layer"], a.alert.labels["business_line"]) for a in actions}
    assert keys == {
        (GATE, "3", "code"),
        (GATE, "3", "sql"),
        (INDEXER, "3", "code"),
        ("model.layers.4.mlp.gate", "4", "code"),
    }
    assert len({a.alert.fingerprint for a in actions}) == 4
    # resolving one line leaves the others firing
    [resolved] = engine.evaluate([rec(6.0, line="sql")])
    assert resolved.alert.labels["business_line"] == "sql" and resolved.alert.status == "resolved"
    assert sorted(states(engine)) == ["firing"] * 3 + ["resolved"]
    whole = AlertEngine(ruleset(high_rule(selector=Selector(business_line="all"))), clock=FakeClock())
    [aggregate] = whole.evaluate(records)
    assert aggregate.alert.labels["business_line"] == "all"


def test_selector_limits_routers_layers_and_lines() -> None:
    rule = high_rule(selector=Selector(kind="expert", layers=(2, 3), router="*.mlp.gate", business_line="code"))
    engine = AlertEngine(ruleset(rule), clock=FakeClock())
    records = [
        rec(6.9),
        rec(6.9, line="sql"),
        rec(6.9, layer=4, name="model.layers.4.mlp.gate"),
        rec(6.9, name="model.layers.3.mlp.router"),
        rec(6.9, kind="indexer"),
    ]
    actions = engine.evaluate(records)
    assert [a.alert.labels["router"] for a in actions] == [GATE]
    assert engine.evaluate(records) == []  # cached matching gives the same answer


def test_annotation_errors_render_as_na_not_raised() -> None:
    rule = high_rule(
        annotations={
            "summary": "{value:.2f} {nonexistent}",
            "floor": "{floor_bits:.1f}",
            "ok": "{alertname}/{severity}/{metric}/{tokens}/{min_tokens}/{ceiling_bits}",
        }
    )
    engine = AlertEngine(ruleset(rule), clock=FakeClock())
    [action] = engine.evaluate([rec(6.9, floor_bits=None)])
    annotations = action.alert.annotations
    assert annotations["summary"] == "6.90 n/a"  # the renderer the service uses: an alert is never lost to a template
    assert annotations["floor"] == "n/a"
    assert annotations["ok"] == "RoutingEntropyHigh/warning/entropy_bits/4096/256/6.0"


def test_custom_render_gets_every_template_field_and_its_errors_are_contained() -> None:
    seen: list[dict[str, object]] = []

    def render(rule: Rule, fields: Any) -> dict[str, str]:
        seen.append(dict(fields))
        if fields["business_line"] == "sql":
            raise RuntimeError("boom")
        return {"summary": f"{rule.name} {fields['value']}"}

    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock(), render=render)
    actions = engine.evaluate([rec(6.9), rec(7.0, line="sql")])
    assert actions[0].alert.annotations == {"summary": "RoutingEntropyHigh 6.9"}
    assert "boom" in actions[1].alert.annotations["summary"]
    from mla_watch.alerting.vocabulary import TEMPLATE_FIELDS

    assert set(seen[0]) == set(TEMPLATE_FIELDS)
    assert seen[0]["threshold"] == 6.5 and seen[0]["resolve_threshold"] == 6.0 and seen[0]["status_url"] == ""


def test_the_engine_renders_leniently_by_default() -> None:
    rule = high_rule(annotations={"a": "{value}", "b": "{value:d}", "c": "{tokens} {nonsense}"})
    out = render_annotations(rule, {"value": 1.5})
    assert out == {"a": "1.5", "b": "1.5", "c": "n/a n/a"}  # a spec that does not suit falls back to str()


def test_alert_instance_view_and_as_dict() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule()), clock=clock)
    engine.evaluate([rec(4.0)])
    [inst] = engine.alerts()
    data = inst.as_dict()
    json.dumps(data)
    assert data["rule"] == "RoutingEntropyLow" and data["state"] == "pending" and data["value"] == 4.0
    assert data["labels"]["router"] == GATE and data["active_since"] == clock.now
    assert data["annotations"]["summary"].startswith(GATE) and len(data["fingerprint"]) == 16


def test_firing_counts() -> None:
    rules = ruleset(
        low_rule(for_seconds=0, keep_firing_for_seconds=0), high_rule(), high_rule(name="Quiet", severity="info")
    )
    engine = AlertEngine(rules, clock=FakeClock())
    assert engine.firing_counts() == {
        ("RoutingEntropyLow", "critical"): 0,
        ("RoutingEntropyHigh", "warning"): 0,
        ("Quiet", "info"): 0,
    }
    engine.evaluate([rec(4.0, line="code"), rec(4.0, line="sql"), rec(6.9, name=INDEXER, kind="indexer")])
    assert engine.firing_counts() == {
        ("RoutingEntropyLow", "critical"): 2,
        ("RoutingEntropyHigh", "warning"): 1,
        ("Quiet", "info"): 1,
    }
    engine.evaluate([rec(5.9, line="sql")])
    assert engine.firing_counts()[("RoutingEntropyLow", "critical")] == 1


# ---------------------------------------------------------------------- hot reload


def test_replace_rules_keeps_state_of_surviving_rules_and_resolves_removed_ones() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=0), high_rule()), clock=clock)
    fired = engine.evaluate([rec(4.0), rec(6.9, name=INDEXER, kind="indexer")])
    assert len(fired) == 3
    clock.advance(10)
    # the low rule survives with a new threshold (same labels); the high rule is removed
    resolved = engine.replace_rules(
        ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=0, below=4.5, resolve_above=4.8))
    )
    assert kinds(resolved) == [("notify", "resolved")]
    assert resolved[0].alert.labels["alertname"] == "RoutingEntropyHigh" and resolved[0].alert.ends_at == clock.now
    [inst] = engine.alerts()
    assert (inst.rule, inst.state) == ("RoutingEntropyLow", "firing")
    assert engine.evaluate([rec(4.6)]) == []  # band under the new thresholds: still firing, no re-page
    assert kinds(engine.evaluate([rec(4.8)])) == [("notify", "resolved")]  # the new resolve threshold applies
    assert engine.firing_counts() == {("RoutingEntropyLow", "critical"): 0}


def test_replace_rules_with_changed_labels_closes_the_old_alert() -> None:
    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock())
    [fired] = engine.evaluate([rec(6.9)])
    [closed] = engine.replace_rules(ruleset(high_rule(severity="critical")))
    assert closed.alert.status == "resolved" and closed.alert.labels == fired.alert.labels
    [refired] = engine.evaluate([rec(6.9)])
    assert refired.alert.labels["severity"] == "critical"


def test_replace_rules_drops_pending_silently_and_keeps_pending_timers() -> None:
    clock = FakeClock()
    engine = AlertEngine(ruleset(low_rule(), high_rule(for_seconds=60)), clock=clock)
    t0 = clock.now
    engine.evaluate([rec(4.0), rec(6.9, name=INDEXER, kind="indexer")])
    clock.advance(30)
    assert engine.replace_rules(ruleset(low_rule())) == []
    [inst] = engine.alerts()
    assert inst.active_since == t0
    clock.advance(30)
    assert len(engine.evaluate([rec(4.0)])) == 2


# ---------------------------------------------------------------------- persistence


def test_restart_mid_firing_does_not_page_again_and_resolution_is_sent(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "state" / "alerts.json"
    rules = ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=0))
    engine = AlertEngine(rules, clock=clock, state_path=path)
    fired = engine.evaluate([rec(4.0)])
    assert len(fired) == 2 and path.exists()
    assert not list(path.parent.glob("*.tmp"))
    firing_since = clock.now

    clock.advance(300)
    restarted = AlertEngine(rules, clock=clock, state_path=path)
    [inst] = restarted.alerts()
    assert (inst.state, inst.firing_since) == ("firing", firing_since)
    assert restarted.firing_counts()[("RoutingEntropyLow", "critical")] == 1
    assert restarted.evaluate([rec(3.5)]) == []  # still breached: no new notify, no new retune
    clock.advance(60)
    [resolved] = restarted.evaluate([rec(5.9)])
    assert resolved.alert.status == "resolved" and resolved.alert.starts_at == firing_since
    assert resolved.alert.fingerprint == fired[0].alert.fingerprint


def test_restart_healthy_at_first_evaluation_resolves(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    rules = ruleset(high_rule())
    AlertEngine(rules, clock=clock, state_path=path).evaluate([rec(6.9)])
    restarted = AlertEngine(rules, clock=clock, state_path=path)
    assert kinds(restarted.evaluate([rec(5.0)])) == [("notify", "resolved")]
    again = AlertEngine(rules, clock=clock, state_path=path)  # the resolution was persisted too
    assert states(again) == ["resolved"]
    assert again.evaluate([rec(5.0)]) == []


def test_pending_survives_restart_with_its_active_since(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    rules = ruleset(low_rule())
    AlertEngine(rules, clock=clock, state_path=path).evaluate([rec(4.0)])
    t0 = clock.now
    clock.advance(40)
    restarted = AlertEngine(rules, clock=clock, state_path=path)
    [inst] = restarted.alerts()
    assert (inst.state, inst.active_since) == ("pending", t0)
    assert restarted.evaluate([rec(4.0)]) == []
    clock.advance(20)  # 60 s after the original breach
    assert len(restarted.evaluate([rec(4.0)])) == 2


def test_keep_firing_for_timer_survives_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    rules = ruleset(low_rule(for_seconds=0, keep_firing_for_seconds=100))
    engine = AlertEngine(rules, clock=clock, state_path=path)
    engine.evaluate([rec(4.0)])
    clock.advance(10)
    engine.evaluate([rec(5.9)])  # timer starts
    clock.advance(100)
    restarted = AlertEngine(rules, clock=clock, state_path=path)
    assert kinds(restarted.evaluate([rec(5.9)])) == [("notify", "resolved")]


def test_corrupt_state_file_starts_empty_and_is_kept_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "alerts.json"
    path.write_text('{"format": "mla_watch.alert_state/1", "instances": [')
    with caplog.at_level(logging.ERROR):
        engine = AlertEngine(ruleset(high_rule()), clock=FakeClock(), state_path=path)
    assert engine.alerts() == []
    assert (tmp_path / "alerts.json.corrupt").read_text().endswith('"instances": [')
    assert str(path) in caplog.text
    assert kinds(engine.evaluate([rec(6.9)])) == [("notify", "firing")]  # and works from there
    assert json.loads(path.read_text())["instances"][0]["state"] == "firing"


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00garbage",
        b"[]",
        b'{"format": "other"}',
        b'{"format": "mla_watch.alert_state/1", "instances": [{"rule": 3}]}',
    ],
)
def test_other_bad_state_files_are_set_aside(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "alerts.json"
    path.write_bytes(content)
    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock(), state_path=path)
    assert engine.alerts() == []
    assert (tmp_path / "alerts.json.corrupt").read_bytes() == content
    assert not path.exists()


def test_state_of_removed_rules_is_dropped_on_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    AlertEngine(ruleset(high_rule(), low_rule(for_seconds=0)), clock=clock, state_path=path).evaluate(
        [rec(6.9, name=INDEXER, kind="indexer"), rec(4.0)]
    )
    with caplog.at_level(logging.WARNING):
        restarted = AlertEngine(ruleset(low_rule(for_seconds=0)), clock=clock, state_path=path)
    assert [a.rule for a in restarted.alerts()] == ["RoutingEntropyLow"]
    assert "RoutingEntropyHigh" in caplog.text and "no longer exists" in caplog.text
    assert [i["rule"] for i in json.loads(path.read_text())["instances"]] == ["RoutingEntropyLow"]


def test_state_with_changed_labels_is_closed_on_first_evaluation(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    AlertEngine(ruleset(high_rule()), clock=clock, state_path=path).evaluate([rec(6.9)])
    restarted = AlertEngine(ruleset(high_rule(labels={"team": "sre"})), clock=clock, state_path=path)
    actions = restarted.evaluate([rec(6.9)])
    assert kinds(actions) == [("notify", "resolved"), ("notify", "firing")]
    assert "team" not in actions[0].alert.labels and actions[1].alert.labels["team"] == "sre"


def test_unwritable_state_path_does_not_stop_evaluation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    engine = AlertEngine(ruleset(high_rule()), clock=FakeClock(), state_path=blocker / "alerts.json")
    with caplog.at_level(logging.ERROR):
        assert kinds(engine.evaluate([rec(6.9)])) == [("notify", "firing")]
    assert (
        f"alert state file {blocker / 'alerts.json'}: cannot write it: a part of the path is not a directory"
        in caplog.text
    )


def test_state_is_written_only_when_something_changed(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "alerts.json"
    engine = AlertEngine(ruleset(high_rule()), clock=clock, state_path=path)
    engine.evaluate([rec(5.0)])
    assert not path.exists()  # nothing happened
    engine.evaluate([rec(6.9)])
    written = path.stat().st_mtime_ns
    path.write_text(path.read_text())  # marker: identical content, new mtime
    marker = path.stat().st_mtime_ns
    clock.advance(60)
    engine.evaluate([rec(7.0)])  # still firing, no transition
    assert path.stat().st_mtime_ns == marker
    engine.evaluate([rec(5.0)])
    assert json.loads(path.read_text())["instances"][0]["state"] == "resolved"
    assert written <= marker


# ---------------------------------------------------------------------- scale


def scale_rules() -> RuleSet:
    everything = Selector()
    return ruleset(
        low_rule(name="EntropyLow", selector=everything, for_seconds=0),
        high_rule(name="EntropyHigh", above=3.0, resolve_below=2.9),
        high_rule(name="MaxVio", metric="max_violation", above=0.5, resolve_below=0.3),
        high_rule(name="DeadExperts", metric="dead_slots", above=0, resolve_below=0),
        high_rule(name="Drift", metric="js_divergence", above=0.1, resolve_below=0.05),
        low_rule(
            name="NormLow",
            metric="normalized_entropy",
            selector=everything,
            below=0.8,
            resolve_above=0.85,
            for_seconds=0,
        ),
    )


def scale_records(sick: bool) -> list[dict[str, Any]]:
    out = []
    for layer in range(60):
        for router, kind in (
            (f"model.layers.{layer}.mlp.gate", "expert"),
            (f"model.layers.{layer}.self_attn.indexer", "indexer"),
        ):
            for line in ("customer_service", "code_assistant", "doc_summary", "default"):
                values = (
                    {
                        "entropy_bits": 4.0,
                        "max_violation": 1.0,
                        "dead_slots": 3,
                        "js_divergence": 0.3,
                        "normalized_entropy": 0.5,
                    }
                    if sick
                    else {
                        "entropy_bits": 2.95,
                        "max_violation": 0.1,
                        "dead_slots": 0,
                        "js_divergence": 0.01,
                        "normalized_entropy": 0.97,
                    }
                )
                out.append(rec(name=router, layer=layer, kind=kind, line=line, **values))
    return out


def test_scale_60_layers_2_routers_4_lines_6_rules() -> None:
    engine = AlertEngine(scale_rules(), clock=FakeClock())
    records = scale_records(sick=False)
    assert len(records) == 480
    # healthy (2.95 bits is below 5.0, so EntropyLow breaches everywhere)
    actions = engine.evaluate(records)
    assert len(actions) == 2 * 480  # notify + retune of EntropyLow on every router and line
    assert len(engine.alerts()) == 480
    actions = engine.evaluate(scale_records(sick=True))
    assert len(engine.alerts()) == 2880  # every rule breached on every (router, layer, line)
    assert engine.firing_counts() == {
        ("EntropyLow", "critical"): 480,
        ("EntropyHigh", "warning"): 480,
        ("MaxVio", "warning"): 480,
        ("DeadExperts", "warning"): 480,
        ("Drift", "warning"): 480,
        ("NormLow", "critical"): 480,
    }
    assert len(actions) == 480 * 6  # five new rules fire: 4 notify-only + NormLow notify + retune
    assert engine.evaluate(scale_records(sick=True)) == []


def test_slots_and_hash_routed_selectors_judge_the_records_geometry(tmp_path: Path) -> None:
    """The engine matched `slots: 64` against no geometry at all: RoutingEntropyLow never fired on 64 experts."""
    from mla_watch.alerting.vocabulary import SlotRange

    seed = low_rule(selector=Selector(kind="expert", slots=SlotRange(64, 64)), for_seconds=0.0)
    other = low_rule(
        name="RoutingCollapse", selector=Selector(kind="expert", slots=SlotRange(64, 64, exclude=True)), for_seconds=0.0
    )
    clock = FakeClock()
    engine = AlertEngine(ruleset(seed, other), clock=clock, state_path=tmp_path / "state.json")
    pages = engine.evaluate(
        [
            rec(4.0, num_slots=64),
            rec(4.0, num_slots=8, name="model.layers.1.mlp.gate"),
            rec(4.0, num_slots=64, name="model.layers.0.mlp.gate", hash_routed=True),
        ]
    )
    assert sorted((a.alert.labels["alertname"], a.alert.labels["router"]) for a in pages if a.kind == "notify") == [
        ("RoutingCollapse", "model.layers.1.mlp.gate"),
        ("RoutingEntropyLow", GATE),
    ]
    # the geometry is kept with the state: a restart keeps both alerts firing without paging again
    restarted = AlertEngine(ruleset(seed, other), clock=clock, state_path=tmp_path / "state.json")
    assert sorted(a.rule for a in restarted.alerts() if a.state == "firing") == ["RoutingCollapse", "RoutingEntropyLow"]
    assert restarted.evaluate([rec(4.0, num_slots=64), rec(4.0, num_slots=8, name="model.layers.1.mlp.gate")]) == []
