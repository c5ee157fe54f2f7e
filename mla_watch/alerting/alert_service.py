"""Alerting as the server runs it: evaluate on an interval, group, notify durably, repeat.

The service owns the rule engine, the outbox and its dispatcher. Every ``interval`` seconds
it reads the routing records of each business line, lets the engine decide transitions,
puts the alerts of the resulting notifications into each receiver's groups (``group_by``), and
flushes the groups that are due as Alertmanager does (``group_wait``, ``group_interval``,
:mod:`mla_watch.alerting.groups`): one notification per group, rendered with the receiver's
notifier and written to the outbox, from which the dispatcher thread delivers them. Firing groups
are sent again every ``repeat_interval`` (and every ``resend_interval`` to Alertmanager's API, so
that alerts expire there if this sidecar dies). What each group notified is kept in the state
directory, so a restart neither pages again nor loses a page still waiting. ``retune`` actions go
to the callbacks registered with :meth:`AlertService.on_retune`; the engine never imports a
re-tuner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from mla_watch.alerting.alert_engine import Action, AlertEngine
from mla_watch.alerting.causes import CAUSE_LABEL, CauseJudge
from mla_watch.alerting.groups import LOG_FILE, GroupRecord, NotificationGroup, NotificationLog, timing
from mla_watch.alerting.instances import AlertInstance
from mla_watch.alerting.notifiers import group_key
from mla_watch.alerting.outbox import Dispatcher, Outbox
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.trend import TrendSource
from mla_watch.alerting.vocabulary import Alert, Notification, Receiver, Rule, RuleSet
from mla_watch.common.state_writes import StateWrites
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER
from mla_watch.routing.windows import RouterStats

__all__ = ["AlertService"]

log = logging.getLogger("mla_watch.alerting")


class AlertService:
    def __init__(
        self,
        rules: RuleSet,
        state_dir: Path,
        *,
        records: Callable[[], Iterable[RouterStats]],
        interval: float = 15.0,
        status_url: str = "",
        external_url: str = "",
        clock: Callable[[], float] = time.time,
        on_notification: Callable[[str, str], None] | None = None,
        before_round: Callable[[], object] | None = None,
        trend_source: TrendSource | None = None,
        causes: CauseJudge | None = None,
        writes: StateWrites | None = None,
    ) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.rules = rules
        self.interval = interval
        self.external_url = external_url
        self._records = records
        self._before_round = before_round  # e.g. reload changed rule files, outside the service's lock
        self._clock = clock
        self.engine = AlertEngine(
            rules,
            state_path=state_dir / "alerts.json",
            clock=clock,
            render=render_annotations,
            status_url=status_url,
            trend_source=trend_source,
            causes=causes,
            writes=writes,
        )
        # A notification the outbox's file cannot take (a full or read-only disk) is held in memory there and
        # delivered all the same; it is written to the file once the disk takes it again.
        self.outbox = Outbox(state_dir / "outbox.sqlite", clock=clock, writes=writes, on_hold=on_notification)
        self.dispatcher = Dispatcher(self.outbox, rules.receivers, on_result=on_notification, clock=clock)
        self._groups: dict[tuple[str, str], NotificationGroup] = {}
        self._log = NotificationLog(state_dir / LOG_FILE, writes=writes)
        self._log_unsaved = False  # the last save of the log failed (a full disk): save again at every round
        self._on_notification = on_notification
        self._retune_callbacks: list[Callable[[Action], str | None]] = []
        self._restore_groups()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for warning in rules.warnings:
            log.warning(warning)

    def judge_causes_with(self, judge: CauseJudge | None) -> None:
        """Judge the cause of each routing alert with ``judge`` from the next evaluation on (the sidecar hands it its
        reference prompts once they are set up; ``None``: no alert waits for a cause)."""
        self.engine.causes = judge

    def on_retune(self, callback: Callable[[Action], str | None]) -> None:
        """Call ``callback`` for each ``retune`` action; what it returns is added to the alert's
        notification as the annotation ``retune`` (what became of the request)."""
        self._retune_callbacks.append(callback)

    def notify_event(
        self, labels: Mapping[str, str], annotations: Mapping[str, str], receivers: Iterable[str] | None = None
    ) -> int:
        """Send a one-off firing notification (not a rule's alert: it is neither repeated nor resolved).

        For events on-call must hear about, such as a re-tuning job rejected by its gates.
        Goes to ``receivers`` (default: every receiver); returns how many notifications were queued.
        """
        now = self._clock()
        alert = Alert(
            labels=dict(labels), annotations=dict(annotations), status="firing", starts_at=now, ends_at=None, value=0.0
        )
        queued = 0
        with self._lock:
            for name in receivers if receivers is not None else list(self.rules.receivers):
                receiver = self.rules.receivers.get(name)
                if receiver is None or receiver.url is None:
                    continue
                group_labels = receiver.group_of(alert.labels)
                self._submit(
                    receiver,
                    Notification(
                        receiver=name,
                        group_key=group_key(group_labels),
                        group_labels=group_labels,
                        alerts=(alert,),
                        status="firing",
                        external_url=self.external_url,
                    ),
                )
                queued += 1
        log.warning("%s: %s", alert.labels.get("alertname"), alert.annotations.get("summary", ""))
        return queued

    def replace_rules(self, rules: RuleSet) -> None:
        with self._lock:
            self.rules = rules
            self.dispatcher.receivers = rules.receivers
            self._dispatch(self.engine.replace_rules(rules))

    def evaluate_once(self) -> list[Action]:
        """One evaluation: transitions, their alerts into the groups, the groups due flushed into the outbox,
        retune requests."""
        with self._lock:
            actions = self.engine.evaluate(self._records())
            self._dispatch(actions)
            self._flush_due()
            return actions

    def alert_views(self) -> list[dict[str, Any]]:
        """The engine's alerts (``GET /v1/alerts``), each with its ``incident``: the notification group it is in
        at its first receiver (pending, its cause undecided: the one it would join at the rule's own receivers) -
        ``receiver``, ``key`` (the groupKey), ``labels`` and ``notified_at`` (the group's last notification;
        ``None`` before one) -, ``None`` where no receiver takes it. The status page shows each as one row."""
        alerts = self.engine.alerts()
        with self._lock:
            rules = {rule.name: rule for rule in self.rules.rules}
            return [
                {
                    **alert.as_dict(),
                    "incident": self._incident(rules.get(alert.rule), alert),
                    "cause_due_at": self._cause_due_at(rules.get(alert.rule), alert),
                }
                for alert in alerts
            ]

    def _cause_due_at(self, rule: Rule | None, alert: AlertInstance) -> float | None:
        """By when a pending alert's cause is decided (wall clock): the reading it asked for comes by then, or it
        fires ``undetermined`` - its ``for`` plus the cause judge's wait past it; ``None`` where nothing waits."""
        causes = self.engine.causes
        if alert.state != "pending" or causes is None or rule is None or alert.active_since is None:
            return None
        return round(alert.active_since + rule.for_seconds + causes.wait_seconds, 3)

    def _incident(self, rule: Rule | None, alert: AlertInstance) -> dict[str, Any] | None:
        for name in rule.receivers_for(alert.labels.get(CAUSE_LABEL)) if rule is not None else ():
            receiver = self.rules.receivers.get(name)
            if receiver is None:
                continue
            labels = receiver.group_of(alert.labels)
            key = group_key(labels)
            group = self._groups.get((name, key))
            return {
                "receiver": name,
                "key": key,
                "labels": labels,
                "notified_at": None if group is None else group.record.notified_at,
            }
        return None

    def start(self, dispatch_interval: float = 1.0) -> None:
        self.dispatcher.start(dispatch_interval)

        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    if self._before_round is not None:
                        self._before_round()
                    self.evaluate_once()
                except Exception:  # evaluation must go on whatever one round hits
                    log.exception("alert evaluation failed")

        self._thread = threading.Thread(target=loop, name="mla-watch-alerts", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop evaluating and notifying, and save the outbox; ``timeout``: the seconds the stop may wait for a round
        or a notification in flight (``None``: as long as they take). What is not sent stays in the outbox's file."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self._stop.set()
        if self._thread is not None:
            self._thread.join(left())
        self.dispatcher.stop(left())
        # Flush what can be flushed before exiting, within the time left: a request cut short stays in the outbox's
        # file, sent after the restart.
        flush = threading.Thread(target=self._flush, name="mla-watch-notify-flush", daemon=True)
        flush.start()
        flush.join(left())
        lost = self.outbox.write_held()
        if lost:  # the disk still refuses the outbox's file: these never reach a file that outlives the process
            log.error(
                "stopping with %d notification(s) held in memory that the outbox's file %s could not take: "
                "they are lost",
                lost,
                self.outbox.path,
            )

    def _flush(self) -> None:
        try:
            self.dispatcher.run_once()
        except Exception:  # the stop goes on: what was not sent is in the outbox's file
            log.exception("sending the notifications due at the stop failed")

    # ------------------------------------------------------------------ internals
    def _restore_groups(self) -> None:
        """After a restart, each group keeps what it notified (the notification log): alerts still firing that it
        notified are repeated, not paged again; those it had not notified yet (a restart during the group's wait)
        are, and a resolution it had not sent is sent. Without a log (a state directory from before it), every
        alert still firing is taken as notified."""
        now = self._clock()
        logged = self._log.load()
        rules = {rule.name: rule for rule in self.rules.rules}
        for (name, key), (labels, record) in (logged or {}).items():
            receiver = self.rules.receivers.get(name)
            if receiver is None or receiver.url is None:
                continue
            self._groups[(name, key)] = NotificationGroup(
                receiver,
                key,
                labels,
                flush_at=max(record.flush_at if record.flush_at is not None else now, now),
                flushed=True,
                record=record,
            )
        for instance in self.engine.alerts():
            rule = rules.get(instance.rule)
            if rule is None or instance.state not in ("firing", "resolved"):
                continue
            firing = instance.state == "firing"
            alert = Alert(
                labels=dict(instance.labels),
                annotations=dict(instance.annotations),
                status="firing" if firing else "resolved",
                starts_at=instance.firing_since or instance.resolved_at or now,
                ends_at=None if firing else instance.resolved_at,
                value=instance.value or 0.0,
            )
            for name in rule.receivers_for(alert.labels.get(CAUSE_LABEL)):
                group = self._group_of(name, alert, now, create=firing)
                if group is None:
                    continue
                if logged is None and firing:  # notified by the sidecar before this one: repeated, not paged again
                    group.flushed = True
                    group.flush_at = now + timing(group.receiver)[1]
                    group.record = GroupRecord(
                        group.record.firing | {alert.fingerprint}, frozenset(), now, group.flush_at
                    )
                if firing or alert.fingerprint in group.record.firing:  # a resolution only the receiver awaits
                    group.add(alert, now)
        self._log_unsaved = not self._log.save(self._groups.values(), now)

    def _group_of(self, name: str, alert: Alert, now: float, *, create: bool = True) -> NotificationGroup | None:
        """``alert``'s group at the receiver ``name`` (made when new and ``create``); ``None`` for a receiver
        without a URL (its alerts are evaluated, exported and logged, not sent)."""
        receiver = self.rules.receivers.get(name)
        if receiver is None or receiver.url is None:
            return None
        labels = receiver.group_of(alert.labels)
        key = group_key(labels)
        group = self._groups.get((name, key))
        if group is None and create:
            group = self._groups[(name, key)] = NotificationGroup.new(receiver, key, labels, now)
        return group

    def _dispatch(self, actions: Iterable[Action]) -> None:
        """Run every action, each isolated: one that fails never keeps another from running.

        ``retune`` actions run first, so that an alert's page can say what became of its job.
        """
        now = self._clock()
        actions = sorted(actions, key=lambda action: action.kind != "retune")
        notes: dict[str, str] = {}
        for action in actions:
            try:
                if action.kind == "retune":
                    note = self._request_retune(action)
                    if note:
                        notes[action.alert.fingerprint] = note
                else:
                    alert = action.alert
                    if alert.fingerprint in notes:
                        alert = replace(alert, annotations={**alert.annotations, "retune": notes[alert.fingerprint]})
                    self._notify(action.rule.receivers_for(alert.labels.get(CAUSE_LABEL)), alert, now)
            except Exception:  # logged; the other actions of this round still run
                log.exception("alert %s: its %s action failed", action.alert.labels.get("alertname"), action.kind)

    def _request_retune(self, action: Action) -> str:
        labels = action.alert.labels
        log.warning(
            "alert %s asks for a router re-tune of %s (layer %s, %s)",
            labels.get("alertname"),
            labels.get(ROUTER),
            labels.get(LAYER),
            labels.get(BUSINESS_LINE),
        )
        notes = []
        for callback in self._retune_callbacks:
            try:
                note = callback(action)
            except Exception as error:  # the page goes out all the same, saying why
                log.exception("alert %s: the re-tune request failed", labels.get("alertname"))
                note = f"no re-tune job: the request failed ({type(error).__name__})"
            if note:
                log.warning("alert %s: %s", labels.get("alertname"), note)
                notes.append(note)
        return "; ".join(notes)

    def _notify(self, receivers: Iterable[str], alert: Alert, now: float) -> None:
        log.warning(
            "alert %s %s: %s",
            alert.labels.get("alertname"),
            alert.status,
            alert.annotations.get("summary", dict(alert.labels)),
        )
        for name in receivers:
            # A resolution joins the group that holds its alert; one no group holds was never notified.
            group = self._group_of(name, alert, now, create=alert.status == "firing")
            if group is not None:
                group.add(alert, now)

    def _flush_due(self) -> None:
        """Flush every group whose time has come; forget those left empty; write the log when it changed."""
        now = self._clock()
        changed = False
        for ident, group in list(self._groups.items()):
            if group.flush_at > now:
                continue
            receiver = self.rules.receivers.get(group.receiver.name)
            if receiver is None or receiver.url is None:  # removed or disabled by a reload: nowhere to send
                del self._groups[ident]
                changed = True
                continue
            group.receiver = receiver  # a reload may have changed its timing
            try:
                changed |= group.flush(now, self.external_url, partial(self._submit, receiver))
            except Exception:  # logged; the group is flushed again at its next flush, the others now
                log.exception("receiver %s: the notification of group %s failed", receiver.name, group.key)
                continue
            if not group.alerts:
                del self._groups[ident]
                changed = True
        if changed or self._log_unsaved:
            self._log_unsaved = not self._log.save(self._groups.values(), now)

    def _submit(self, receiver: Receiver, notification: Notification) -> None:
        self.outbox.submit(receiver, notification)  # held in memory there when its file cannot take it
