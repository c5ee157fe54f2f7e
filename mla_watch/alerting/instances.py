"""One alert instance's state: what the engine keeps per rule x series, and what it hands out.

:class:`InstanceState` is the mutable state of one instance (its state, its timers, the record
and levels it was judged by, and its JSON form in the state file); :class:`AlertInstance` is its
public view (``GET /v1/alerts``); :class:`Action` is what a transition asks the engine's owner to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mla_watch.alerting.causes import CAUSE_LABEL, Cause
from mla_watch.alerting.vocabulary import Alert, AlertState, Rule, fingerprint
from mla_watch.common.values import is_number
from mla_watch.routing.windows import RouterStats

__all__ = ["Action", "AlertInstance", "InstanceState", "RecordKey"]

RecordKey = tuple[Any, Any, Any, Any]  # (router name, layer, kind, business_line: None for every line summed)


@dataclass(frozen=True)
class Action:
    """Something the engine asks its owner to do: notify receivers, or schedule a router re-tune."""

    kind: Literal["notify", "retune"]
    alert: Alert
    rule: Rule
    record: RouterStats | None  # the router statistics that triggered it (None when there were none)


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
    cause: dict[str, Any] | None = None  # Cause.to_json(), once it fired

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "metric": self.metric,
            "labels": dict(self.labels),
            "state": self.state,
            "value": self.value,
            "active_since": self.active_since,
            "firing_since": self.firing_since,
            "resolved_at": self.resolved_at,
            "last_evaluated": self.last_evaluated,
            "annotations": dict(self.annotations),
            "fingerprint": self.fingerprint,
            "cause": self.cause,
        }


class InstanceState:
    """The mutable state of one alert instance: its state, timers, latest judgement and its JSON form."""

    __slots__ = (
        "active_since",
        "annotations",
        "cause",
        "firing_since",
        "hash_routed",
        "healthy_since",
        "json",
        "key",
        "labels",
        "last_evaluated",
        "levels",
        "notified",
        "num_slots",
        "public_labels",
        "record",
        "resolved_at",
        "rule_id",
        "state",
        "trend",
        "value",
    )

    def __init__(self, rule_id: str, key: RecordKey, labels: dict[str, str]) -> None:
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
        self.record: RouterStats | None = None  # the statistics it was judged on, latest
        self.trend: Mapping[str, object] | None = None  # a trend rule's template fields of that judgement
        self.levels: tuple[Any, Any, Any, Any] | None = None  # the levels it was judged by, latest
        self.annotations: dict[str, str] = {}  # as rendered at the latest transition
        self.json: str | None = None  # serialized at the latest save; None once a state or timer changed
        self.num_slots: int | None = None  # the router's geometry, which `slots` selectors judge
        self.hash_routed = False
        self.cause: Cause | None = None  # decided when it fires (mla_watch.alerting.causes)
        self.public_labels: dict[str, str] = labels  # what its alerts carry: labels, and its cause once decided

    def set_cause(self, cause: Cause | None, rule: Rule) -> None:
        """Decide (or forget, for ``None``) the cause; an alert caused by the traffic takes the rule's traffic
        severity."""
        self.cause = cause
        if cause is None:
            self.public_labels = self.labels
            return
        self.public_labels = {**self.labels, CAUSE_LABEL: cause.name}
        if cause.name == "traffic":
            self.public_labels["severity"] = rule.traffic_severity

    def to_json(self) -> dict[str, Any]:
        name, layer, kind, line = self.key
        return {
            "rule": self.rule_id,
            "router": name,
            "layer": layer,
            "kind": kind,
            "business_line": line,
            "labels": self.labels,
            "state": self.state,
            "active_since": self.active_since,
            "firing_since": self.firing_since,
            "resolved_at": self.resolved_at,
            "last_evaluated": self.last_evaluated,
            "healthy_since": self.healthy_since,
            "value": self.value,
            "notified": self.notified,
            "annotations": self.annotations,
            "num_slots": self.num_slots,
            "hash_routed": self.hash_routed,
            "cause": None if self.cause is None else self.cause.to_json(),
            "public_labels": None if self.cause is None else self.public_labels,
        }

    @classmethod
    def from_json(cls, data: Any) -> InstanceState:
        if not isinstance(data, dict):
            raise ValueError(f"instance: expected an object, got {data!r}")
        rule_id, labels, state = data.get("rule"), data.get("labels"), data.get("state")
        if (
            not isinstance(rule_id, str)
            or not isinstance(labels, dict)
            or state not in ("pending", "firing", "resolved")
        ):
            raise ValueError(f"instance: bad rule/labels/state in {data!r}")
        layer = data.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ValueError(f"instance: layer {layer!r} is not an integer")
        key = (data.get("router"), layer, data.get("kind"), data.get("business_line"))
        inst = cls(rule_id, key, {str(k): str(v) for k, v in labels.items()})
        inst.state = state
        for name in ("active_since", "firing_since", "resolved_at", "last_evaluated", "healthy_since", "value"):
            value = data.get(name)
            if value is not None and not is_number(value):
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
        if data.get("cause") is not None:
            inst.cause = Cause.from_json(data["cause"])
            public = data.get("public_labels")
            if not isinstance(public, dict):
                raise ValueError("instance: a cause without public_labels")
            inst.public_labels = {str(k): str(v) for k, v in public.items()}
        if state == "firing" and inst.firing_since is None:
            raise ValueError("instance: firing without firing_since")
        if state == "pending" and inst.active_since is None:
            raise ValueError("instance: pending without active_since")
        return inst
