"""A fleet re-tuning job running on this replica, the fleet's canary: what it began from (:class:`CanaryJob`), how a
job that promoted nothing ends in the store (:func:`ended_without_version`), and the version a job that promoted
is written as, with its rollout (:func:`publish_canary`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.fleet.fleet_store import FleetStore
from mla_watch.fleet.served_routers import ServedRouters
from mla_watch.fleet.settings import FleetSettings

__all__ = ["CanaryJob", "canary_manifest", "ended_without_version", "publish_canary"]


@dataclass
class CanaryJob:
    fleet_job: str
    local_job: str
    parent: int  # the fleet version this replica served when the job began


def ended_without_version(canary: CanaryJob, record: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Whether the canary's local job (``record``, ended without a version) tried a candidate (then it holds the
    fleet's cooldown), and the detail its fleet job ends with."""
    result = record.get("result") or {}
    tried = bool(result.get("attempts")) and not result.get("cannot_run")
    return tried, {"local_job": canary.local_job, "error": result.get("error"), "strategy": result.get("strategy")}


def canary_manifest(canary: str, fleet_job: str, record: Mapping[str, Any], routers: list[str]) -> dict[str, Any]:
    """The manifest of a version the canary ``canary`` wrote for ``fleet_job`` from its local job's ``record``."""
    result, spec = record["result"], record["spec"]
    return {
        "strategy": result.get("strategy"),
        "routers": routers,
        "business_line": spec.get("business_line"),
        "band": spec.get("band"),
        "watched": spec.get("watched", []),
        "job": fleet_job,
        "canary": canary,
        "local_version": result["version"],
        "trigger": {key: spec.get("trigger", {}).get(key) for key in ("alertname", "router", "layer")},
    }


def publish_canary(
    store: FleetStore,
    routers: ServedRouters,
    settings: FleetSettings,
    canary: CanaryJob,
    record: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
) -> tuple[int, int]:
    """Write what the canary's promoted ``tensors`` change against its parent as a fleet version and start its
    rollout, the canary's step passed: ``(version, rollout)``."""
    result = record["result"]
    changes, digest = routers.changes_from(canary.parent, tensors)
    return store.publish(
        settings.name,
        canary.fleet_job,
        routers.base,
        parent=canary.parent,
        digest=digest,
        changes=changes,
        manifest=canary_manifest(settings.name, canary.fleet_job, record, sorted(changes)),
        batch=settings.rollout_batch,
        lease_seconds=settings.lease_seconds,
        canary_detail={
            "reason": f"the canary: job {canary.local_job} passed its gates here",
            "local_job": canary.local_job,
            "local_version": result["version"],
        },
    )
