"""``mla-watch fleet``: a fleet's members, rollout and lease, through any member's API (``serve --fleet``).

``show`` prints who serves which router version and how the current or last rollout went; ``rollout N`` rolls fleet
version N out from the member named by ``--url`` (a halted rollout resumed, or an earlier version put back);
``abort`` ends the rollout under way or halted, and every replica that took its version goes back.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mla_watch.cli.flags import DOCS
from mla_watch.cli.sidecar_api import call_sidecar, sidecar_url_flag
from mla_watch.cli.tables import format_table

__all__ = ["add_parser"]

_COMMAND = "mla-watch fleet"


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else time.strftime("%H:%M:%S", time.gmtime(seconds))


def describe(view: dict[str, Any]) -> str:
    """``GET /v1/fleet`` as on-call reads it: the current version, the members, the rollout, the lease."""
    current = view["current"]
    lines = [
        f"fleet store {view['store']}; current router version {current['version']} (digest {current['digest'][:12]})"
    ]
    rows = [["member", "version", "digest", "last seen", "alive"]]
    for member in view["members"]:
        rows.append(
            [
                member["name"],
                "-" if member["version"] is None else str(member["version"]),
                member["digest"][:12],
                _when(member["last_seen"]),
                "yes" if member["alive"] else "no",
            ]
        )
    lines.append(format_table(rows))
    rollout = view.get("rollout")
    if rollout is not None:
        state = (
            f"halted by {rollout['halted_by']}: {rollout['reason']}"
            if rollout["state"] == "halted"
            else rollout["state"] + (f" ({rollout['reason']})" if rollout.get("reason") else "")
        )
        lines.append(f"rollout {rollout['id']} of version {rollout['version']} (from {rollout['previous']}): {state}")
        steps = [["step", "outcome", "started", "ended", "why"]]
        for step in rollout["steps"]:
            steps.append(
                [
                    step["member"],
                    step["outcome"],
                    _when(step["started_at"]),
                    _when(step["ended_at"]),
                    str((step.get("detail") or {}).get("reason") or "")[:100],
                ]
            )
        lines.append(format_table(steps))
    lease = view["lease"]
    lines.append(
        f"re-tuning lease: held by {lease['holder']} for job {lease['job']} until {_when(lease['expires_at'])}"
        if lease["holder"]
        else "re-tuning lease: free"
    )
    return "\n".join(lines)


def _cmd_fleet(args: argparse.Namespace) -> int:
    if args.fleet_command == "show":
        view = call_sidecar(_COMMAND, args.url, "GET", "/v1/fleet")
        print(json.dumps(view, indent=2) if args.json else describe(view))
    elif args.fleet_command == "rollout":
        answer = call_sidecar(_COMMAND, args.url, "POST", "/admin/fleet/rollout", {"version": args.version})
        rollout = answer["rollout"]
        print(
            f"rollout {rollout['id']} of router version {rollout['version']} started from this member, which took "
            f"and checked it; the other members take it in turn (mla-watch fleet show)"
        )
    else:
        answer = call_sidecar(_COMMAND, args.url, "POST", "/admin/fleet/abort", {})
        rollout = answer["rollout"]
        print(
            f"rollout {rollout['id']} aborted: version {rollout['version']} is marked bad and every member on it "
            f"goes back to version {rollout['previous']}"
        )
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``fleet`` subcommand and its own subcommands."""
    fleet = commands.add_parser(
        "fleet",
        help="a fleet's members, router versions and rollout (serve --fleet)",
        epilog=f'The manual: {DOCS}fleet.md ("Repairing a fleet")',
    )
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True)

    def member_url(parser: argparse.ArgumentParser) -> None:
        sidecar_url_flag(parser, "any member of the fleet (rollout and abort need MLA_WATCH_ADMIN_TOKEN)")

    show = fleet_commands.add_parser("show", help="the members, the version each serves, the rollout, the lease")
    member_url(show)
    show.add_argument("--json", action="store_true", help="print GET /v1/fleet as it is")
    rollout = fleet_commands.add_parser(
        "rollout",
        help="roll a fleet version out from this member: it takes and checks it first, then the others in turn",
    )
    member_url(rollout)
    rollout.add_argument("version", type=int)
    abort = fleet_commands.add_parser(
        "abort",
        help="end the rollout under way or halted; every member on its version goes back to the fleet's current one",
    )
    member_url(abort)
    fleet.set_defaults(handler=_cmd_fleet)
