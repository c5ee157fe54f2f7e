"""Notification groups as Alertmanager keeps them: one per receiver and group key, flushed on its own timer.

An alert joins the group of each of its receivers whose labels (the receiver's ``group_by``) it shares. A new
group waits ``group_wait`` before its first flush, collecting the alerts of the incident that fire meanwhile;
after a flush the group waits ``group_interval`` before the next. A flush notifies only when the group changed
since its last notification (an alert fires that it did not hold, or one resolved while ``send_resolved``, or
every alert resolved), else once ``repeat_interval`` has passed: Alertmanager's notification log, decided by
:func:`needs_update`. Each notification holds every alert of the group, the resolved ones once. A group whose
alerts have all resolved and been flushed is forgotten.

Alertmanager's API (``type: alertmanager_api``) takes alerts, not notifications: Alertmanager groups them
itself, so those groups flush at every evaluation, send resolutions always and re-post every
``resend_interval``.

The notification log (what each group last notified, and when its next flush is due) is written to the state
directory after every flush that changed it, so a restart neither pages again for what was notified nor loses a
page that was still waiting (:class:`NotificationLog`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from mla_watch.alerting.vocabulary import Alert, Notification, Receiver
from mla_watch.common.output_file import write_file
from mla_watch.common.state_dir import set_aside
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.values import is_number

__all__ = ["LOG_FILE", "LOG_FORMAT", "GroupRecord", "NotificationGroup", "NotificationLog", "needs_update", "timing"]

log = logging.getLogger("mla_watch.alerting")

LOG_FILE = "notification_log.json"
LOG_FORMAT = "mla_watch.notification_log/1"
WHAT = "notification log"
_API_TYPE = "alertmanager_api"


def timing(receiver: Receiver) -> tuple[float, float, float, bool]:
    """``(group_wait, group_interval, repeat, send_resolved)`` of ``receiver``'s groups, in seconds."""
    if receiver.type == _API_TYPE:  # Alertmanager groups; resolving an alert there is state, always posted
        return 0.0, 0.0, receiver.resend_interval_seconds, True
    return (
        receiver.group_wait_seconds,
        receiver.group_interval_seconds,
        receiver.repeat_interval_seconds,
        receiver.send_resolved,
    )


def needs_update(
    firing: frozenset[str],
    resolved: frozenset[str],
    record: GroupRecord | None,
    now: float,
    repeat: float,
    send_resolved: bool,
) -> bool:
    """Whether a flush of a group whose alerts are ``firing`` and ``resolved`` (fingerprints) notifies, given what
    it last notified (``record``; ``None``: never). Alertmanager's dedup stage."""
    if record is None or record.notified_at is None:
        return bool(firing)  # a first notification; alerts that fired and resolved unseen are nobody's news
    if not firing <= record.firing:
        return True  # alerts the receiver has not heard of
    if not firing:
        return bool(record.firing)  # every alert resolved: the receiver last heard some firing
    if send_resolved and not resolved <= record.resolved:
        return True
    return now - record.notified_at >= repeat


@dataclass
class GroupRecord:
    """What a group last notified (its firing and resolved fingerprints, when) and when it flushes next."""

    firing: frozenset[str] = frozenset()
    resolved: frozenset[str] = frozenset()
    notified_at: float | None = None
    flush_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "firing": sorted(self.firing),
            "resolved": sorted(self.resolved),
            "notified_at": self.notified_at,
            "flush_at": self.flush_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupRecord:
        firing, resolved = data.get("firing"), data.get("resolved")
        if not isinstance(firing, list) or not isinstance(resolved, list):
            raise ValueError("firing and resolved must be lists of fingerprints")
        times = {}
        for name in ("notified_at", "flush_at"):
            value = data.get(name)
            if value is not None and not is_number(value):
                raise ValueError(f"{name} = {value!r} is not a number")
            times[name] = None if value is None else float(value)
        return cls(frozenset(map(str, firing)), frozenset(map(str, resolved)), **times)


@dataclass
class NotificationGroup:
    """One receiver's group of alerts: what it holds now, when it flushes, and what it last notified."""

    receiver: Receiver
    key: str
    labels: dict[str, str]
    flush_at: float  # the next flush is due then
    alerts: dict[str, Alert] = field(default_factory=dict)  # fingerprint -> firing, or resolved and not flushed
    flushed: bool = False  # the first flush is behind it: later ones wait group_interval
    record: GroupRecord = field(default_factory=GroupRecord)

    @classmethod
    def new(cls, receiver: Receiver, key: str, labels: dict[str, str], now: float) -> NotificationGroup:
        return cls(receiver, key, labels, flush_at=now + timing(receiver)[0])

    def add(self, alert: Alert, now: float) -> None:
        """Hold ``alert`` (its latest state) until the next flush."""
        self.alerts[alert.fingerprint] = alert
        # Alertmanager's rule for a group that never flushed: an alert that started firing longer than group_wait
        # ago (a restart during the wait) has waited enough.
        if not self.flushed and alert.status == "firing" and alert.starts_at + timing(self.receiver)[0] <= now:
            self.flush_at = min(self.flush_at, now)

    def flush(self, now: float, external_url: str, send: Callable[[Notification], object]) -> bool:
        """``send`` the notification due now, if the group changed or its repeat is due, and forget what resolved;
        whether one was sent. Should ``send`` raise, the group stays as it was, to be flushed again at its next
        flush."""
        _, interval, repeat, send_resolved = timing(self.receiver)
        self.flush_at = now + interval
        firing = frozenset(fp for fp, alert in self.alerts.items() if alert.status == "firing")
        resolved = frozenset(self.alerts) - firing
        sent = bool(self.alerts) and needs_update(firing, resolved, self.record, now, repeat, send_resolved)
        if sent:
            status: Literal["firing", "resolved"] = "firing" if firing else "resolved"
            ordered = sorted(self.alerts.values(), key=lambda alert: sorted(alert.labels.items()))
            send(
                Notification(
                    receiver=self.receiver.name,
                    group_key=self.key,
                    group_labels=self.labels,
                    alerts=tuple(ordered),
                    status=status,
                    external_url=external_url,
                )
            )
            self.record = GroupRecord(firing, resolved, now)
        elif resolved:  # unsent (send_resolved: false): should one fire again, it is news again
            self.record = replace(self.record, firing=self.record.firing - resolved)
        for fingerprint in resolved:  # notified (or news to nobody): a resolution is sent once
            del self.alerts[fingerprint]
        self.flushed = True
        self.record.flush_at = self.flush_at
        return sent


class NotificationLog:
    """The groups' records in ``STATE_DIR/notification_log.json``, by receiver and group key.

    Written whole (a temporary file, then ``os.replace``); a save the disk refuses is made again by the caller's
    next one. A file that cannot be read is set aside as ``NAME.corrupt``.
    """

    def __init__(self, path: Path, writes: StateWrites | None = None) -> None:
        self.path = path
        self.writes = writes

    def load(self) -> dict[tuple[str, str], tuple[dict[str, str], GroupRecord]] | None:
        """``(receiver, key) -> (group labels, record)``; ``None`` without a readable file (then nothing is known
        of what was notified before)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            self._set_aside(f"cannot read it: {error}")
            return None
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.get("format") != LOG_FORMAT:
                raise ValueError(f"key 'format' must be {LOG_FORMAT!r}")
            entries = document.get("groups")
            if not isinstance(entries, list):
                raise ValueError("key 'groups' must be a list")
            groups = {}
            for entry in entries:
                if (
                    not isinstance(entry, dict)
                    or not isinstance(entry.get("receiver"), str)
                    or not isinstance(entry.get("key"), str)
                    or not isinstance(entry.get("labels"), dict)
                ):
                    raise ValueError("each group needs receiver, key and labels")
                labels = {str(k): str(v) for k, v in entry["labels"].items()}
                groups[(entry["receiver"], entry["key"])] = (labels, GroupRecord.from_json(entry))
            return groups
        except (ValueError, TypeError) as error:
            self._set_aside(str(error))
            return None

    def save(self, groups: Iterable[NotificationGroup], now: float) -> bool:
        """Write the record of every group that notified; whether it was written (an error is said once, by
        ``writes``)."""
        entries = [
            {"receiver": group.receiver.name, "key": group.key, "labels": group.labels, **group.record.to_json()}
            for group in groups
            if group.record.notified_at is not None
        ]
        text = json.dumps({"format": LOG_FORMAT, "saved_at": now, "groups": entries}, separators=(",", ":"))
        try:
            write_file(self.path, text, private=True, parents=True, label=f"{WHAT} {self.path}")
        except OSError as error:
            if self.writes is not None:
                self.writes.failed(self.path, error, what=WHAT)
            else:
                log.error("%s", error)
            return False
        if self.writes is not None:
            self.writes.written(self.path, what=WHAT)
        return True

    def _set_aside(self, why: str) -> None:
        try:
            set_aside(self.path)
            log.error(
                "%s %s is corrupt (%s): what was notified before is taken as notified; kept it as %s.corrupt",
                WHAT,
                self.path,
                why,
                self.path.name,
            )
        except OSError as error:
            log.error("%s %s is corrupt (%s); could not set it aside: %s", WHAT, self.path, why, error)
