"""One notification per incident: the sidecar's notifier groups as Alertmanager does (``group_by``, ``group_wait``,
``group_interval``), the shipped receivers put a line's traffic-caused alerts in one group and keep on-call's pages
one per rule, router and line, and a restart neither pages again nor loses a page that was still waiting.

Every test runs an :class:`~mla_watch.alerting.alert_service.AlertService` on a :class:`FakeClock`, evaluated every 15 s
as ``serve`` evaluates, its outbox delivered to a real webhook receiver on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.helpers import FakeClock, engine_record, write_rules
from harness.receivers import TestReceiver, running_receiver
from mla_watch.alerting.alert_service import AlertService
from mla_watch.alerting.causes import Cause
from mla_watch.alerting.groups import NotificationGroup
from mla_watch.alerting.rules import load_rules_dir, load_rules_file
from mla_watch.alerting.vocabulary import (
    DEFAULT_GROUP_INTERVAL_SECONDS,
    DEFAULT_GROUP_WAIT_SECONDS,
    Alert,
    Notification,
    Receiver,
    RuleError,
)
from mla_watch.routing.windows import RouterStats
from mla_watch.shipped import SHIPPED_RULES

LINE = "code_assistant"
GATES = tuple(f"model.layers.{layer}.mlp.gate" for layer in (1, 2, 3))
ROUND = 15.0  # serve's evaluation interval


class Judge:
    """The reference readings' verdict, as the test sets it per router (``cause``: the default)."""

    wait_seconds = 120.0

    def __init__(self, cause: str, **by_router: str) -> None:
        self.cause, self.by_router = cause, by_router

    def request(self, business_line: str | None, since: float) -> None:
        pass

    def latest(self, business_line: str | None) -> float | None:
        return None

    def judge(self, rule: Any, record: RouterStats, since: float) -> Cause:
        return Cause(self.by_router.get(record.router.name, self.cause), "set by the test", since)  # type: ignore[arg-type]


class Watched:
    """An alert service over records the test sets, on a fake clock, delivering to ``receiver``."""

    def __init__(
        self, rules: Any, state: Path, clock: FakeClock, receiver: TestReceiver, judge: Judge | None = None
    ) -> None:
        self.records: list[RouterStats] = []
        self.clock, self.receiver = clock, receiver
        self.service = AlertService(rules, state, records=lambda: self.records, clock=clock, causes=judge)

    def run(self, seconds: float) -> None:
        """Evaluate every 15 s for ``seconds``, delivering what is due after each evaluation."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.advance(ROUND)
            self.service.evaluate_once()
            self.service.dispatcher.run_once()

    def bodies(self, path: str) -> list[dict]:
        return [request.json() for request in self.receiver.requests if request.path == path]

    def restart(self, state: Path, rules: Any, judge: Judge | None = None) -> Watched:
        self.service.stop()
        return Watched(rules, state, self.clock, self.receiver, judge)


def shipped(receiver: TestReceiver) -> Any:
    return load_rules_dir(
        SHIPPED_RULES,
        environ={
            "MLA_WATCH_ONCALL_URL": receiver.url + "/oncall",
            "MLA_WATCH_LINE_OWNERS_URL": receiver.url + "/owners",
        },
    )


def gate_record(gate: str, **values: Any) -> RouterStats:
    """``gate``'s window on the line (a 64-expert router, healthy MaxVio 0.5 and no dead expert), reading ``values``
    (healthy ones otherwise)."""
    return engine_record(
        values.pop("max_violation", 0.4),
        metric="max_violation",
        name=gate,
        layer=int(gate.split(".")[2]),
        line=LINE,
        num_slots=64,
        baseline={"max_violation": 0.5, "dead_slots": 0.0},
        **{"dead_slots": 0, "long_context_drift": 0.001, **values},
    )


# What each router of the line reads (every rule `for: 5m`): one client's flood inside the trained length, a hotspot
# (MaxVio 3.0 against a healthy 0.5) and 10 experts left without a token; long documents past the trained length,
# sent by the line's clients, routing that departs from in-range routing at 256-511 (0.05 bits).
INCIDENTS = {
    "flood": ({"max_violation": 3.0, "dead_slots": 10}, ("ExpertHotspot", "DeadExperts")),
    "long documents": ({"long_context_drift": 0.05, "long_context_edge": "256-511"}, ("LongContextDrift",)),
}


@contextmanager
def watched(tmp_path: Path, judge: Judge, rules: Any = None) -> Iterator[Watched]:
    with running_receiver() as receiver:
        service = Watched(rules or shipped(receiver), tmp_path / "state", FakeClock(), receiver, judge)
        try:
            yield service
        finally:
            service.service.stop()


@pytest.mark.parametrize("incident", INCIDENTS)
def test_a_traffic_incident_reaches_the_line_owners_as_one_notification_with_every_alert_and_on_call_none(
    tmp_path, incident: str
) -> None:
    values, rules = INCIDENTS[incident]
    with watched(tmp_path, Judge("traffic")) as sidecar:
        sidecar.records = [gate_record(gate, **values) for gate in GATES]
        sidecar.run(ROUND)  # pending
        sidecar.run(300.0)  # `for: 5m`: they fire together, into one group of the line owners
        fired = [a for a in sidecar.service.engine.alerts() if a.state == "firing"]
        assert len(fired) == 3 * len(rules) and {a.labels["cause"] for a in fired} == {"traffic"}
        assert sidecar.receiver.requests == []  # the group waits group_wait (1 m) for the rest of the incident
        sidecar.run(45.0)
        assert sidecar.receiver.requests == []
        sidecar.run(15.0)
        (told,) = sidecar.bodies("/owners")
        assert told["groupLabels"] == {"business_line": LINE, "cause": "traffic"} and told["status"] == "firing"
        assert {a["fingerprint"] for a in told["alerts"]} == {a.fingerprint for a in fired}
        assert {(a["labels"]["alertname"], a["labels"]["router"]) for a in told["alerts"]} == {
            (name, gate) for name in rules for gate in GATES
        }
        assert told["commonLabels"]["severity"] == "warning"
        # The status page's incident: every alert in the group that notified, under its key.
        incidents = {
            (view["incident"]["receiver"], view["incident"]["key"], view["incident"]["notified_at"])
            for view in sidecar.service.alert_views()
        }
        assert incidents == {("line_owners", told["groupKey"], sidecar.clock.now)}
        sidecar.run(1800.0)  # nothing changes: no update, and the repeat is 4 h away
        assert sidecar.bodies("/oncall") == [] and len(sidecar.receiver.requests) == 1
        # It ends: one resolved notification for the incident, group_interval (10 m) after the last one.
        sidecar.records = [gate_record(gate) for gate in GATES]
        sidecar.run(600.0)
        (_, resolved) = sidecar.bodies("/owners")
        assert resolved["status"] == "resolved" and len(resolved["alerts"]) == len(fired)
        assert resolved["groupKey"] == told["groupKey"] and sidecar.bodies("/oncall") == []


def test_model_caused_pages_stay_one_per_router_and_line(tmp_path) -> None:
    with watched(tmp_path, Judge("model")) as sidecar:
        sidecar.records = [
            engine_record(4.0, name=gate, layer=int(gate.split(".")[2]), line=LINE, num_slots=64) for gate in GATES[:2]
        ]
        sidecar.run(ROUND + 120.0)  # RoutingEntropyLow, pending then firing (`for: 2m`) on two routers
        assert sidecar.receiver.requests == []
        sidecar.run(30.0)  # on-call's group_wait
        pages = sidecar.bodies("/oncall")
        assert sorted(page["groupLabels"]["router"] for page in pages) == list(GATES[:2])
        assert all(len(page["alerts"]) == 1 and page["alerts"][0]["labels"]["cause"] == "model" for page in pages)
        assert sidecar.bodies("/owners") == []
        keys = {view["incident"]["key"] for view in sidecar.service.alert_views()}
        assert keys == {page["groupKey"] for page in pages}


GROUPED = """\
receivers:
  - name: team
    type: alertmanager_webhook
    url: {url}/team
    group_by: [business_line]
    group_wait: 30s
    group_interval: 5m
rules:
  - alert: Low
    metric: entropy_bits
    select: {{kind: expert, business_line: "*"}}
    below: 5.0
    resolve_above: 5.2
    min_tokens: 64
    receivers: [team]
"""


def low(gates: tuple[str, ...], bits: float = 4.0) -> list[RouterStats]:
    return [engine_record(bits, name=gate, layer=int(gate.split(".")[2]), line=LINE) for gate in gates]


def test_group_wait_collects_group_interval_throttles_and_a_resolution_is_one_notification(tmp_path) -> None:
    with running_receiver() as receiver:
        rules = load_rules_dir(write_rules(tmp_path / "rules", GROUPED.format(url=receiver.url)))
        sidecar = Watched(rules, tmp_path / "state", FakeClock(), receiver)
        sidecar.records = low(GATES[:1])
        sidecar.run(ROUND)  # A fires
        sidecar.records = low(GATES[:2])
        sidecar.run(ROUND)  # B fires, 15 s later: within the group's wait
        assert receiver.requests == []
        sidecar.run(ROUND)  # 30 s after A: one notification with both
        (first,) = sidecar.bodies("/team")
        assert [a["labels"]["router"] for a in first["alerts"]] == list(GATES[:2])
        sidecar.records = low(GATES)
        sidecar.run(ROUND)  # C fires: the group's next flush is 5 m after its first
        sidecar.run(270.0)
        assert len(receiver.requests) == 1
        sidecar.run(ROUND)
        (_, update) = sidecar.bodies("/team")
        assert [a["labels"]["router"] for a in update["alerts"]] == list(GATES) and update["status"] == "firing"
        sidecar.records = [*low(GATES[:1], 5.5), *low(GATES[1:])]
        sidecar.run(ROUND)  # A resolves: a resolved-only change waits group_interval too
        sidecar.run(270.0)
        assert len(receiver.requests) == 2
        sidecar.run(ROUND)
        third = receiver.requests[2]
        changed = third.json()
        assert changed["status"] == "firing"
        assert {a["labels"]["router"]: a["status"] for a in changed["alerts"]} == {
            GATES[0]: "resolved",
            GATES[1]: "firing",
            GATES[2]: "firing",
        }
        assert third.header("Idempotency-Key") != receiver.requests[1].header("Idempotency-Key")
        sidecar.records = low(GATES, 5.5)
        sidecar.run(300.0)  # B and C resolve: one resolved notification for the incident
        (*_, last) = sidecar.bodies("/team")
        assert last["status"] == "resolved" and [a["labels"]["router"] for a in last["alerts"]] == list(GATES[1:])
        sidecar.records = low(GATES[:1])
        sidecar.run(ROUND)  # a new incident after the last resolved: a new group, which waits group_wait again
        assert len(receiver.requests) == 4
        sidecar.run(2 * ROUND)
        assert len(receiver.requests) == 5 and sidecar.bodies("/team")[-1]["alerts"][0]["status"] == "firing"
        sidecar.service.stop()


def test_a_restart_pages_neither_again_nor_never(tmp_path) -> None:
    state = tmp_path / "state"
    with running_receiver() as receiver:
        rules = load_rules_dir(write_rules(tmp_path / "rules", GROUPED.format(url=receiver.url)))
        sidecar = Watched(rules, state, FakeClock(), receiver)
        sidecar.records = low(GATES[:1])
        sidecar.run(3 * ROUND)  # A fires, and is notified group_wait (30 s) later
        assert len(receiver.requests) == 1
        sidecar.records = low(GATES[:2])
        sidecar.run(ROUND)  # B fires; the group's update waits group_interval
        sidecar = sidecar.restart(state, rules)
        sidecar.records = low(GATES[:2])
        sidecar.run(240.0)
        assert len(receiver.requests) == 1  # A is not paged again at the restart ...
        sidecar.run(60.0)  # ... and B, which the receiver never heard of, is notified at the group's next flush
        (_, update) = sidecar.bodies("/team")
        assert [a["labels"]["router"] for a in update["alerts"]] == list(GATES[:2])
        sidecar.records = [*low(GATES[:1], 5.5), *low(GATES[1:2])]
        sidecar.run(ROUND)  # A resolves; its resolution waits for the group's next flush when the sidecar restarts
        sidecar = sidecar.restart(state, rules)
        sidecar.run(300.0)
        resolved = sidecar.bodies("/team")[-1]
        assert len(receiver.requests) == 3 and {a["labels"]["router"]: a["status"] for a in resolved["alerts"]} == {
            GATES[0]: "resolved",
            GATES[1]: "firing",
        }
        # An incident of another line whose group is still waiting its group_wait when the sidecar restarts ...
        sidecar.records = [*low(GATES[1:2]), engine_record(4.0, name=GATES[2], layer=3, line="sql")]
        sidecar.run(ROUND)
        sidecar = sidecar.restart(state, rules)  # ... is paged all the same
        sidecar.records = [*low(GATES[1:2]), engine_record(4.0, name=GATES[2], layer=3, line="sql")]
        sidecar.run(2 * ROUND)
        (page,) = [body for body in sidecar.bodies("/team") if body["groupLabels"] == {"business_line": "sql"}]
        assert [a["labels"]["router"] for a in page["alerts"]] == [GATES[2]]
        sidecar.service.stop()


def test_without_send_resolved_a_resolution_is_not_sent_and_an_alert_firing_again_is_news() -> None:
    receiver = Receiver(
        name="team",
        type="alertmanager_webhook",
        url="http://127.0.0.1:9/hook",
        send_resolved=False,
        group_wait_seconds=0.0,
        group_interval_seconds=60.0,
    )
    group = NotificationGroup.new(receiver, "{}:{}", {}, 0.0)
    sent: list[Notification] = []

    def alert(router: str, status: str = "firing") -> Alert:
        return Alert({"alertname": "Low", "router": router}, {}, status, 0.0, None if status == "firing" else 1.0, 4.0)

    group.add(alert("a"), 0.0)
    group.add(alert("b"), 0.0)
    assert group.flush(0.0, "", sent.append) and [len(n.alerts) for n in sent] == [2]
    group.add(alert("a", "resolved"), 30.0)
    assert not group.flush(60.0, "", sent.append) and list(group.alerts) == [alert("b").fingerprint]
    group.add(alert("a"), 90.0)  # a fires again: the receiver, never told it resolved, hears it fire again
    assert group.flush(120.0, "", sent.append) and [a.labels["router"] for a in sent[-1].alerts] == ["a", "b"]

    def refused(notification: Notification) -> None:
        raise OSError("no room")

    group.add(alert("c"), 130.0)
    with pytest.raises(OSError):
        group.flush(180.0, "", refused)
    assert group.flush(240.0, "", sent.append) and len(sent[-1].alerts) == 3  # kept, and sent at the next flush


def test_receivers_say_their_group_timing_and_refuse_what_cannot_be_one(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "receivers:\n"
        "  - {name: a, type: alertmanager_webhook, url: 'https://h.example'}\n"
        "  - {name: b, type: slack, url: 'https://h.example', group_wait: 5s, group_interval: 1m,"
        " group_by: [business_line, cause]}\n"
    )
    _, receivers, _ = load_rules_file(path, environ={})
    assert (
        (receivers["a"].group_wait_seconds, receivers["a"].group_interval_seconds)
        == (DEFAULT_GROUP_WAIT_SECONDS, DEFAULT_GROUP_INTERVAL_SECONDS)
        == (30.0, 300.0)
    )
    assert (receivers["b"].group_wait_seconds, receivers["b"].group_interval_seconds) == (5.0, 60.0)
    assert receivers["b"].group_of({"business_line": "sql", "cause": "traffic", "router": "g"}) == {
        "business_line": "sql",
        "cause": "traffic",
    }
    path.write_text(
        "receivers:\n"
        "  - {name: a, type: alertmanager_webhook, url: 'https://h.example', group_wait: -5s}\n"
        "  - {name: b, type: alertmanager_webhook, url: 'https://h.example', group_interval: soon}\n"
        "  - {name: c, type: alertmanager_api, url: 'https://am.example', group_wait: 30s}\n"
    )
    with pytest.raises(RuleError) as info:
        load_rules_file(path, environ={})
    a, b, c = info.value.errors
    assert f"{path}: receivers[0].group_wait = '-5s': expected a non-negative duration" in a
    assert f"{path}: receivers[1].group_interval = 'soon': expected a duration such as 30s" in b
    assert c == (
        f"{path}: receivers[2].group_wait = '30s': expected no group_wait for type alertmanager_api: "
        "Alertmanager groups the alerts posted to it (set group_wait in its route) (line 4)"
    )
