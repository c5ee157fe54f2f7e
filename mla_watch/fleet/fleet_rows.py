"""What the fleet store reads back from PostgreSQL, as values: the re-tuning :class:`Lease`, a shared router version
(:class:`VersionRow`), a :class:`Rollout` and its steps, and the members' :class:`FleetView`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FleetView",
    "Lease",
    "Rollout",
    "Step",
    "VersionRow",
]


@dataclass(frozen=True)
class Lease:
    holder: str | None
    job: str | None
    taken_at: float | None
    expires_at: float | None
    now: float  # the database's clock when read

    @property
    def held(self) -> bool:
        return self.holder is not None and self.expires_at is not None and self.expires_at > self.now

    @property
    def expired(self) -> bool:
        return self.holder is not None and not self.held

    def as_dict(self) -> dict[str, Any]:
        return {
            "holder": self.holder if self.held else None,
            "job": self.job if self.held else None,
            "taken_at": self.taken_at if self.held else None,
            "expires_at": self.expires_at if self.held else None,
            "expired_holder": self.holder if self.expired else None,
        }


@dataclass(frozen=True)
class VersionRow:
    number: int
    digest: str
    parent: int | None
    job: str | None
    created_by: str | None
    created_at: float
    bytes: int
    bad: bool
    manifest: Mapping[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.number,
            "digest": self.digest,
            "parent": self.parent,
            "job": self.job,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "bytes": self.bytes,
            "bad": self.bad,
            "strategy": self.manifest.get("strategy"),
            "routers": self.manifest.get("routers", []),
            "business_line": self.manifest.get("business_line"),
        }


@dataclass(frozen=True)
class Step:
    member: str
    outcome: str  # taking, passed, failed, lost
    started_at: float
    ended_at: float | None
    detail: Mapping[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "member": self.member,
            "outcome": self.outcome,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "detail": dict(self.detail),
        }


@dataclass(frozen=True)
class Rollout:
    id: int
    version: int
    digest: str
    previous: int
    job: str | None
    state: str  # rolling, done, halted, aborted
    batch: int
    started_at: float
    updated_at: float
    ended_at: float | None
    halted_by: str | None
    reason: str | None
    steps: tuple[Step, ...] = ()

    def step(self, member: str) -> Step | None:
        return next((step for step in self.steps if step.member == member), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "version": self.version,
            "digest": self.digest,
            "previous": self.previous,
            "job": self.job,
            "state": self.state,
            "batch": self.batch,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "ended_at": self.ended_at,
            "halted_by": self.halted_by,
            "reason": self.reason,
            "steps": [step.as_dict() for step in self.steps],
        }


@dataclass(frozen=True)
class FleetView:
    """One read of the fleet as one member sees it (its base)."""

    now: float
    base: str
    current: VersionRow
    lease: Lease
    lease_job: Mapping[str, Any] | None  # the job the lease names, as stored
    rollout: Rollout | None  # the latest rollout of this base
    members: tuple[Mapping[str, Any], ...] = ()
    versions: Mapping[str, int] = field(default_factory=dict)  # digest -> number, every version of this base
    bad: frozenset[int] = frozenset()  # versions an aborted rollout marked bad

    def version_of(self, digest: str) -> int | None:
        return self.versions.get(digest)
