"""The alert state machine: one judged value moves one alert instance between its states.

Each instance is judged once per :meth:`~mla_watch.alerting.alert_engine.AlertEngine.evaluate` with the
value of the rule's metric:

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
notifier's job.

With a cause judge (:mod:`mla_watch.alerting.causes`; ``serve`` always has one) every firing has a cause:
going pending asks the judge for a reading, and an instance due to fire whose reading is still on its way
stays pending (at most the judge's ``wait_seconds`` past its ``for``, then it fires ``undetermined``). Only
a ``model`` cause emits the ``retune`` action: traffic alone never re-tunes a router. Without a judge (an
engine assembled through the Python API without one) an alert fires without a cause, as it always did.
A firing instance whose cause was not the model is judged again on each newer reading (:func:`recause`):
once the model changed it resolves and fires again with its new cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mla_watch.alerting.causes import Cause, CauseJudge, undetermined
from mla_watch.alerting.compiled import CompiledRule
from mla_watch.alerting.instances import Action, InstanceState
from mla_watch.alerting.rendering import AlertRenderer

__all__ = ["RESOLVED_RETENTION_SECONDS", "recause", "step"]

RESOLVED_RETENTION_SECONDS = 3600.0  # resolved instances stay visible in alerts() this long


def step(
    inst: InstanceState,
    rule: CompiledRule,
    value: Any,
    breach: bool,
    now: float,
    actions: list[Action],
    alerts: AlertRenderer,
    schedule_prune: Callable[[float], None],
    causes: CauseJudge | None = None,
) -> bool:
    """Advance one instance judged at ``value`` (on ``inst.record``); True when its state or a timer changed (worth
    persisting).

    The transition's actions are appended to ``actions``, its alerts made by ``alerts``; a resolution
    calls ``schedule_prune`` with the time its instance may be forgotten.
    """
    inst.value = value
    inst.last_evaluated = now
    state = inst.state
    if state == "firing":
        if breach:
            if inst.healthy_since is not None:
                inst.healthy_since = None
                return True
            return False
        below, above, resolve_above, resolve_below = inst.levels or rule.bounds
        healthy = (below is None or value >= resolve_above) and (above is None or value <= resolve_below)
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
            schedule_prune(now + RESOLVED_RETENTION_SECONDS)
            if inst.notified:
                actions.append(alerts.resolved_action(inst, rule, now))
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
        inst.set_cause(None, rule.rule)
        if causes is not None:
            causes.request(inst.key[3], now)
    assert inst.active_since is not None  # pending: set when the incident started
    if now - inst.active_since >= rule.for_s:
        cause = None if causes is None else _decide(inst, rule, now, causes)
        if causes is not None and cause is None:  # its reading is on its way: pending a little longer
            return state != "pending"
        inst.state = "firing"
        inst.firing_since = now
        inst.healthy_since = None
        _fire(inst, rule, cause, actions, alerts)
    return True


def _decide(inst: InstanceState, rule: CompiledRule, now: float, causes: CauseJudge) -> Cause | None:
    """The cause ``inst`` fires with; ``None`` while the reading it asked for may still come."""
    assert inst.record is not None and inst.active_since is not None
    cause = causes.judge(rule.rule, inst.record, inst.active_since)
    if cause is not None:
        return cause
    waited = now - inst.active_since - rule.for_s
    if waited < causes.wait_seconds:
        return None
    return undetermined(
        f"no reading of the reference prompts came within {causes.wait_seconds:g} s of the alert being due"
    )


def _fire(
    inst: InstanceState, rule: CompiledRule, cause: Cause | None, actions: list[Action], alerts: AlertRenderer
) -> None:
    """Fire ``inst`` with ``cause`` (``None``: an engine without a cause judge, which fires as it always did)."""
    inst.set_cause(cause, rule.rule)
    alert = alerts.alert(inst, rule, "firing", None)
    inst.annotations = dict(alert.annotations)
    if rule.notify:
        actions.append(Action("notify", alert, rule.rule, inst.record))
        inst.notified = True
    if rule.retune and (cause is None or cause.name == "model"):  # a client's traffic never re-tunes a router
        actions.append(Action("retune", alert, rule.rule, inst.record))


def recause(
    inst: InstanceState,
    rule: CompiledRule,
    now: float,
    actions: list[Action],
    alerts: AlertRenderer,
    causes: CauseJudge,
) -> bool:
    """Judge a firing instance's cause again on a newer reading; a new cause resolves the alert sent under the old
    one and fires it again. A ``model`` cause is final until the alert resolves: a repair changes the routers, and
    their reading then, not the traffic, is what a new baseline learns. True when the cause changed."""
    current = inst.cause
    if current is None or current.name == "model" or inst.record is None:
        return False
    latest = causes.latest(inst.key[3])
    if latest is None or (current.reading_at is not None and latest <= current.reading_at):
        return False
    cause = causes.judge(rule.rule, inst.record, current.reading_at or inst.active_since or now)
    if cause is None:
        return False
    if cause.name == current.name:  # the same cause, newer figures
        inst.set_cause(cause, rule.rule)
        return False
    if inst.notified:
        actions.append(alerts.resolved_action(inst, rule, now))
    inst.notified = False
    inst.firing_since = now
    _fire(inst, rule, cause, actions, alerts)
    return True
