"""``GET /v1/fleet``'s answer: the members, the current or last rollout, the lease, the versions and the jobs of a
fleet member's base, read from the store at most once a second whoever asks how often."""

from __future__ import annotations

import threading
import time
from typing import Any

from mla_watch.fleet.fleet_store import FleetStore
from mla_watch.fleet.settings import FleetSettings

__all__ = ["DESCRIBE_SECONDS", "FleetDescription"]

DESCRIBE_SECONDS = 1.0  # GET /v1/fleet answers from what it read within this long


class FleetDescription:
    """The fleet as member ``name`` of ``base`` describes it (``settings``: when a member counts as alive)."""

    def __init__(self, store: FleetStore, base: str, name: str, settings: FleetSettings) -> None:
        self.store = store
        self.base = base
        self.name = name
        self.settings = settings
        self._lock = threading.Lock()
        self._described: tuple[float, dict[str, Any]] | None = None  # (when, what) GET /v1/fleet answered last

    def describe(self) -> dict[str, Any]:
        """The answer: read from the store at most once every :data:`DESCRIBE_SECONDS`, whoever asks how often (an
        open endpoint must not become the store's load)."""
        with self._lock:
            now = time.monotonic()
            if self._described is not None and now - self._described[0] < DESCRIBE_SECONDS:
                return self._described[1]
            described = self._describe()
            self._described = (time.monotonic(), described)
            return described

    def _describe(self) -> dict[str, Any]:
        view = self.store.view(self.base)
        members = []
        for member in view.members:
            members.append(
                {
                    "name": member["name"],
                    "version": member["version"],
                    "digest": member["digest"],
                    "base": member["base"],
                    "url": member["url"],
                    "last_seen": member["last_seen"],
                    "started_at": member["started_at"],
                    "alive": view.now - float(member["last_seen"]) <= self.settings.member_seconds,
                    "health": member.get("health") or {},
                }
            )
        return {
            "name": self.name,
            "store": self.store.where,
            "now": view.now,
            "base": self.base,
            "current": view.current.as_dict(),
            "members": members,
            "rollout": None if view.rollout is None else view.rollout.as_dict(),
            "lease": {**view.lease.as_dict(), "job_record": view.lease_job},
            "versions": [row.as_dict() for row in self.store.versions(self.base, limit=20)],
            "jobs": self.store.jobs(limit=20),
        }
