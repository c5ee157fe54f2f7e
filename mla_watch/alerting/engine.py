"""The alert rule engine: routing statistics records in, alert transitions and actions out.

One *alert instance* exists per rule x (router name, layer, kind, business line) of a record
the rule's selector matches. Its labels are ``alertname, severity, router, layer, kind,
business_line`` plus the rule's own labels (``business_line`` is ``"all"`` for a record summed
over every line, whose ``business_line`` is ``None``). Each instance runs this state machine,
judged once per :meth:`AlertEngine.evaluate` with the value of the rule's metric:

* *breach*: ``value < below`` or ``value > above``;
* *healthy*: a ``below`` rule's value is ``>= resolve_above`` (default ``below``) and an
  ``above`` rule's value is ``<= resolve_below`` (default ``above``); a value that is neither
  lies in the hysteresis band and causes no transition out of ``firing``;
* ``inactive -> pending`` on a breach; ``pending -> firing`` once breached continuously for
  ``for_seconds`` (at once for 0); ``pending -> inactive`` as soon as it is not breached
  (silently: nothing was ever sent);
* ``firing`` stays firing while breached or in the band; once healthy a ``keep_firing_for``
  timer starts, and the alert resolves when healthy continuously for that long (at once for
  0). A breach, or a value back in the band, during the timer cancels it;
* ``resolved`` instances are kept for display for an hour; a new breach starts a new incident.

The transition to firing emits one ``notify`` and/or one ``retune`` :class:`Action`
(as the rule's ``actions`` ask); resolution emits one resolved ``notify`` (only for an
instance whose firing was notified). Nothing repeats while firing: repeating is the
notifier's job. The engine only emits actions; it never imports a notifier or a re-tuner.

A *trend rule* (``rule.trend``) judges, instead of the record's latest value, the slope or the
predicted value of the line through that router x line x metric's recent history, read from the
engine's ``trend_source`` when the record is evaluated (:mod:`mla_watch.alerting.trend`). A record
whose history is too short is not judged, like a window under ``min_tokens``; without a
``trend_source`` trend rules are never judged (a warning says so). ``min_tokens`` is still judged
on the record's own window, and the state machine is the same.

With a ``state_path``, every instance that is not inactive is persisted (JSON, written to a
temporary file and ``os.replace``-d) after each evaluation that changed a state or a timer (an
instance's latest value is saved with its changes, not on every evaluation), and loaded again
at start: after a restart a firing alert stays firing without paging again, a
pending one keeps its ``active_since``, and a resolution is notified normally.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

from mla_watch.alerting.model import Alert, AlertState, Rule, RuleSet, fingerprint
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.trend import TrendSource, crossing_in, enough_data, fit, format_crossing
from mla_watch.statedir import replace_private, set_aside
from mla_watch.windows import ALL_LINES

__all__ = ["RESOLVED_RETENTION_SECONDS", "STATE_FORMAT", "Action", "AlertEngine", "AlertInstance"]

log = logging.getLogger("mla_watch.alerting.engine")

STATE_FORMAT = "mla_watch.alert_state/1"
RESOLVED_RETENTION_SECONDS = 3600.0  # resolved instances stay visible in alerts() this long
_TREND_FIELDS = ("current", "slope_per_hour", "slope_per_day", "predicted", "crossing_in")
_MAX_SELECTOR_CACHE = 100_000  # (router, layer, kind, line) keys; cleared when exceeded

Render = Callable[[Rule, Mapping[str, object]], dict[str, str]]
_RecordKey = tuple[Any, Any, Any, Any]  # (router name, layer, kind, business_line) as the record has them


@dataclass(frozen=True)
class Action:
    """Something the engine asks its owner to do: notify receivers, or schedule a router re-tune."""

    kind: Literal["notify", "retune"]
    alert: Alert
    rule: Rule
    record: Mapping[str, object]  # the statistics record that triggered it ({} when there was none)


@dataclass
class AlertInstance:
    """The public view of one alert instance (``GET /v1/alerts``)."""

    rule: str
    labels: dict[str, str]
    state: AlertState
    value: float | None
    active_since: float | None  # wall clock when it became pending
    firing_since: float | None
    resolved_at: float | None
    last_evaluated: float | None
    annotations: dict[str, str] = field(default_factory=dict)
    metric: str | None = None  # the rule's metric (None once its rule is gone)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "metric": self.metric, "labels": dict(self.labels), "state": self.state,
                "value": self.value,
                "active_since": self.active_since, "firing_since": self.firing_since,
                "resolved_at": self.resolved_at, "last_evaluated": self.last_evaluated,
                "annotations": dict(self.annotations), "fingerprint": self.fingerprint}


class _Compiled:
    """A rule with its thresholds resolved, for the hot loop."""

    __slots__ = ("above", "below", "bounds", "for_s", "id", "keep_s", "levels", "metric", "min_tokens", "notify",
                 "resolve_above", "resolve_below", "retune", "rule", "trend")

    def __init__(self, rule_id: str, rule: Rule) -> None:
        self.id = rule_id
        self.rule = rule
        self.metric = rule.metric
        self.below = rule.below
        self.above = rule.above
        self.resolve_above = rule.below if rule.resolve_above is None else rule.resolve_above
        self.resolve_below = rule.above if rule.resolve_below is None else rule.resolve_below
        self.for_s = float(rule.for_seconds)
        self.keep_s = float(rule.keep_firing_for_seconds)
        self.min_tokens = rule.min_tokens
        self.notify = "notify" in rule.actions
        self.retune = "retune" in rule.actions
        self.trend = rule.trend
        # (below, above, resolve_above, resolve_below) as the rule writes them: for a rule relative to the
        # healthy baseline, the bounds of its levels; `levels`, the same where they are the levels (else None)
        self.bounds = (self.below, self.above, self.resolve_above, self.resolve_below)
        self.levels = None if rule.baseline else self.bounds

    def series_levels(self, record: Mapping[str, object]) -> tuple[Any, Any, Any, Any] | None:
        """The levels of a rule relative to the baseline for ``record``'s series; ``None`` without a baseline."""
        baseline = record.get("baseline")
        healthy = baseline.get(self.metric) if isinstance(baseline, Mapping) else None
        return self.rule.levels(healthy if isinstance(healthy, int | float) else None)

    def labels(self, key: _RecordKey) -> dict[str, str]:
        name, layer, kind, line = key
        return {"alertname": self.rule.name, "severity": self.rule.severity, "router": str(name),
                "layer": str(layer), "kind": str(kind), "business_line": ALL_LINES if line is None else str(line),
                **{str(k): str(v) for k, v in self.rule.labels.items()}}

    def matches(self, key: _RecordKey, num_slots: int | None = None, hash_routed: bool = False) -> bool:
        """Whether the selector takes this router x line; ``num_slots`` None (a state file written before
        instances kept it): any geometry."""
        name, layer, kind, line = key
        record = {"name": name, "layer": layer, "kind": kind, "business_line": line, "hash_routed": hash_routed}
        if num_slots is None:
            return dataclasses.replace(self.rule.selector, slots=None).matches(record)
        record["num_slots"] = num_slots
        return self.rule.selector.matches(record)


class _Instance:
    __slots__ = ("active_since", "annotations", "firing_since", "hash_routed", "healthy_since", "json", "key",
                 "labels", "last_evaluated", "levels", "notified", "num_slots", "record", "resolved_at", "rule_id",
                 "state", "value")

    def __init__(self, rule_id: str, key: _RecordKey, labels: dict[str, str]) -> None:
        self.rule_id = rule_id
        self.key = key
        self.labels = labels
        self.state: AlertState = "inactive"
        self.active_since: float | None = None
        self.firing_since: float | None = None
        self.resolved_at: float | None = None
        self.last_evaluated: float | None = None
        self.healthy_since: float | None = None  # start of the keep_firing_for timer
        self.value: float | None = None
        self.notified = False  # a firing notify was emitted, so the resolution must be notified too
        self.record: Mapping[str, object] | None = None  # the latest judged record
        self.levels: tuple[Any, Any, Any, Any] | None = None  # the levels it was judged by, latest
        self.annotations: dict[str, str] = {}  # as rendered at the latest transition
        self.json: str | None = None  # serialized at the latest save; None once a state or timer changed
        self.num_slots: int | None = None  # the router's geometry, which `slots` selectors judge
        self.hash_routed = False

    def to_json(self) -> dict[str, Any]:
        name, layer, kind, line = self.key
        return {"rule": self.rule_id, "router": name, "layer": layer, "kind": kind, "business_line": line,
                "labels": self.labels, "state": self.state, "active_since": self.active_since,
                "firing_since": self.firing_since, "resolved_at": self.resolved_at,
                "last_evaluated": self.last_evaluated, "healthy_since": self.healthy_since,
                "value": self.value, "notified": self.notified, "annotations": self.annotations,
                "num_slots": self.num_slots, "hash_routed": self.hash_routed}

    @classmethod
    def from_json(cls, data: Any) -> _Instance:
        if not isinstance(data, dict):
            raise ValueError(f"instance: expected an object, got {data!r}")
        rule_id, labels, state = data.get("rule"), data.get("labels"), data.get("state")
        if not isinstance(rule_id, str) or not isinstance(labels, dict) or state not in ("pending", "firing",
                                                                                         "resolved"):
            raise ValueError(f"instance: bad rule/labels/state in {data!r}")
        layer = data.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ValueError(f"instance: layer {layer!r} is not an integer")
        key = (data.get("router"), layer, data.get("kind"), data.get("business_line"))
        inst = cls(rule_id, key, {str(k): str(v) for k, v in labels.items()})
        inst.state = state
        for name in ("active_since", "firing_since", "resolved_at", "last_evaluated", "healthy_since", "value"):
            value = data.get(name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"instance: {name} = {value!r} is not a number")
            setattr(inst, name, None if value is None else float(value))
        inst.notified = bool(data.get("notified", False))
        num_slots = data.get("num_slots")
        if num_slots is not None and (not isinstance(num_slots, int) or isinstance(num_slots, bool)):
            raise ValueError(f"instance: num_slots {num_slots!r} is not an integer")
        inst.num_slots = num_slots
        inst.hash_routed = bool(data.get("hash_routed", False))
        annotations = data.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise ValueError(f"instance: annotations {annotations!r} is not an object")
        inst.annotations = {str(k): str(v) for k, v in annotations.items()}
        if state == "firing" and inst.firing_since is None:
            raise ValueError("instance: firing without firing_since")
        if state == "pending" and inst.active_since is None:
            raise ValueError("instance: pending without active_since")
        return inst


class AlertEngine:
    """Evaluates a :class:`RuleSet` over routing statistics records; thread-safe."""

    def __init__(self, rules: RuleSet, *, state_path: Path | None = None, clock: Callable[[], float] = time.time,
                 render: Render | None = None, status_url: str = "", trend_source: TrendSource | None = None) -> None:
        self._clock = clock
        self._trend_source = trend_source
        self._render = render or render_annotations
        self._status_url = status_url
        self._state_path = Path(state_path) if state_path is not None else None
        self._lock = threading.RLock()
        self._rules: dict[str, _Compiled] = {}
        # record key -> {rule id -> instance}: one dict lookup per record, no allocation per check
        self._instances: dict[_RecordKey, dict[str, _Instance]] = {}
        # (router, layer, kind, line, num_slots, hash_routed): the geometry decides `slots` selectors
        self._selector_cache: dict[tuple[Any, ...], tuple[_Compiled, ...]] = {}
        self._queued: list[Action] = []  # resolutions found outside evaluate() (restart with changed rules)
        self._next_prune = math.inf
        self._compile(rules)
        if self._state_path is not None:
            self._load()

    # ------------------------------------------------------------------ public API
    def evaluate(self, records: Iterable[Mapping[str, object]]) -> list[Action]:
        """Judge every record against every matching rule; return the actions of the transitions."""
        with self._lock:
            now = self._clock()
            actions, self._queued = self._queued, []
            changed = bool(actions)
            cache = self._selector_cache
            instances = self._instances
            series: dict[tuple[Any, ...], tuple[list[float], list[float]]] = {}  # history read once per evaluation
            bad = 0
            for record in records:
                try:
                    key = (record["name"], record["layer"], record["kind"], record.get("business_line"))
                    geometry = (record.get("num_slots"), bool(record.get("hash_routed", False)))
                    matched = cache.get((*key, *geometry))
                    if matched is None:
                        matched = self._match(key, geometry)
                    if not matched:
                        continue
                    tokens = record.get("tokens") or 0
                    record_min = record.get("min_tokens") or 0
                    by_rule = instances.get(key)
                    for rule in matched:
                        # Small windows read low (the plug-in entropy estimator is biased downwards by
                        # ~(N-1)/(2 n ln 2) bits, and MaxVio / dead slots are noisy over few tokens), so a
                        # window under the minimum is not judged at all: no breach, but no recovery
                        # either - the instance keeps its state and its timers.
                        if tokens < (record_min if rule.min_tokens is None else rule.min_tokens):
                            continue
                        if rule.trend is None:
                            value = record.get(rule.metric)
                        else:
                            judged = self._trend_value(rule, key, record, now, series)
                            if judged is None:  # no history, or too little of it: not judged
                                continue
                            value, record = judged
                        if value is None or value != value:  # no baseline / not an indexer / NaN: not judged
                            continue
                        levels = rule.levels or rule.series_levels(record)
                        if levels is None:  # relative to a healthy baseline this series has not learned yet
                            continue
                        inst = by_rule.get(rule.id) if by_rule is not None else None
                        below, above = levels[0], levels[1]
                        breach = (below is not None and value < below) or (above is not None and value > above)
                        if inst is None:
                            if not breach:
                                continue
                            inst = _Instance(rule.id, key, rule.labels(key))
                            inst.num_slots, inst.hash_routed = geometry
                            if by_rule is None:
                                by_rule = instances[key] = {}
                            by_rule[rule.id] = inst
                        elif breach and inst.healthy_since is None and inst.state == "firing":
                            # the common case of a long incident, inlined: still firing, nothing changes
                            inst.value = value
                            inst.last_evaluated = now
                            inst.record = record
                            inst.levels = levels
                            continue
                        inst.levels = levels
                        if self._step(inst, rule, record, value, breach, now, actions):
                            inst.json = None
                            changed = True
                        if inst.state == "inactive":
                            del by_rule[rule.id]
                            if not by_rule:
                                del instances[key]
                                by_rule = None
                except (KeyError, TypeError, ValueError) as error:
                    bad += 1
                    if bad == 1:
                        log.error("alert evaluation skipped a malformed record (%s: %s): %r",
                                  type(error).__name__, error, record)
            if bad > 1:
                log.error("alert evaluation skipped %d malformed records in all", bad)
            if now >= self._next_prune and self._prune(now):
                changed = True
            if changed:
                self._save()
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
                    annotations = (self._annotations(rule, inst, inst.record) if rule is not None
                                   and inst.record is not None else dict(inst.annotations))
                    out.append(AlertInstance(rule=rule.rule.name if rule is not None else inst.labels.get(
                        "alertname", inst.rule_id), labels=dict(inst.labels), state=inst.state, value=inst.value,
                        active_since=inst.active_since, firing_since=inst.firing_since,
                        resolved_at=inst.resolved_at, last_evaluated=inst.last_evaluated,
                        annotations=annotations, metric=rule.metric if rule is not None else None))
        out.sort(key=lambda a: (order.get(a.state, 3), a.rule, a.labels.get("router", ""),
                                a.labels.get("layer", ""), a.labels.get("business_line", "")))
        return out

    def active_series(self) -> set[tuple[str, str]]:
        """(router, business line) of every instance pending or firing: series not to learn as healthy."""
        with self._lock:
            return {(inst.labels.get("router", ""), inst.labels.get("business_line", ""))
                    for by_rule in self._instances.values() for inst in by_rule.values()
                    if inst.state in ("pending", "firing")}

    def firing_counts(self) -> dict[tuple[str, str], int]:
        """(alertname, severity) -> number of firing instances; every current rule is present, 0 if quiet."""
        with self._lock:
            counts = {(c.rule.name, str(c.rule.labels.get("severity", c.rule.severity))): 0
                      for c in self._rules.values()}
            for by_rule in self._instances.values():
                for inst in by_rule.values():
                    if inst.state == "firing":
                        key = (inst.labels.get("alertname", ""), inst.labels.get("severity", ""))
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
                    if (new is not None and new.matches(key, inst.num_slots, inst.hash_routed)
                            and new.labels(key) == inst.labels):
                        continue
                    del by_rule[rule_id]
                    why = "was removed" if new is None else "changed its labels or selector"
                    log.info("alert %s %s: rule %r %s; the instance is dropped", inst.labels.get("alertname"),
                             inst.state, rule_id, why)
                    previous = old.get(rule_id) or new
                    if inst.state == "firing" and inst.notified and previous is not None:
                        actions.append(self._resolved_action(inst, previous, now))
                if not by_rule:
                    del self._instances[key]
            self._save()
            return actions

    # ------------------------------------------------------------------ trend rules
    def _trend_value(self, rule: _Compiled, key: _RecordKey, record: Mapping[str, object], now: float,
                     series: dict[tuple[Any, ...], tuple[list[float], list[float]]],
                     ) -> tuple[float, Mapping[str, object]] | None:
        """A trend rule's value (slope per unit, or the predicted value) and the record with the trend's
        template fields added; ``None`` when the history cannot judge it (see :mod:`~mla_watch.alerting.trend`)."""
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
        # The template fields travel in the record the instance keeps, so a resolution renders them too.
        judged = {**record, "current": record.get(rule.metric), "slope_per_hour": line_fit.slope * 3600.0,
                  "slope_per_day": line_fit.slope * 86400.0,
                  "predicted": predicted if trend.kind == "predict" else None,
                  "crossing_in": format_crossing(crossing) if trend.kind == "predict" else None}
        return value, judged

    # ------------------------------------------------------------------ state machine
    def _step(self, inst: _Instance, rule: _Compiled, record: Mapping[str, object], value: Any, breach: bool,
              now: float, actions: list[Action]) -> bool:
        """Advance one judged instance; True when its state or a timer changed (worth persisting)."""
        inst.value = value
        inst.last_evaluated = now
        inst.record = record
        state = inst.state
        if state == "firing":
            if breach:
                if inst.healthy_since is not None:
                    inst.healthy_since = None
                    return True
                return False
            below, above, resolve_above, resolve_below = inst.levels or rule.bounds
            healthy = ((below is None or value >= resolve_above)
                       and (above is None or value <= resolve_below))
            if not healthy:  # hysteresis band: stays firing, and health is no longer continuous
                if inst.healthy_since is not None:
                    inst.healthy_since = None
                    return True
                return False
            changed = False
            if inst.healthy_since is None:
                inst.healthy_since = now
                changed = True
            if now - inst.healthy_since >= rule.keep_s:
                inst.state = "resolved"
                inst.resolved_at = now
                inst.healthy_since = None
                self._next_prune = min(self._next_prune, now + RESOLVED_RETENTION_SECONDS)
                if inst.notified:
                    actions.append(self._resolved_action(inst, rule, now))
                inst.notified = False
                return True
            return changed
        if not breach:
            if state == "pending":  # recovered before `for` elapsed: never notified, nothing to say
                inst.state = "inactive"
                return True
            return False  # inactive or resolved stay so
        if state != "pending":  # inactive or resolved: a new incident starts
            inst.state = "pending"
            inst.active_since = now
            inst.firing_since = inst.resolved_at = inst.healthy_since = None
            inst.notified = False
        if now - inst.active_since >= rule.for_s:
            inst.state = "firing"
            inst.firing_since = now
            inst.healthy_since = None
            alert = self._alert(inst, rule, record, "firing", None)
            inst.annotations = dict(alert.annotations)
            if rule.notify:
                actions.append(Action("notify", alert, rule.rule, record))
                inst.notified = True
            if rule.retune:
                actions.append(Action("retune", alert, rule.rule, record))
        return True

    def _resolved_action(self, inst: _Instance, rule: _Compiled, now: float) -> Action:
        record = inst.record if inst.record is not None else {}
        alert = self._alert(inst, rule, record, "resolved", now)
        inst.annotations = dict(alert.annotations)
        return Action("notify", alert, rule.rule, record)

    def _alert(self, inst: _Instance, rule: _Compiled, record: Mapping[str, object],
               status: Literal["firing", "resolved"], ends_at: float | None) -> Alert:
        annotations = self._annotations(rule, inst, record) if record else dict(inst.annotations)
        value = inst.value
        return Alert(labels=dict(inst.labels), annotations=annotations, status=status,
                     starts_at=inst.firing_since if inst.firing_since is not None else inst.active_since or 0.0,
                     ends_at=ends_at, value=float("nan") if value is None else float(value),
                     generator_url=self._router_url(inst))

    def _router_url(self, inst: _Instance) -> str:
        if not self._status_url:
            return ""
        # The status page reads this anchor: it selects the business line and the rule's metric, and
        # highlights the row and the alert.
        rule = self._rules.get(inst.rule_id)
        anchor = urlencode({"router": inst.labels.get("router", ""), "layer": inst.labels.get("layer", ""),
                            "business_line": inst.labels.get("business_line", ""),
                            "metric": rule.metric if rule is not None else "",
                            "alertname": inst.labels.get("alertname", "")})
        return f"{self._status_url}#{anchor}"

    def _annotations(self, rule: _Compiled, inst: _Instance, record: Mapping[str, object]) -> dict[str, str]:
        value = inst.value
        below, above, resolve_above, resolve_below = inst.levels or rule.bounds
        if below is not None and (above is None or value is None or value < below):
            threshold, resolve = below, resolve_above
        else:
            threshold, resolve = above, resolve_below
        labels = inst.labels
        baseline = record.get("baseline")
        healthy = baseline.get(rule.metric) if isinstance(baseline, Mapping) else None
        fields = {"alertname": rule.rule.name, "metric": rule.metric, "value": value, "threshold": threshold,
                  "healthy": healthy,
                  "resolve_threshold": resolve, "router": labels.get("router"), "layer": labels.get("layer"),
                  "kind": labels.get("kind"), "business_line": labels.get("business_line"),
                  "floor_bits": record.get("floor_bits"), "ceiling_bits": record.get("ceiling_bits"),
                  "tokens": record.get("tokens"), "min_tokens": (rule.min_tokens if rule.min_tokens is not None
                                                                 else record.get("min_tokens")),
                  "severity": labels.get("severity"), "status_url": self._router_url(inst),
                  **{name: record.get(name) for name in _TREND_FIELDS}}
        try:
            rendered = self._render(rule.rule, fields)
            return {str(k): str(v) for k, v in rendered.items()}
        except Exception as error:  # a render bug must never stop evaluation
            log.error("rendering the annotations of rule %r failed: %s", rule.rule.name, error)
            return {"summary": f"{rule.rule.name}: {rule.metric} = {value} on {labels.get('router')} "
                               f"(annotation rendering failed: {type(error).__name__}: {error})"}

    # ------------------------------------------------------------------ rules and cache
    def _compile(self, rules: RuleSet) -> None:
        compiled: dict[str, _Compiled] = {}
        for rule in rules.rules:
            rule_id, n = rule.name, 1
            while rule_id in compiled:
                n += 1
                rule_id = f"{rule.name}#{n}"
            if n > 1:
                log.warning("rule %r (%s) shares its name with an earlier rule; its instances are tracked as %r",
                            rule.name, rule.source or "?", rule_id)
            compiled[rule_id] = _Compiled(rule_id, rule)
        self._rules = compiled
        self._selector_cache = {}
        if self._trend_source is None:
            for rule in compiled.values():
                if rule.trend is not None:
                    log.warning("rule %r (%s) is a trend rule, and this alert engine has no routing history "
                                "(trend_source): it is never judged", rule.rule.name, rule.rule.source or "?")

    def _match(self, key: _RecordKey, geometry: tuple[Any, bool]) -> tuple[_Compiled, ...]:
        if len(self._selector_cache) >= _MAX_SELECTOR_CACHE:
            self._selector_cache.clear()
        slots, hashed = geometry
        matched = tuple(rule for rule in self._rules.values()
                        if rule.matches(key, None if slots is None else int(slots), hashed))
        self._selector_cache[(*key, *geometry)] = matched
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

    # ------------------------------------------------------------------ persistence
    def _save(self) -> None:
        path = self._state_path
        if path is None:
            return
        try:
            # An instance is serialized again only when its state or a timer changed since the last
            # save (its latest value is refreshed then too), so a save during a storm of transitions
            # does not re-encode thousands of unchanged instances.
            fragments = []
            for by_rule in self._instances.values():
                for inst in by_rule.values():
                    if inst.json is None:
                        inst.json = json.dumps(inst.to_json(), separators=(",", ":"))
                    fragments.append(inst.json)
            text = (f'{{"format":{json.dumps(STATE_FORMAT)},"saved_at":{json.dumps(self._clock())},'
                    f'"instances":[{",".join(fragments)}]}}')
            replace_private(path, text)
        except (OSError, TypeError, ValueError) as error:  # keep evaluating; the next change retries
            log.error("cannot write the alert state file %s: %s", path, error)

    def _load(self) -> None:
        path = self._state_path
        assert path is not None
        try:
            text = path.read_text()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as error:
            self._set_aside(path, f"cannot read it: {error}")
            return
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
                raise ValueError(f"key 'format' must be {STATE_FORMAT!r}")
            entries = document.get("instances")
            if not isinstance(entries, list):
                raise ValueError("key 'instances' must be a list")
            loaded = [_Instance.from_json(entry) for entry in entries]
        except (ValueError, TypeError) as error:
            self._set_aside(path, str(error))
            return
        now = self._clock()
        kept = 0
        for inst in loaded:
            rule = self._rules.get(inst.rule_id)
            if rule is None:
                log.warning("alert state %s: dropping the %s instance %s of rule %r, which no longer exists",
                            path, inst.state, inst.labels, inst.rule_id)
                if inst.state == "firing" and inst.notified:
                    log.warning("alert state %s: %s was firing and notified; its rule is gone, so no "
                                "resolution can be sent for it", path, inst.labels)
                continue
            if not rule.matches(inst.key, inst.num_slots, inst.hash_routed) or rule.labels(inst.key) != inst.labels:
                log.warning("alert state %s: rule %r changed its labels or selector; the %s instance %s is "
                            "dropped", path, inst.rule_id, inst.state, inst.labels)
                if inst.state == "firing" and inst.notified:  # close the page sent under the old labels
                    self._queued.append(self._resolved_action(inst, rule, now))
                continue
            if inst.state == "resolved":
                self._next_prune = min(self._next_prune, (inst.resolved_at or now) + RESOLVED_RETENTION_SECONDS)
            self._instances.setdefault(inst.key, {})[inst.rule_id] = inst
            kept += 1
        if kept != len(loaded):
            self._save()
        log.info("alert state %s: restored %d instance(s)", path, kept)

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".corrupt")
        try:
            set_aside(path)
            log.error("alert state file %s is corrupt (%s); starting with no alerts, kept it as %s", path, why, aside)
        except OSError as error:
            log.error("alert state file %s is corrupt (%s); starting with no alerts; could not move it to %s: %s",
                      path, why, aside, error)
