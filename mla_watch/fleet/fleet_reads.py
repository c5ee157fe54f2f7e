"""The fleet store's reads, inside one of its transactions: the SELECTs of jobs and rollouts, and a cursor's rows
made into :mod:`mla_watch.fleet.fleet_rows` values (a :class:`VersionRow`, a :class:`Rollout` with its steps, the
members' :class:`FleetView`) and job dictionaries. Each function is handed the cursor; none opens a transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mla_watch.fleet.fleet_rows import FleetView, Lease, Rollout, Step, VersionRow

__all__ = [
    "JOB_SELECT",
    "MAX_MEMBERS_SHOWN",
    "MAX_STEPS_SHOWN",
    "ROLLOUT_SELECT",
    "job_dict",
    "read_current",
    "read_rollout",
    "read_version",
    "read_view",
]

MAX_MEMBERS_SHOWN = 1000
MAX_STEPS_SHOWN = 1000

JOB_SELECT = (
    "SELECT id, base, routers, business_line, canary, state, tried, version, "
    "extract(epoch FROM started_at)::float8 AS started_at, "
    "extract(epoch FROM ended_at)::float8 AS ended_at, detail FROM mla_watch_fleet_jobs"
)
ROLLOUT_SELECT = (
    "SELECT id, base, version, digest, previous, job, state, batch, "
    "extract(epoch FROM started_at)::float8 AS started_at, "
    "extract(epoch FROM updated_at)::float8 AS updated_at, "
    "extract(epoch FROM ended_at)::float8 AS ended_at, halted_by, reason FROM mla_watch_fleet_rollouts"
)


def job_dict(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A row of :data:`JOB_SELECT` as the answers show a fleet job (``None`` for no row)."""
    if row is None:
        return None
    return {
        "id": row["id"],
        "routers": list(row["routers"]),
        "business_line": row["business_line"],
        "canary": row["canary"],
        "state": row["state"],
        "tried": bool(row["tried"]),
        "version": row["version"],
        "started_at": row["started_at"],
        "ended_at": row["ended_at"],
        "detail": row["detail"] or {},
    }


def read_version(cursor: Any, base: str, number: int) -> VersionRow | None:
    """Version ``number`` of ``base``, or ``None``."""
    cursor.execute(
        "SELECT number, digest, parent, job, created_by, extract(epoch FROM created_at)::float8 AS "
        "created_at, bytes, bad, manifest FROM mla_watch_fleet_versions WHERE base = %s AND number = %s",
        (base, number),
    )
    row = cursor.fetchone()
    if row is None:
        return None
    return VersionRow(
        int(row["number"]),
        row["digest"],
        row["parent"],
        row["job"],
        row["created_by"],
        float(row["created_at"]),
        int(row["bytes"]),
        bool(row["bad"]),
        row["manifest"] or {},
    )


def read_rollout(cursor: Any, row: Mapping[str, Any] | None) -> Rollout | None:
    """A row of :data:`ROLLOUT_SELECT` with its steps (``None`` for no row)."""
    if row is None:
        return None
    cursor.execute(
        "SELECT member, outcome, extract(epoch FROM started_at)::float8 AS started_at, "
        "extract(epoch FROM ended_at)::float8 AS ended_at, detail FROM mla_watch_fleet_steps "
        "WHERE rollout = %s ORDER BY started_at, member LIMIT %s",
        (row["id"], MAX_STEPS_SHOWN),
    )
    steps = tuple(
        Step(step["member"], step["outcome"], float(step["started_at"]), step["ended_at"], step["detail"] or {})
        for step in cursor.fetchall()
    )
    return Rollout(
        int(row["id"]),
        int(row["version"]),
        row["digest"],
        int(row["previous"]),
        row["job"],
        row["state"],
        int(row["batch"]),
        float(row["started_at"]),
        float(row["updated_at"]),
        row["ended_at"],
        row["halted_by"],
        row["reason"],
        steps,
    )


def read_current(cursor: Any, base: str) -> tuple[float, VersionRow | None]:
    """The database's clock and ``base``'s current version (``None``: not even version 0 is stored)."""
    cursor.execute("SELECT extract(epoch FROM now())::float8 AS now")
    now = float(cursor.fetchone()["now"])
    cursor.execute("SELECT current FROM mla_watch_fleet_bases WHERE base = %s", (base,))
    row = cursor.fetchone()
    return now, read_version(cursor, base, int(row["current"]) if row else 0)


def read_view(cursor: Any, base: str, now: float, current: VersionRow) -> FleetView:
    """The fleet as the members of ``base`` see it at ``now``, its current version ``current`` (:func:`read_current`
    read both)."""
    cursor.execute(
        "SELECT holder, job, extract(epoch FROM taken_at)::float8 AS taken_at, "
        "extract(epoch FROM expires_at)::float8 AS expires_at FROM mla_watch_fleet_lease WHERE id = 1"
    )
    lease_row = cursor.fetchone() or {}
    lease = Lease(
        lease_row.get("holder"), lease_row.get("job"), lease_row.get("taken_at"), lease_row.get("expires_at"), now
    )
    lease_job = None
    if lease.job is not None:
        cursor.execute(JOB_SELECT + " WHERE id = %s", (lease.job,))
        lease_job = job_dict(cursor.fetchone())
    cursor.execute(ROLLOUT_SELECT + " WHERE base = %s ORDER BY id DESC LIMIT 1", (base,))
    rollout = read_rollout(cursor, cursor.fetchone())
    cursor.execute(
        "SELECT name, base, digest, version, url, extract(epoch FROM started_at)::float8 AS started_at, "
        "extract(epoch FROM last_seen)::float8 AS last_seen, health FROM mla_watch_fleet_members "
        "ORDER BY name LIMIT %s",
        (MAX_MEMBERS_SHOWN,),
    )
    members = tuple(dict(member) for member in cursor.fetchall())
    cursor.execute("SELECT number, digest, bad FROM mla_watch_fleet_versions WHERE base = %s", (base,))
    rows = cursor.fetchall()
    return FleetView(
        now=now,
        base=base,
        current=current,
        lease=lease,
        lease_job=lease_job,
        rollout=rollout,
        members=members,
        versions={row["digest"]: int(row["number"]) for row in rows},
        bad=frozenset(int(row["number"]) for row in rows if row["bad"]),
    )
