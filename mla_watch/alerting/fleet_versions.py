"""The fleet's router versions as Prometheus sees them: an alert when its replicas serve different routers.

Every sidecar exports ``mla_watch_router_version_info{version, digest}`` (value 1), the digest a content hash of
the router tensors it serves. A fleet repairing itself (``serve --fleet``) serves two digests while a rollout runs;
longer than a rollout takes, the fleet is split: a rollout halted, a replica that could not take its version, or
replicas that re-tuned apart. ``RouterVersionSkew`` fires then, once per fleet (the fleet labels, ``job`` by
default), with the count of digests served. Its group is small (one series per replica) and evaluated at
Prometheus' global interval, apart from the per-expert fleet group.
"""

from __future__ import annotations

from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.fleet import SCOPE_LABEL
from mla_watch.alerting.promexport import label_value, promql_string, yaml_entry
from mla_watch.routing.series import JOB, ROUTER_VERSION_DIGEST, ROUTER_VERSION_INFO

__all__ = ["DEFAULT_SKEW_FOR_SECONDS", "VERSION_GROUP_NAME", "VERSION_SKEW_ALERT", "version_group"]

VERSION_GROUP_NAME = "mla_watch_fleet_versions"
VERSION_SKEW_ALERT = "RouterVersionSkew"
# A rollout takes each replica in turn: a swap and a reading of its reference prompts, a minute or so beside an
# engine on a CPU (bench/fleet_repair.py). Half an hour covers a rollout over a few dozen replicas one at a time.
DEFAULT_SKEW_FOR_SECONDS = 1800.0
RUNBOOK = "https://github.com/mla-watch/mla_watch/blob/main/docs/runbooks.md#routerversionskew"


def version_group(fleet_labels: tuple[str, ...], job: str, skew_for_seconds: float = DEFAULT_SKEW_FOR_SECONDS) -> str:
    """The group ``mla_watch_fleet_versions`` as an item of a top-level ``groups:`` list."""
    by = ", ".join(fleet_labels)
    fleet = " ".join(label_value(label) for label in fleet_labels)
    expr = (
        f"count by ({by}) (count by ({by}, {ROUTER_VERSION_DIGEST}) "
        f"({ROUTER_VERSION_INFO}{{{JOB}={promql_string(job)}}})) > 1"
    )
    entry: dict[str, object] = {
        "alert": VERSION_SKEW_ALERT,
        "expr": expr,
        "for": format_duration(skew_for_seconds),
        "labels": {"severity": "warning", SCOPE_LABEL: "fleet"},
        "annotations": {
            "summary": f"The replicas of {fleet} serve {{{{ $value }}}} different router versions",
            "description": (
                f"For {format_duration(skew_for_seconds)} the replicas of {fleet} have served more than "
                "one router version (digest of their router tensors): longer than a rollout takes. A "
                "halted rollout, a replica that could not take the fleet's version, or replicas that "
                "re-tuned apart. GET /v1/fleet on any member shows which replica serves which version."
            ),
            "runbook_url": RUNBOOK,
        },
    }
    return (
        f"  - name: {VERSION_GROUP_NAME}\n    rules:\n"
        f"      # {VERSION_SKEW_ALERT}: the fleet's replicas serve different router digests\n" + yaml_entry(entry)
    )
