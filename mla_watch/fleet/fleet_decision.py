"""The pure parts of a fleet's decision for a model-caused alert: the alert waiting for it (:class:`WaitingAlert`),
what the peers' reference readings say of a router (:func:`peer_readings`), which waiting alert a canary job short
of data gives way to (:func:`gives_way_to`), and the notes each outcome writes (the page's ``retune`` annotation).
:class:`mla_watch.fleet.member.FleetMember` makes the decision."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mla_watch.fleet.fleet_rows import FleetView, VersionRow
from mla_watch.fleet.settings import FleetSettings

__all__ = [
    "WaitingAlert",
    "busy_note",
    "canary_note",
    "gives_way_reason",
    "gives_way_to",
    "peer_readings",
    "reapplied_note",
    "restored_note",
    "store_down_note",
    "waiting_note",
]


@dataclass
class WaitingAlert:
    """A model-caused alert waiting for the fleet's decision, and the note its page carries meanwhile."""

    router: str
    business_line: str | None
    action: Any  # the alert engine's retune Action
    note: str = ""

    @property
    def key(self) -> tuple[str, str | None]:  # one waiting alert per router and line: each line may ask
        return self.router, self.business_line


def peer_readings(
    view: FleetView, router: str, *, name: str, base: str, digest: str, settings: FleetSettings
) -> tuple[list[str], list[str]]:
    """Members other than ``name`` serving the routers ``digest`` of ``base``, seen lately, whose recent readings of
    ``router`` say healthy or damaged."""
    healthy, damaged = [], []
    for member in view.members:
        if member["name"] == name or member["base"] != base or member["digest"] != digest:
            continue
        if view.now - float(member["last_seen"]) > settings.member_seconds:
            continue
        reading = (member.get("health") or {}).get(router) or {}
        at = reading.get("at")
        if not isinstance(at, int | float) or view.now - at > settings.evidence_seconds:
            continue
        if reading.get("state") == "healthy":
            healthy.append(member["name"])
        elif reading.get("state") == "damaged":
            damaged.append(member["name"])
    return healthy, damaged


def gives_way_to(
    waiting: Iterable[WaitingAlert],
    routers: Sequence[str],
    line: str | None,
    distinct_texts: Callable[[str | None], int],
) -> tuple[WaitingAlert, int] | None:
    """The waiting alert on one of ``routers`` of another line than ``line`` whose captured traffic holds the most
    distinct texts (``distinct_texts`` of a line), with their count, where it holds more than ``line``'s; else
    ``None``."""
    others = [want for want in waiting if want.router in routers and want.business_line != line]
    if not others:
        return None
    distinct = {want.key: distinct_texts(want.business_line) for want in others}
    other = max(others, key=lambda want: distinct[want.key])
    if distinct[other.key] <= distinct_texts(line):
        return None
    return other, distinct[other.key]


def gives_way_reason(fleet_job: str, line: str | None, needs: str, other: WaitingAlert, distinct: int) -> str:
    """Why fleet job ``fleet_job``, waiting for data of ``line`` (``needs``), gave way to ``other``."""
    return (
        f"fleet job {fleet_job} waited for data of business line {line or 'all'} ({needs}); an alert "
        f"of business line {other.business_line or 'all'}, whose traffic holds {distinct} "
        f"distinct texts, asks for the same repair of {other.router}"
    )


def busy_note(router: str) -> str:
    return (
        f"the fleet decides at its next round (this replica is taking a rollout step): {router} is "
        "re-tuned once for the whole fleet"
    )


def store_down_note(error: object) -> str:
    return (
        f"no re-tune job yet: the fleet store cannot be reached ({error}); re-tuning waits for it "
        "(no replica repairs alone) and is asked again when it answers"
    )


def restored_note(target: VersionRow) -> str:
    return (
        f"no re-tune job: this replica's routers differed from the fleet's version {target.number}, which "
        f"was restored here (digest {target.digest[:12]})"
    )


def reapplied_note(target: VersionRow, healthy: Sequence[str]) -> str:
    return (
        f"no re-tune job: the fleet's version {target.number} was applied again on this replica alone "
        f"({', '.join(healthy[:3])} serving it read healthy on their reference prompts)"
    )


def canary_note(job: str, status: object) -> str:
    return (
        f"fleet re-tune job {job} runs on this replica, the fleet's canary ({status}); "
        "the other replicas take its version once it passes here"
    )


def waiting_note(decision: Mapping[str, Any]) -> str:
    """What the fleet store's decision other than ``"lease"`` means for this replica."""
    job = decision.get("job") or {}
    if decision["decision"] == "cooldown":
        until = time.strftime("%H:%M:%S UTC", time.gmtime(decision["until"]))
        return (
            f"no new re-tune job: fleet job {job.get('id')} for {', '.join(job.get('routers', []))} ended "
            f"{job.get('state')} on {job.get('canary')}; the fleet's cooldown lasts until {until}"
        )
    if job and job.get("state") == "rolling":
        return (
            f"no re-tune job here: fleet job {job.get('id')} (canary {job.get('canary')}) is rolling out "
            f"version {job.get('version')}; this replica takes it in turn"
        )
    if job:
        return (
            f"no re-tune job here: fleet job {job.get('id')} on {decision.get('holder')} re-tunes "
            f"{', '.join(job.get('routers', []))}; this replica takes its version in the rollout"
        )
    return "no re-tune job here: a rollout is under way; this replica takes its version in turn"
