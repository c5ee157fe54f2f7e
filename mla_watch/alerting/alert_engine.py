"""The alert rule engine: typed routing statistics in (:class:`~mla_watch.windows.RouterStats`, one per
router x business line), alert transitions and actions out.

One *alert instance* exists per rule x (router name, layer, kind, business line) of a record
the rule's selector matches. Its labels are ``alertname, severity, router, layer, kind,
business_line`` plus the rule's own labels (``business_line`` is ``"all"`` for a record summed
over every line, whose ``business_line`` is ``None``). Each instance runs the state machine of
:mod:`mla_watch.alerting.transitions`, judged once per :meth:`AlertEngine.evaluate` with the value
of the rule's metric: ``inactive -> pending -> firing -> resolved``, with ``for``, hysteresis and
``keep_firing_for``. The transition to firing emits one ``notify`` and/or one ``retune``
:class:`Action`; resolution emits one resolved ``notify``. The engine only emits actions; it
never imports a notifier or a re-tuner.

A *trend rule* (``rule.trend``) judges, instead of the record's latest value, the slope or the
predicted value of the line through that router x line x metric's recent history, read from the
engine's ``trend_source`` when the record is evaluated (:mod:`mla_watch.alerting.trend`). A record
whose history is too short is not judged, like a window under ``min_tokens``; without a
``trend_source`` trend rules are never judged (a warning says so). ``min_tokens`` is still judged
on the record's own window, and the state machine is the same.

With a ``state_path``, every instance that is not inactive is persisted after each evaluation
that changed a state or a timer, and loaded again at start (:mod:`mla_watch.alerting.state_file`):
after a restart a firing alert stays firing without paging again, a pending one keeps its
``active_since``, and a resolution is notified normally. A save the disk refused is made again at
every evaluation until one goes through.

Here: the evaluation loop, the instances it keeps and their pruning, hot reloads of the rules,
and the restore of the state file against the current rules. Elsewhere: the rules compiled for
the loop (:mod:`~mla_watch.alerting.compiled`), one instance's state and public view
(:mod:`~mla_watch.alerting.instances`), its alerts and annotations
(:mod:`~mla_watch.alerting.rendering`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mla_watch.alerting.causes import CauseJudge
from mla_watch.alerting.compiled import CompiledRule, compile_rules
from mla_watch.alerting.instances import Action, AlertInstance, InstanceState, RecordKey
from mla_watch.alerting.rendering import AlertRenderer, Render
from mla_watch.alerting.state_file import STATE_FORMAT, read_state, save_state
from mla_watch.alerting.transitions import RESOLVED_RETENTION_SECONDS, recause, step
from mla_watch.alerting.trend import TrendSource, crossing_in, enough_data, fit, format_crossing
from mla_watch.alerting.vocabulary import RuleSet, breached, judged_window
from mla_watch.common.state_writes import StateWrites
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER
from mla_watch.routing.stats import RoutingStats
from mla_watch.routing.windows import ALL_LINES, RouterStats

__all__ = ["RESOLVED_RETENTION_SECONDS", "STATE_FORMAT", "Action", "AlertEngine", "AlertInstance"]

log = logging.getLogger("mla_watch.alerting.engine")  # the logger keeps its name

_MAX_SELECTOR_CACHE = 100_000  # (router, layer, kind, line) keys; cleared when exceeded


class AlertEngine:
    """Evaluates a :class:`RuleSet` over routing statistics records; thread-safe."""

    def __init__(
        self,
        rules: RuleSet,
        *,
        state_path: Path | None = None,
        clock: Callable[[], float] = time.time,
        render: Render | None = None,
        status_url: str = "",
        trend_source: TrendSource | None = None,
        causes: CauseJudge | None = None,
        writes: StateWrites | None = None,
    ) -> None:
        self._clock = clock
        self.evaluations = 0  # evaluate() calls done: one more is a round of every rule on newer windows
        self._trend_source = trend_source
        self.causes = causes  # tells the model from the traffic (mla_watch.alerting.causes); None: undetermined
        self._alerting = AlertRenderer(lambda: self._rules, render=render, status_url=status_url)
        self._state_path = Path(state_path) if state_path is not None else None
        self._writes = writes
        self._unsaved = False  # the last save failed (a full disk): save at every evaluation until one goes through
        self._lock = threading.RLock()
        self._rules: dict[str, CompiledRule] = {}
        # record key -> {rule id -> instance}: one dict lookup per record, no allocation per check
        self._instances: dict[RecordKey, dict[str, InstanceState]] = {}
        # (router, layer, kind, line, num_slots, hash_routed): the geometry decides `slots` selectors
        self._selector_cache: dict[tuple[Any, ...], tuple[CompiledRule, ...]] = {}
        self._queued: list[Action] = []  # resolutions found outside evaluate() (restart with changed rules)
        self._next_prune = math.inf
        self._compile(rules)
        if self._state_path is not None:
            self._load()

    # ------------------------------------------------------------------ public API
    def evaluate(self, records: Iterable[RouterStats]) -> list[Action]:
        """Judge every router's statistics against every matching rule; return the actions of the transitions."""
        with self._lock:
            now = self._clock()
            actions, self._queued = self._queued, []
            changed = bool(actions)
            cache = self._selector_cache
            instances = self._instances
            series: dict[tuple[Any, ...], tuple[list[float], list[float]]] = {}  # history read once per evaluation
            for record in records:
                router, stats = record.router, record.stats
                key = (router.name, router.layer, router.kind, record.business_line)
                geometry = (stats.num_slots, router.hash_routed)
                matched = cache.get((*key, *geometry))
                if matched is None:
                    matched = self._match(key, geometry)
                if not matched:
                    continue
                by_rule = instances.get(key)
                for rule in matched:
                    # Small windows read low (the plug-in entropy estimator is biased downwards by
                    # ~(N-1)/(2 n ln 2) bits, and MaxVio / dead slots are noisy over few tokens), so a
                    # window under the minimum is not judged at all: no breach, but no recovery
                    # either - the instance keeps its state and its timers.
                    if not judged_window(stats.tokens, rule.min_tokens, stats.min_tokens):
                        continue
                    trend = None
                    if rule.trend is None:
                        value = getattr(stats, rule.metric)
                    else:
                        judged = self._trend_value(rule, key, stats, now, series)
                        if judged is None:  # no history, or too little of it: not judged
                            continue
                        value, trend = judged
                    if value is None or value != value:  # no baseline / not an indexer / NaN: not judged
                        continue
                    levels = rule.levels or rule.series_levels(record)
                    if levels is None:  # relative to a healthy baseline this series has not learned yet
                        continue
                    inst = by_rule.get(rule.id) if by_rule is not None else None
                    below, above = levels[0], levels[1]
                    breach = breached(value, below, above)
                    if inst is None:
                        if not breach:
                            continue
                        inst = InstanceState(rule.id, key, rule.labels(key))
                        inst.num_slots, inst.hash_routed = geometry
                        if by_rule is None:
                            by_rule = instances[key] = {}
                        by_rule[rule.id] = inst
                    inst.record, inst.trend, inst.levels = record, trend, levels
                    if breach and inst.healthy_since is None and inst.state == "firing":
                        # the common case of a long incident, inlined: still firing, nothing changes but its cause
                        inst.value = value
                        inst.last_evaluated = now
                        if self.causes is not None and recause(inst, rule, now, actions, self._alerting, self.causes):
                            inst.json = None
                            changed = True
                        continue
                    if step(inst, rule, value, breach, now, actions, self._alerting, self._schedule_prune, self.causes):
                        inst.json = None
                        changed = True
                    if inst.state == "inactive":
                        assert by_rule is not None  # it holds inst
                        del by_rule[rule.id]
                        if not by_rule:
                            del instances[key]
                            by_rule = None
            if now >= self._next_prune and self._prune(now):
                changed = True
            if changed or self._unsaved:
                self._save()
            self.evaluations += 1
            return actions

    def alerts(self) -> list[AlertInstance]:
        """Pending, firing and recently resolved instances (firing first, then pending, then resolved)."""
        order = {"firing": 0, "pending": 1, "resolved": 2}
        with self._lock:
            now = self._clock()
            if now >= self._next_prune and self._prune(now):
                self._save()
            out = []
            for by_rule in self._instances.values():
                for inst in by_rule.values():
                    rule = self._rules.get(inst.rule_id)
                    annotations = (
                        self._alerting.annotations(rule, inst, inst.record)
                        if rule is not None and inst.record is not None
                        else dict(inst.annotations)
                    )
                    out.append(
                        AlertInstance(
                            rule=rule.rule.name if rule is not None else inst.labels.get("alertname", inst.rule_id),
                            labels=dict(inst.public_labels),
                            state=inst.state,
                            value=inst.value,
                            cause=None if inst.cause is None else inst.cause.to_json(),
                            active_since=inst.active_since,
                            firing_since=inst.firing_since,
                            resolved_at=inst.resolved_at,
                            last_evaluated=inst.last_evaluated,
                            annotations=annotations,
                            metric=rule.metric if rule is not None else None,
                        )
                    )
        out.sort(
            key=lambda a: (
                order.get(a.state, 3),
                a.rule,
                a.labels.get(ROUTER, ""),
                a.labels.get(LAYER, ""),
                a.labels.get(BUSINESS_LINE, ""),
            )
        )
        return out

    def active_series(self) -> set[tuple[str, str]]:
        """(router, business line) of every instance pending or firing: series not to learn as healthy.

        Left out: the instances of rules judged against the series' healthy baseline (its drift, or a level relative
        to it). A series is learned only while it has no baseline - the one such an alert was judged against was
        found not to be the line's traffic and dropped - so they stand unjudged and say nothing of its window; the
        baseline learned again judges them."""
        with self._lock:
            return {
                (inst.labels.get(ROUTER, ""), inst.labels.get(BUSINESS_LINE, ""))
                for by_rule in self._instances.values()
                for inst in by_rule.values()
                if inst.state in ("pending", "firing")
                and not ((rule := self._rules.get(inst.rule_id)) is not None and rule.of_the_baseline)
            }

    def firing_counts(self) -> dict[tuple[str, str], int]:
        """(alertname, severity) -> number of firing instances; every current rule is present, 0 if quiet."""
        with self._lock:
            counts = {
                (c.rule.name, str(c.rule.labels.get("severity", c.rule.severity))): 0 for c in self._rules.values()
            }
            for by_rule in self._instances.values():
                for inst in by_rule.values():
                    if inst.state == "firing":
                        key = (inst.public_labels.get("alertname", ""), inst.public_labels.get("severity", ""))
                        counts[key] = counts.get(key, 0) + 1
            return counts

    def firing_causes(self) -> dict[tuple[str, str], int]:
        """(alertname, cause) -> number of firing instances."""
        counts: dict[tuple[str, str], int] = {}
        with self._lock:
            for by_rule in self._instances.values():
                for inst in by_rule.values():
                    if inst.state == "firing":
                        key = (inst.labels.get("alertname", ""), inst.cause.name if inst.cause else "undetermined")
                        counts[key] = counts.get(key, 0) + 1
        return counts

    def replace_rules(self, rules: RuleSet) -> list[Action]:
        """Hot reload. Instances whose rule still exists (same name, same labels, selector still
        matching) keep their state and timers; the others are dropped, and those that were firing
        resolve: their resolved notify actions are returned (callers may ignore the return value;
        nothing else carries them).
        """
        with self._lock:
            now = self._clock()
            old = self._rules
            self._compile(rules)
            actions: list[Action] = []
            for key, by_rule in list(self._instances.items()):
                for rule_id, inst in list(by_rule.items()):
                    new = self._rules.get(rule_id)
                    if (
                        new is not None
                        and new.matches(key, inst.num_slots, inst.hash_routed)
                        and new.labels(key) == inst.labels
                    ):
                        continue
                    del by_rule[rule_id]
                    why = "was removed" if new is None else "changed its labels or selector"
                    log.info(
                        "alert %s %s: rule %r %s; the instance is dropped",
                        inst.labels.get("alertname"),
                        inst.state,
                        rule_id,
                        why,
                    )
                    previous = old.get(rule_id) or new
                    if inst.state == "firing" and inst.notified and previous is not None:
                        actions.append(self._alerting.resolved_action(inst, previous, now))
                if not by_rule:
                    del self._instances[key]
            self._save()
            return actions

    # ------------------------------------------------------------------ trend rules
    def _trend_value(
        self,
        rule: CompiledRule,
        key: RecordKey,
        stats: RoutingStats,
        now: float,
        series: dict[tuple[Any, ...], tuple[list[float], list[float]]],
    ) -> tuple[float, dict[str, object]] | None:
        """A trend rule's value (slope per unit, or the predicted value) and the trend's template fields
        (:data:`~mla_watch.alerting.rendering.TREND_FIELDS`); ``None`` when the history cannot judge it (see
        :mod:`~mla_watch.alerting.trend`)."""
        trend, source = rule.trend, self._trend_source
        if trend is None or source is None:
            return None
        name, _, _, line = key
        line = ALL_LINES if line is None else str(line)
        wanted = (name, line, rule.metric, trend.over_seconds)
        points = series.get(wanted)
        if points is None:
            points = series[wanted] = source.points(str(name), line, rule.metric, now - trend.over_seconds, now)
        times, values = points
        if not enough_data(times, trend.over_seconds):
            return None
        line_fit = fit(times, values, now)
        predicted = line_fit.value_at(now + trend.ahead_seconds)
        if trend.kind == "slope":
            value = line_fit.slope * trend.per_seconds
            crossing = None
        else:
            value = predicted
            below = rule.below is not None and (rule.above is None or predicted < rule.below)
            threshold = rule.below if below else rule.above
            crossing = crossing_in(line_fit, float(threshold), now, below=below)  # type: ignore[arg-type]
        # The template fields travel with the instance, so a resolution renders them too.
        fields = {
            "current": getattr(stats, rule.metric),
            "slope_per_hour": line_fit.slope * 3600.0,
            "slope_per_day": line_fit.slope * 86400.0,
            "predicted": predicted if trend.kind == "predict" else None,
            "crossing_in": format_crossing(crossing) if trend.kind == "predict" else None,
        }
        return value, fields

    # ------------------------------------------------------------------ rules and cache
    def _compile(self, rules: RuleSet) -> None:
        self._rules = compile_rules(rules, with_trend_source=self._trend_source is not None)
        self._selector_cache = {}

    def _match(self, key: RecordKey, geometry: tuple[Any, bool]) -> tuple[CompiledRule, ...]:
        if len(self._selector_cache) >= _MAX_SELECTOR_CACHE:
            self._selector_cache.clear()
        slots, hashed = geometry
        matched = tuple(
            rule for rule in self._rules.values() if rule.matches(key, None if slots is None else int(slots), hashed)
        )
        cache_key = (*key, *geometry)
        self._selector_cache[cache_key] = matched
        return matched

    def _prune(self, now: float) -> bool:
        """Forget resolved instances older than the retention; True when any went."""
        horizon = now - RESOLVED_RETENTION_SECONDS
        removed = False
        next_prune = math.inf
        for key, by_rule in list(self._instances.items()):
            for rule_id, inst in list(by_rule.items()):
                if inst.state != "resolved":
                    continue
                resolved_at = inst.resolved_at if inst.resolved_at is not None else now
                if resolved_at <= horizon:
                    del by_rule[rule_id]
                    removed = True
                else:
                    next_prune = min(next_prune, resolved_at + RESOLVED_RETENTION_SECONDS)
            if not by_rule:
                del self._instances[key]
        self._next_prune = next_prune
        return removed

    def _schedule_prune(self, at: float) -> None:
        """Prune no later than ``at`` (a resolved instance may be forgotten then)."""
        self._next_prune = min(self._next_prune, at)

    # ------------------------------------------------------------------ persistence
    def _save(self) -> None:
        path = self._state_path
        if path is None:
            return
        self._unsaved = not save_state(path, self._instances.values(), self._clock, self._writes)

    def _load(self) -> None:
        path = self._state_path
        assert path is not None
        loaded = read_state(path)
        if loaded is None:  # no state file, or a corrupt one (set aside): no alerts
            return
        now = self._clock()
        kept = 0
        for inst in loaded:
            rule = self._rules.get(inst.rule_id)
            if rule is None:
                log.warning(
                    "alert state %s: dropping the %s instance %s of rule %r, which no longer exists",
                    path,
                    inst.state,
                    inst.labels,
                    inst.rule_id,
                )
                if inst.state == "firing" and inst.notified:
                    log.warning(
                        "alert state %s: %s was firing and notified; its rule is gone, so no "
                        "resolution can be sent for it",
                        path,
                        inst.labels,
                    )
                continue
            if not rule.matches(inst.key, inst.num_slots, inst.hash_routed) or rule.labels(inst.key) != inst.labels:
                log.warning(
                    "alert state %s: rule %r changed its labels or selector; the %s instance %s is dropped",
                    path,
                    inst.rule_id,
                    inst.state,
                    inst.labels,
                )
                if inst.state == "firing" and inst.notified:  # close the page sent under the old labels
                    self._queued.append(self._alerting.resolved_action(inst, rule, now))
                continue
            if inst.state == "resolved":
                self._next_prune = min(self._next_prune, (inst.resolved_at or now) + RESOLVED_RETENTION_SECONDS)
            self._instances.setdefault(inst.key, {})[inst.rule_id] = inst
            kept += 1
        if kept != len(loaded):
            self._save()
        log.info("alert state %s: restored %d instance(s)", path, kept)
