"""The fleet's re-tuning lease, the one row of ``mla_watch_fleet_lease``, as the fleet store's transactions lock, take
and free it, and the job a lapsed lease leaves behind abandoned. Each function is handed the store's cursor."""

from __future__ import annotations

from typing import Any

__all__ = ["abandon_job", "clear_lease", "free_lease", "lock_lease", "take_lease"]


def lock_lease(cursor: Any) -> Any:
    """The lease row, locked for the transaction: its ``holder``, ``job`` and whether it is ``held`` (not expired)."""
    cursor.execute("SELECT holder, job, expires_at > now() AS held FROM mla_watch_fleet_lease WHERE id = 1 FOR UPDATE")
    return cursor.fetchone()


def take_lease(cursor: Any, name: str, job: str, lease_seconds: float) -> None:
    """``name`` holds the lease for ``job`` from now, for ``lease_seconds``."""
    cursor.execute(
        "UPDATE mla_watch_fleet_lease SET holder = %s, job = %s, taken_at = now(), "
        "expires_at = now() + make_interval(secs => %s) WHERE id = 1",
        (name, job, lease_seconds),
    )


def free_lease(cursor: Any, name: str, job: str | None) -> None:
    """Free the lease if ``name`` holds it for ``job``."""
    cursor.execute(
        "UPDATE mla_watch_fleet_lease SET holder = NULL, job = NULL, taken_at = NULL, "
        "expires_at = NULL WHERE id = 1 AND holder = %s AND job IS NOT DISTINCT FROM %s",
        (name, job),
    )


def clear_lease(cursor: Any) -> None:
    """Free the lease, whoever holds it."""
    cursor.execute(
        "UPDATE mla_watch_fleet_lease SET holder = NULL, job = NULL, taken_at = NULL, expires_at = NULL WHERE id = 1"
    )


def abandon_job(cursor: Any, job: str | None, why: str) -> None:
    """A running ``job`` ends abandoned (``why`` in its detail); nothing for ``None``."""
    from psycopg.types.json import Jsonb

    if job is None:
        return
    cursor.execute(
        "UPDATE mla_watch_fleet_jobs SET state = 'abandoned', ended_at = now(), "
        "detail = detail || %s WHERE id = %s AND state = 'running'",
        (Jsonb({"error": f"abandoned: {why}"}), job),
    )
