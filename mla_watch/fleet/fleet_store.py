"""What a fleet of sidecars shares, in PostgreSQL: members, the re-tuning lease, router versions, jobs, rollouts.

Every table is named ``mla_watch_fleet_*`` and made by the first sidecar that connects (``CREATE TABLE IF NOT
EXISTS`` under an advisory lock). Times that decide anything (a lease's expiry, a member's last sight) are the
database's own ``now()``, so that replicas whose clocks disagree still agree on them.

* **Bases.** Replicas of one checkpoint start on the same router tensors: their digest is the fleet's *base*, and
  its version 0. Versions, the current version and rollouts belong to a base, so a replica of another checkpoint
  never takes a version made for this one.
* **Versions** store what they change: the router tensors that differ from their parent version, one
  safetensors blob per router. A version's full state is the base's tensors (every replica holds them: they are
  its own version 0) overlaid with the changes along its parents. ``digest`` is :func:`router_digest` of that
  full state.
* **The lease.** One row: who holds the fleet's re-tuning lease, for which fleet job, until when. A holder renews
  it while its job and the job's rollout run; a lease past its expiry is anyone's.
* **Jobs** record the fleet's re-tuning decisions (which routers, which replica ran it, how it ended); a job that
  tried a candidate holds the cooldown of its routers, fleet-wide.
* **Rollouts** take a version to every member of its base, one step per member.

:class:`FleetStore` holds one connection, opened on demand and again after a failure; every method is one
transaction. A store that cannot be reached raises :class:`FleetStoreError`, whose message names the store
without its password.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mla_watch.common.tensor_files import tensors_from_bytes, tensors_to_bytes
from mla_watch.fleet.fleet_lease import abandon_job, clear_lease, free_lease, lock_lease, take_lease
from mla_watch.fleet.fleet_reads import (
    JOB_SELECT,
    ROLLOUT_SELECT,
    job_dict,
    read_current,
    read_rollout,
    read_version,
    read_view,
)
from mla_watch.fleet.fleet_reads import MAX_MEMBERS_SHOWN as MAX_MEMBERS_SHOWN  # importable here as before
from mla_watch.fleet.fleet_reads import MAX_STEPS_SHOWN as MAX_STEPS_SHOWN
from mla_watch.fleet.fleet_rows import FleetView, Lease, Rollout, Step, VersionRow
from mla_watch.fleet.fleet_schema import SCHEMA, SCHEMA_LOCK
from mla_watch.fleet.fleet_url import describe_url, error_line

__all__ = [
    "FleetStore",
    "FleetStoreError",
    "FleetView",
    "Lease",
    "Rollout",
    "Step",
    "VersionRow",
    "describe_url",
]


# Jobs and rollouts that are over; a job in any other state holds the lease's attention.
JOB_ENDED = ("done", "failed", "rejected", "superseded", "proposed", "abandoned", "halted", "aborted")


class FleetStoreError(Exception):
    """The fleet store cannot be reached, or refused an operation; the message names it without secrets."""


class FleetStore:
    """The fleet's tables in the PostgreSQL database at ``url`` (see the module docstring)."""

    def __init__(self, url: str, *, connect_timeout: float = 3.0, statement_timeout: float = 10.0) -> None:
        self.url = url
        self.where = describe_url(url)
        self._connect_timeout = connect_timeout
        self._statement_timeout = statement_timeout
        self._conn: Any = None
        self._lock = threading.RLock()
        self._schema_made = False

    # ------------------------------------------------------------------ connection
    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None

    def _connect(self) -> Any:
        import psycopg

        conn = psycopg.connect(
            self.url,
            connect_timeout=max(1, round(self._connect_timeout)),
            options=f"-c statement_timeout={int(self._statement_timeout * 1000)}",
            application_name="mla-watch",
        )
        if not self._schema_made:
            with conn.transaction(), conn.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                cursor.execute(SCHEMA)
            self._schema_made = True
        return conn

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Any]:
        import psycopg
        from psycopg.rows import dict_row

        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                with self._conn.transaction(), self._conn.cursor(row_factory=dict_row) as cursor:
                    yield cursor
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                self.close()
                raise FleetStoreError(f"{self.where} cannot be reached: {error_line(error, self.url)}") from None
            except psycopg.Error as error:
                raise FleetStoreError(f"{self.where} refused an operation: {error_line(error, self.url)}") from None

    def ping(self) -> float:
        """The database's clock (seconds since the epoch); :class:`FleetStoreError` if it cannot be reached."""
        with self._transaction() as cursor:
            cursor.execute("SELECT extract(epoch FROM now())::float8 AS now")
            return float(cursor.fetchone()["now"])

    # ------------------------------------------------------------------ members
    def join(self, name: str, base: str, digest: str, url: str | None) -> None:
        """Record ``base`` (its version 0 is ``base`` itself) and this member; idempotent."""
        with self._transaction() as cursor:
            cursor.execute("INSERT INTO mla_watch_fleet_bases (base) VALUES (%s) ON CONFLICT DO NOTHING", (base,))
            cursor.execute(
                "INSERT INTO mla_watch_fleet_versions (base, number, digest, parent, manifest) "
                "VALUES (%s, 0, %s, NULL, %s) ON CONFLICT DO NOTHING",
                (base, base, _json({"source": "base", "routers": []})),
            )
            # A step this member was taking when it stopped is gone with it: lost, to be taken again.
            cursor.execute(
                "UPDATE mla_watch_fleet_steps SET outcome = 'lost', ended_at = now(), detail = %s "
                "WHERE member = %s AND outcome = 'taking'",
                (_json({"reason": "the member started again while it took this step"}), name),
            )
            cursor.execute(
                "INSERT INTO mla_watch_fleet_members (name, base, digest, url, started_at, last_seen) "
                "VALUES (%s, %s, %s, %s, now(), now()) ON CONFLICT (name) DO UPDATE SET base = EXCLUDED.base, "
                "digest = EXCLUDED.digest, url = EXCLUDED.url, started_at = now(), last_seen = now(), "
                "health = '{}'::jsonb",
                (name, base, digest, url),
            )

    def heartbeat(self, name: str, digest: str, version: int | None, health: Mapping[str, Any]) -> None:
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE mla_watch_fleet_members SET digest = %s, version = %s, health = %s, "
                "last_seen = now() WHERE name = %s",
                (digest, version, _json(health), name),
            )

    def touch(self, name: str) -> None:
        """This member is alive (while a long rollout step keeps its round from the heartbeat)."""
        with self._transaction() as cursor:
            cursor.execute("UPDATE mla_watch_fleet_members SET last_seen = now() WHERE name = %s", (name,))

    def view(self, base: str) -> FleetView:
        """The fleet as the members of ``base`` see it now."""
        with self._transaction() as cursor:
            now, current = read_current(cursor, base)
            if current is None:
                raise FleetStoreError(f"{self.where}: base {base[:12]} has no version 0 (was the store emptied?)")
            return read_view(cursor, base, now, current)

    # ------------------------------------------------------------------ versions
    def version(self, base: str, number: int) -> VersionRow | None:
        with self._transaction() as cursor:
            return read_version(cursor, base, number)

    def versions(self, base: str, limit: int = 100) -> list[VersionRow]:
        with self._transaction() as cursor:
            cursor.execute(
                "SELECT number FROM mla_watch_fleet_versions WHERE base = %s ORDER BY number DESC LIMIT %s",
                (base, limit),
            )
            numbers = [int(row["number"]) for row in cursor.fetchall()]
            return [row for number in numbers if (row := read_version(cursor, base, number)) is not None]

    def changes(self, base: str, number: int) -> list[tuple[int, dict[str, np.ndarray]]]:
        """What each version from ``number`` down to version 0 changes, newest first: ``(version, tensors)``. The
        full state of ``number`` is the base's tensors overlaid with these, oldest first."""
        out = []
        with self._transaction() as cursor:
            seen: set[int] = set()
            current: int | None = number
            while current is not None and current != 0:
                if current in seen:
                    raise FleetStoreError(f"{self.where}: the parents of version {number} form a loop at {current}")
                seen.add(current)
                row = read_version(cursor, base, current)
                if row is None:
                    raise FleetStoreError(f"{self.where}: version {current} of base {base[:12]} is missing")
                cursor.execute(
                    "SELECT data FROM mla_watch_fleet_tensors WHERE base = %s AND number = %s ORDER BY router",
                    (base, current),
                )
                tensors: dict[str, np.ndarray] = {}
                for blob in cursor.fetchall():
                    tensors.update(tensors_from_bytes(bytes(blob["data"])))
                out.append((current, tensors))
                current = row.parent
        return out

    # ------------------------------------------------------------------ the lease and jobs
    def decide(
        self,
        name: str,
        base: str,
        job: str,
        routers: Sequence[str],
        business_line: str | None,
        *,
        cooldown_seconds: float,
        lease_seconds: float,
    ) -> dict[str, Any]:
        """One decision for a model-caused alert on ``routers``: ``{"decision": "lease"}`` when this member takes
        the lease for a new job ``job`` (it is the canary); else ``"wait"`` (a job or a rollout is under way; who
        holds it) or ``"cooldown"`` (a job for these routers ended within the cooldown; until when)."""
        with self._transaction() as cursor:
            lease = lock_lease(cursor)
            if lease["holder"] is not None and lease["held"]:
                cursor.execute(JOB_SELECT + " WHERE id = %s", (lease["job"],))
                return {"decision": "wait", "holder": lease["holder"], "job": job_dict(cursor.fetchone())}
            if lease["holder"] is not None:
                cursor.execute(JOB_SELECT + " WHERE id = %s", (lease["job"],))
                held = job_dict(cursor.fetchone())
                if held is not None and held["state"] == "rolling":  # a coordinator's rollout: it is resumed, not raced
                    return {"decision": "wait", "holder": None, "job": held}
                abandon_job(cursor, lease["job"], f"its holder {lease['holder']} stopped renewing the lease")
            cursor.execute(
                "SELECT id FROM mla_watch_fleet_rollouts WHERE base = %s AND state = 'rolling' LIMIT 1", (base,)
            )
            if cursor.fetchone() is not None:
                return {"decision": "wait", "holder": None, "job": None}
            cursor.execute(
                JOB_SELECT + " WHERE base = %s AND tried AND routers && %s::text[] AND ended_at > now() - "
                "make_interval(secs => %s) ORDER BY ended_at DESC LIMIT 1",
                (base, list(routers), cooldown_seconds),
            )
            recent = job_dict(cursor.fetchone())
            if recent is not None:
                return {"decision": "cooldown", "job": recent, "until": float(recent["ended_at"]) + cooldown_seconds}
            cursor.execute(
                "INSERT INTO mla_watch_fleet_jobs (id, base, routers, business_line, canary, state) "
                "VALUES (%s, %s, %s, %s, %s, 'running')",
                (job, base, list(routers), business_line, name),
            )
            take_lease(cursor, name, job, lease_seconds)
            return {"decision": "lease"}

    def renew(self, name: str, job: str, lease_seconds: float) -> bool:
        """Extend the lease this member holds for ``job``; False when it is no longer its own."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE mla_watch_fleet_lease SET expires_at = now() + make_interval(secs => %s) "
                "WHERE id = 1 AND holder = %s AND job = %s AND expires_at > now() RETURNING id",
                (lease_seconds, name, job),
            )
            return cursor.fetchone() is not None

    def take_over(self, name: str, lease_seconds: float) -> dict[str, Any] | None:
        """A lease past its expiry: its rolling job's coordination is taken over by ``name`` (the job returned), a
        running job without a version is abandoned and the lease freed (``None``)."""
        with self._transaction() as cursor:
            lease = lock_lease(cursor)
            if lease["holder"] is None or lease["held"]:
                return None
            cursor.execute(JOB_SELECT + " WHERE id = %s", (lease["job"],))
            job = job_dict(cursor.fetchone())
            if job is not None and job["state"] == "rolling":
                cursor.execute(
                    "UPDATE mla_watch_fleet_lease SET holder = %s, taken_at = now(), "
                    "expires_at = now() + make_interval(secs => %s) WHERE id = 1",
                    (name, lease_seconds),
                )
                cursor.execute(
                    "UPDATE mla_watch_fleet_jobs SET detail = detail || %s WHERE id = %s",
                    (_json({"coordinator": name, "taken_over_from": lease["holder"]}), job["id"]),
                )
                return job
            abandon_job(cursor, lease["job"], f"its holder {lease['holder']} stopped renewing the lease")
            clear_lease(cursor)
            return None

    def finish_job(self, name: str, job: str, state: str, *, tried: bool, detail: Mapping[str, Any]) -> None:
        """End ``job`` (not by a rollout) and free the lease if ``name`` holds it for it."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE mla_watch_fleet_jobs SET state = %s, tried = %s, ended_at = now(), "
                "detail = detail || %s WHERE id = %s AND state NOT IN ('done', 'halted', 'aborted')",
                (state, tried, _json(detail), job),
            )
            free_lease(cursor, name, job)

    def release(self, name: str) -> None:
        """Free the lease if ``name`` holds it (a member stopping, or starting again under the same name)."""
        with self._transaction() as cursor:
            cursor.execute("SELECT job FROM mla_watch_fleet_lease WHERE id = 1 AND holder = %s FOR UPDATE", (name,))
            row = cursor.fetchone()
            if row is None:
                return
            cursor.execute(JOB_SELECT + " WHERE id = %s", (row["job"],))
            job = job_dict(cursor.fetchone())
            if job is not None and job["state"] == "rolling":
                # Expired at once, not freed: another member takes the rollout over.
                cursor.execute("UPDATE mla_watch_fleet_lease SET expires_at = now() WHERE id = 1")
                return
            abandon_job(cursor, row["job"], f"{name} stopped")
            free_lease(cursor, name, row["job"])

    def jobs(self, limit: int = 20) -> list[dict[str, Any]]:
        with self._transaction() as cursor:
            cursor.execute(JOB_SELECT + " ORDER BY started_at DESC LIMIT %s", (limit,))
            return [job for row in cursor.fetchall() if (job := job_dict(row)) is not None]

    # ------------------------------------------------------------------ publishing and rollouts
    def publish(
        self,
        name: str,
        job: str | None,
        base: str,
        *,
        parent: int,
        digest: str,
        changes: Mapping[str, Mapping[str, np.ndarray]],
        manifest: Mapping[str, Any],
        batch: int,
        canary_detail: Mapping[str, Any],
        lease_seconds: float,
    ) -> tuple[int, int]:
        """Write a version (``changes``: router -> its changed tensors) and start its rollout, with this member's
        step passed (it serves the version already). ``job`` is the fleet job whose lease ``name`` holds (``None``:
        an operator's rollout; the lease is taken for it). ``(version, rollout)``."""
        with self._transaction() as cursor:
            lease = lock_lease(cursor)
            if job is not None and (lease["holder"] != name or lease["job"] != job or not lease["held"]):
                raise FleetStoreError(
                    f"{name} no longer holds the fleet's re-tuning lease for job {job} (held by {lease['holder']})"
                )
            if job is None and lease["holder"] is not None and lease["held"]:
                raise FleetStoreError(
                    f"the fleet's re-tuning lease is held by {lease['holder']} (job "
                    f"{lease['job']}): a rollout waits for it"
                )
            cursor.execute(
                "SELECT id FROM mla_watch_fleet_rollouts WHERE base = %s AND state = 'rolling' LIMIT 1", (base,)
            )
            if cursor.fetchone() is not None:
                raise FleetStoreError("a rollout is under way: one at a time")
            cursor.execute(
                "SELECT number FROM mla_watch_fleet_versions WHERE base = %s AND digest = %s", (base, digest)
            )
            row = cursor.fetchone()
            if row is not None:
                number = int(row["number"])
            else:
                cursor.execute(
                    "SELECT coalesce(max(number), 0) + 1 AS next FROM mla_watch_fleet_versions WHERE base = %s", (base,)
                )
                number = int(cursor.fetchone()["next"])
                blobs = {router: tensors_to_bytes(tensors) for router, tensors in changes.items() if tensors}
                cursor.execute(
                    "INSERT INTO mla_watch_fleet_versions (base, number, digest, parent, job, created_by, bytes, "
                    "manifest) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    (
                        base,
                        number,
                        digest,
                        parent,
                        job,
                        name,
                        sum(len(blob) for blob in blobs.values()),
                        _json(manifest),
                    ),
                )
                for router, blob in blobs.items():
                    cursor.execute(
                        "INSERT INTO mla_watch_fleet_tensors (base, number, router, data) VALUES (%s, %s, %s, %s)",
                        (base, number, router, blob),
                    )
            cursor.execute("SELECT current FROM mla_watch_fleet_bases WHERE base = %s", (base,))
            previous = int(cursor.fetchone()["current"])
            cursor.execute(
                "INSERT INTO mla_watch_fleet_rollouts (base, version, digest, previous, job, state, batch) "
                "VALUES (%s, %s, %s, %s, %s, 'rolling', %s) RETURNING id",
                (base, number, digest, previous, job, batch),
            )
            rollout = int(cursor.fetchone()["id"])
            cursor.execute(
                "INSERT INTO mla_watch_fleet_steps (rollout, member, outcome, ended_at, detail) "
                "VALUES (%s, %s, 'passed', now(), %s)",
                (rollout, name, _json(canary_detail)),
            )
            if job is not None:
                cursor.execute(
                    "UPDATE mla_watch_fleet_jobs SET state = 'rolling', tried = true, version = %s WHERE id = %s",
                    (number, job),
                )
            else:
                job = f"rollout-{rollout}"
                cursor.execute(
                    "INSERT INTO mla_watch_fleet_jobs (id, base, routers, canary, state, tried, version, "
                    "detail) VALUES (%s, %s, %s, %s, 'rolling', true, %s, %s)",
                    (job, base, list(manifest.get("routers", [])), name, number, _json({"source": "operator"})),
                )
                cursor.execute("UPDATE mla_watch_fleet_rollouts SET job = %s WHERE id = %s", (job, rollout))
                take_lease(cursor, name, job, lease_seconds)
            return number, rollout

    def claim_step(self, name: str, rollout: int) -> bool:
        """Take this member's step of a rolling ``rollout`` when fewer than its batch are under way (again, where
        its step was lost)."""
        with self._transaction() as cursor:
            cursor.execute("SELECT state, batch FROM mla_watch_fleet_rollouts WHERE id = %s FOR UPDATE", (rollout,))
            row = cursor.fetchone()
            if row is None or row["state"] != "rolling":
                return False
            cursor.execute(
                "SELECT count(*) AS n FROM mla_watch_fleet_steps WHERE rollout = %s AND outcome = 'taking'", (rollout,)
            )
            if int(cursor.fetchone()["n"]) >= int(row["batch"]):
                return False
            cursor.execute(
                "INSERT INTO mla_watch_fleet_steps (rollout, member, outcome) VALUES (%s, %s, 'taking') "
                "ON CONFLICT (rollout, member) DO UPDATE SET outcome = 'taking', started_at = now(), "
                "ended_at = NULL, detail = '{}'::jsonb WHERE mla_watch_fleet_steps.outcome = 'lost' "
                "RETURNING member",
                (rollout, name),
            )
            return cursor.fetchone() is not None

    def end_step(self, name: str, rollout: int, outcome: str, detail: Mapping[str, Any]) -> None:
        """Record this member's step; a failed one halts the rollout, naming the member."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE mla_watch_fleet_steps SET outcome = %s, ended_at = now(), detail = %s "
                "WHERE rollout = %s AND member = %s",
                (outcome, _json(detail), rollout, name),
            )
            cursor.execute("UPDATE mla_watch_fleet_rollouts SET updated_at = now() WHERE id = %s", (rollout,))
            if outcome == "failed":
                cursor.execute(
                    "UPDATE mla_watch_fleet_rollouts SET state = 'halted', halted_by = %s, reason = %s, "
                    "ended_at = now() WHERE id = %s AND state = 'rolling'",
                    (name, str(detail.get("reason", ""))[:2000], rollout),
                )

    def coordinate(self, name: str, job: str, *, member_seconds: float) -> str | None:
        """The lease holder's round over its job's rollout: steps of members not seen for ``member_seconds`` are
        lost; once every member of the base seen within it has passed, the version becomes the base's current one
        and the lease is freed. The rollout's state afterwards (``None``: no rollout of this job)."""
        with self._transaction() as cursor:
            cursor.execute(ROLLOUT_SELECT + " WHERE job = %s ORDER BY id DESC LIMIT 1 FOR UPDATE", (job,))
            row = cursor.fetchone()
            if row is None:
                return None
            rollout = int(row["id"])
            if row["state"] in ("halted", "aborted"):
                cursor.execute(
                    "UPDATE mla_watch_fleet_jobs SET state = %s, ended_at = now(), detail = detail || %s "
                    "WHERE id = %s AND state = 'rolling'",
                    (row["state"], _json({"halted_by": row["halted_by"], "reason": row["reason"]}), job),
                )
                free_lease(cursor, name, job)
                return str(row["state"])
            if row["state"] != "rolling":
                return str(row["state"])
            cursor.execute(
                "UPDATE mla_watch_fleet_steps s SET outcome = 'lost', ended_at = now(), detail = %s "
                "FROM mla_watch_fleet_members m WHERE s.rollout = %s AND s.outcome = 'taking' AND m.name = s.member "
                "AND m.last_seen < now() - make_interval(secs => %s)",
                (_json({"reason": "the member was not seen while it took its step"}), rollout, member_seconds),
            )
            cursor.execute(
                "SELECT m.name FROM mla_watch_fleet_members m LEFT JOIN mla_watch_fleet_steps s "
                "ON s.rollout = %s AND s.member = m.name WHERE m.base = %s "
                "AND m.last_seen >= now() - make_interval(secs => %s) "
                "AND (s.outcome IS NULL OR s.outcome <> 'passed') AND m.digest <> %s",
                (rollout, row["base"], member_seconds, row["digest"]),
            )
            if cursor.fetchall():
                return "rolling"
            cursor.execute(
                "UPDATE mla_watch_fleet_rollouts SET state = 'done', ended_at = now(), updated_at = now() "
                "WHERE id = %s",
                (rollout,),
            )
            cursor.execute(
                "UPDATE mla_watch_fleet_bases SET current = %s, updated_at = now() WHERE base = %s",
                (row["version"], row["base"]),
            )
            cursor.execute("UPDATE mla_watch_fleet_jobs SET state = 'done', ended_at = now() WHERE id = %s", (job,))
            free_lease(cursor, name, job)
            return "done"

    def abort(self, base: str, reason: str) -> Rollout | None:
        """Abort the latest rolling or halted rollout of ``base``: its version is marked bad, every member on it
        goes back to the current version, its job ends and the lease is freed. The rollout, or ``None``."""
        with self._transaction() as cursor:
            cursor.execute(
                ROLLOUT_SELECT + " WHERE base = %s AND state IN ('rolling', 'halted') ORDER BY id DESC "
                "LIMIT 1 FOR UPDATE",
                (base,),
            )
            row = cursor.fetchone()
            if row is None:
                return None
            cursor.execute(
                "UPDATE mla_watch_fleet_rollouts SET state = 'aborted', reason = %s, ended_at = now(), "
                "updated_at = now() WHERE id = %s",
                (reason[:2000], row["id"]),
            )
            cursor.execute(
                "UPDATE mla_watch_fleet_versions SET bad = true WHERE base = %s AND number = %s", (base, row["version"])
            )
            cursor.execute(
                "UPDATE mla_watch_fleet_jobs SET state = 'aborted', ended_at = now() WHERE id = %s "
                "AND state NOT IN ('done')",
                (row["job"],),
            )
            cursor.execute(
                "UPDATE mla_watch_fleet_lease SET holder = NULL, job = NULL, taken_at = NULL, "
                "expires_at = NULL WHERE id = 1 AND job IS NOT DISTINCT FROM %s",
                (row["job"],),
            )
            cursor.execute(ROLLOUT_SELECT + " WHERE id = %s", (row["id"],))
            return read_rollout(cursor, cursor.fetchone())

    def load(self) -> dict[str, int]:
        """What the fleet keeps, for the docs' and the bench's sizes: rows and bytes per table."""
        with self._transaction() as cursor:
            out = {}
            for table in ("bases", "members", "versions", "tensors", "lease", "jobs", "rollouts", "steps"):
                cursor.execute(
                    f"SELECT count(*) AS n, coalesce(pg_total_relation_size('mla_watch_fleet_{table}'), 0) "
                    f"AS bytes FROM mla_watch_fleet_{table}"
                )
                row = cursor.fetchone()
                out[f"{table}_rows"], out[f"{table}_bytes"] = int(row["n"]), int(row["bytes"])
            return out


def _json(value: Any) -> Any:
    from psycopg.types.json import Jsonb

    return Jsonb(value)
