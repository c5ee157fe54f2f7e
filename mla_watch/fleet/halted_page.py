"""The page a fleet member sends when a rollout halts on it: ``FleetRolloutHalted``, its labels and annotations."""

from __future__ import annotations

from mla_watch.fleet.fleet_rows import VersionRow
from mla_watch.routing.series import BUSINESS_LINE, LAYER, ROUTER

__all__ = ["FLEET_HALTED_ALERT", "RUNBOOK", "halted_page"]

FLEET_HALTED_ALERT = "FleetRolloutHalted"
RUNBOOK = "https://github.com/mla-watch/mla_watch/blob/main/docs/runbooks.md#fleetrollouthalted"


def halted_page(
    rollout: int, version: VersionRow, replica: str, current: int | str, reason: str
) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of the page for rollout ``rollout`` of ``version``, halted because ``replica``
    failed its check (``reason``); ``current``: the version the replicas not reached keep."""
    routers = [str(router) for router in version.manifest.get("routers", [])]
    trigger = version.manifest.get("trigger") or {}
    labels = {
        "alertname": FLEET_HALTED_ALERT,
        "severity": "critical",
        "replica": replica,
        ROUTER: ",".join(routers),
        LAYER: str(trigger.get("layer") or ""),
        BUSINESS_LINE: str(version.manifest.get("business_line") or "all"),
        "version": str(version.number),
    }
    annotations = {
        "summary": f"Rollout {rollout} of router version {version.number} halted: replica {replica} failed its "
        f"check and rolled back; the replicas not reached keep version {current}",
        "description": f"{reason}. The canary {version.manifest.get('canary')} and the replicas that passed "
        f"serve version {version.number}. Look at {replica} (`mla-watch fleet show`, its "
        f"/v1/reference), then resume the rollout from a member (`mla-watch fleet rollout "
        f"{version.number} --url MEMBER`) or abort it (`mla-watch fleet abort`: every replica goes "
        "back to the fleet's current version).",
        "runbook_url": RUNBOOK,
    }
    return labels, annotations
