"""Alerting as the server runs it: evaluate on an interval, group, notify durably, repeat.

The service owns the rule engine, the outbox and its dispatcher. Every ``interval`` seconds
it reads the routing records of each business line, lets the engine decide transitions,
groups the resulting notifications per receiver (``group_by``), renders them with the
receiver's notifier and writes them to the outbox, from which the dispatcher thread delivers
them. Firing groups are sent again every ``repeat_interval`` (and every ``resend_interval``
to Alertmanager's API, so that alerts expire there if this sidecar dies). ``retune`` actions
go to the callbacks registered with :meth:`AlertService.on_retune`; the engine never imports
a re-tuner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from mla_watch.alerting.causes import CAUSE_LABEL, CauseJudge
from mla_watch.alerting.engine import Action, AlertEngine
from mla_watch.alerting.model import Alert, Notification, Receiver, RuleSet
from mla_watch.alerting.notifiers import group_key
from mla_watch.alerting.outbox import Dispatcher, Outbox
from mla_watch.alerting.templates import render_annotations
from mla_watch.alerting.trend import TrendSource
from mla_watch.common.state_writes import StateWrites
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER
from mla_watch.routing.windows import RouterStats

__all__ = ["AlertService"]

log = logging.getLogger("mla_watch.alerting")


@dataclass
class _Group:
    receiver: Receiver
    key: str
    labels: dict[str, str]
    alerts: dict[str, Alert]  # fingerprint -> latest firing alert
    last_sent: float


class AlertService:
    def __init__(self, rules: RuleSet, state_dir: Path, *, records: Callable[[], Iterable[RouterStats]],
                 interval: float = 15.0, status_url: str = "", external_url: str = "",
                 clock: Callable[[], float] = time.time,
                 on_notification: Callable[[str, str], None] | None = None,
                 before_round: Callable[[], object] | None = None,
                 trend_source: TrendSource | None = None, causes: CauseJudge | None = None,
                 writes: StateWrites | None = None) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.rules = rules
        self.interval = interval
        self.external_url = external_url
        self._records = records
        self._before_round = before_round  # e.g. reload changed rule files, outside the service's lock
        self._clock = clock
        self.engine = AlertEngine(rules, state_path=state_dir / "alerts.json", clock=clock,
                                  render=render_annotations, status_url=status_url, trend_source=trend_source,
                                  causes=causes, writes=writes)
        # A notification the outbox's file cannot take (a full or read-only disk) is held in memory there and
        # delivered all the same; it is written to the file once the disk takes it again.
        self.outbox = Outbox(state_dir / "outbox.sqlite", clock=clock, writes=writes, on_hold=on_notification)
        self.dispatcher = Dispatcher(self.outbox, rules.receivers, on_result=on_notification, clock=clock)
        self._groups: dict[tuple[str, str], _Group] = {}
        self._on_notification = on_notification
        self._retune_callbacks: list[Callable[[Action], str | None]] = []
        self._restore_groups()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for warning in rules.warnings:
            log.warning(warning)

    def on_retune(self, callback: Callable[[Action], str | None]) -> None:
        """Call ``callback`` for each ``retune`` action; what it returns is added to the alert's
        notification as the annotation ``retune`` (what became of the request)."""
        self._retune_callbacks.append(callback)

    def notify_event(self, labels: Mapping[str, str], annotations: Mapping[str, str],
                     receivers: Iterable[str] | None = None) -> int:
        """Send a one-off firing notification (not a rule's alert: it is neither repeated nor resolved).

        For events on-call must hear about, such as a re-tuning job rejected by its gates.
        Goes to ``receivers`` (default: every receiver); returns how many notifications were queued.
        """
        now = self._clock()
        alert = Alert(labels=dict(labels), annotations=dict(annotations), status="firing", starts_at=now,
                      ends_at=None, value=0.0)
        queued = 0
        with self._lock:
            for name in receivers if receivers is not None else list(self.rules.receivers):
                receiver = self.rules.receivers.get(name)
                if receiver is None or receiver.url is None:
                    continue
                group_labels = {k: alert.labels[k] for k in receiver.group_by if k in alert.labels}
                self._submit(receiver, Notification(
                    receiver=name, group_key=group_key(group_labels), group_labels=group_labels, alerts=(alert,),
                    status="firing", external_url=self.external_url))
                queued += 1
        log.warning("%s: %s", alert.labels.get("alertname"), alert.annotations.get("summary", ""))
        return queued

    def replace_rules(self, rules: RuleSet) -> None:
        with self._lock:
            self.rules = rules
            self.dispatcher.receivers = rules.receivers
            self._dispatch(self.engine.replace_rules(rules))

    def evaluate_once(self) -> list[Action]:
        """One evaluation: transitions, notifications into the outbox, repeats, retune requests."""
        with self._lock:
            actions = self.engine.evaluate(self._records())
            self._dispatch(actions)
            self._repeat()
            return actions

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

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.dispatcher.run_once()  # flush what can be flushed before exiting
        self.dispatcher.stop()
        lost = self.outbox.write_held()
        if lost:  # the disk still refuses the outbox's file: these never reach a file that outlives the process
            log.error("stopping with %d notification(s) held in memory that the outbox's file %s could not take: "
                      "they are lost", lost, self.outbox.path)

    # ------------------------------------------------------------------ internals
    def _restore_groups(self) -> None:
        """After a restart, alerts still firing keep being repeated (they are not paged again now)."""
        now = self._clock()
        rules = {rule.name: rule for rule in self.rules.rules}
        for instance in self.engine.alerts():
            rule = rules.get(instance.rule)
            if instance.state != "firing" or rule is None:
                continue
            alert = Alert(labels=dict(instance.labels), annotations=dict(instance.annotations), status="firing",
                          starts_at=instance.firing_since or now, ends_at=None, value=instance.value or 0.0)
            for group in self._groups_of(rule.receivers_for(alert.labels.get(CAUSE_LABEL)), alert, now):
                group.alerts[alert.fingerprint] = alert

    def _groups_of(self, receivers: Iterable[str], alert: Alert, now: float) -> list[_Group]:
        """The notification group of ``alert`` at each receiver that has a URL (created if new)."""
        groups = []
        for name in receivers:
            receiver = self.rules.receivers.get(name)
            if receiver is None or receiver.url is None:
                continue  # no URL configured: evaluated, exported and logged, not sent
            labels = {k: alert.labels[k] for k in receiver.group_by if k in alert.labels}
            key = group_key(labels)
            groups.append(self._groups.setdefault((name, key), _Group(receiver, key, labels, {}, now)))
        return groups

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
        log.warning("alert %s asks for a router re-tune of %s (layer %s, %s)", labels.get("alertname"),
                    labels.get(ROUTER), labels.get(LAYER), labels.get(BUSINESS_LINE))
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
        log.warning("alert %s %s: %s", alert.labels.get("alertname"), alert.status,
                    alert.annotations.get("summary", dict(alert.labels)))
        for group in self._groups_of(receivers, alert, now):
            if alert.status == "firing":
                group.alerts[alert.fingerprint] = alert
                self._send(group, [alert], now)
            else:
                group.alerts.pop(alert.fingerprint, None)
                if group.receiver.send_resolved:
                    self._send(group, [alert], now)
                if not group.alerts:
                    del self._groups[(group.receiver.name, group.key)]

    def _repeat(self) -> None:
        now = self._clock()
        for group in list(self._groups.values()):
            every = (group.receiver.resend_interval_seconds if group.receiver.type == "alertmanager_api"
                     else group.receiver.repeat_interval_seconds)
            if group.alerts and now - group.last_sent >= every:
                self._send(group, list(group.alerts.values()), now)

    def _send(self, group: _Group, alerts: list[Alert], now: float) -> None:
        firing = any(alert.status == "firing" for alert in alerts)
        status: Literal["firing", "resolved"] = "firing" if firing else "resolved"
        notification = Notification(receiver=group.receiver.name, group_key=group.key, group_labels=group.labels,
                                    alerts=tuple(alerts), status=status, external_url=self.external_url)
        group.last_sent = now
        self._submit(group.receiver, notification)

    def _submit(self, receiver: Receiver, notification: Notification) -> None:
        self.outbox.submit(receiver, notification)  # held in memory there when its file cannot take it
