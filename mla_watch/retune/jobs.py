"""Re-tuning jobs: what a job asks for (:class:`JobSpec`) and where its life is recorded (:class:`JobStore`).

A job is ``pending`` when scheduled, ``running`` while it fits and gates, ``waiting`` when it
lacked data to decide (too few captured samples, or gates that could not tell with the held-out
data there was: it runs again by itself later), and ends ``promoted``, ``rejected`` (a gate
found the candidates worse; nothing changed in the live model) or ``failed`` (an error, a
missing configuration, or still not enough data when its wait ran out) or ``superseded`` (another
job promoted a version for all of its routers while it was pending or waiting). The store is a sqlite
file in the state directory, so a job survives a restart: one found ``running`` at start-up was
interrupted, and is retried (``attempts`` counts the tries) or failed, never forgotten.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mla_watch.common.sqlite import PrivateDatabase
from mla_watch.common.values import is_integer
from mla_watch.quality.band import DEFAULT_BAND
from mla_watch.quality.paired import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MARGIN,
    DEFAULT_MIN_SAMPLES,
    DEFAULT_MIN_TOKENS,
    parse_confidence,
    parse_margin,
)

__all__ = [
    "ENGINE_RETUNE_MODES",
    "FINAL_STATUSES",
    "JobSpec",
    "JobStore",
    "JobStoreError",
    "RetentionPolicy",
    "RetuneSettings",
    "job_result",
]

# proposed: a candidate saved and gated as far as it could be without the engine, waiting for
# `mla-watch retune apply N` (serve --engine-retune propose).
# serve --engine-retune: what re-tuning does with the routers of an engine beside the sidecar.
ENGINE_RETUNE_MODES: tuple[str, ...] = ("off", "propose", "apply")
FINAL_STATUSES: tuple[str, ...] = ("promoted", "rejected", "failed", "superseded", "proposed")
STATUSES: tuple[str, ...] = ("pending", "running", "waiting", *FINAL_STATUSES)


@dataclass
class RetuneSettings:
    cooldown_seconds: float = 3600.0  # per router: a flapping alert cannot start a storm of jobs
    # The perplexity gate (mla_watch.quality.paired): an absolute (0.3) or relative ("2%") margin, the
    # one-sided confidence of its decisions, and the held-out tokens below which it does not decide.
    max_perplexity_increase: float | str = DEFAULT_MARGIN
    gate_confidence: float = DEFAULT_CONFIDENCE
    min_held_out_tokens: int = DEFAULT_MIN_TOKENS
    min_held_out_samples: int = DEFAULT_MIN_SAMPLES  # distinct texts: a repeated prompt counts once
    # A job without the data to decide waits: it runs again every retry_seconds, for at most max_wait_seconds.
    retry_seconds: float = 300.0
    max_wait_seconds: float = 6 * 3600.0
    min_samples: int = 16
    max_samples: int = 512
    held_out_fraction: float = 0.25
    batch_size: int = 8
    max_tokens_per_sample: int = 256
    command: str | None = None  # external command template (see the module docstring)
    command_timeout: float = 6 * 3600.0
    misfire_grace_seconds: float = 24 * 3600.0  # APScheduler's default (1 s) silently skips late jobs
    max_attempts: int = 2  # tries of a job interrupted by a restart before it is failed
    # Server-wide strategy options (e.g. {"router_finetune": {"lr": 1e-3}}); a job's own options win.
    strategy_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_margin(self.max_perplexity_increase)
        parse_confidence(self.gate_confidence)
        checks = {
            "cooldown_seconds": self.cooldown_seconds >= 0,
            "min_held_out_tokens": self.min_held_out_tokens >= 1,
            "min_held_out_samples": self.min_held_out_samples >= 2,
            "retry_seconds": self.retry_seconds > 0,
            "max_wait_seconds": self.max_wait_seconds >= 0,
            "min_samples": self.min_samples >= 2,
            "max_samples": self.max_samples >= self.min_samples,
            "held_out_fraction": 0 < self.held_out_fraction < 1,
            "batch_size": self.batch_size >= 1,
            "max_tokens_per_sample": self.max_tokens_per_sample >= 2,
            "command_timeout": self.command_timeout > 0,
            "misfire_grace_seconds": self.misfire_grace_seconds > 0,
            "max_attempts": self.max_attempts >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "re-tune settings invalid: "
                + "; ".join(f"{name}={getattr(self, name)!r}" for name in bad)
                + " (cooldown >= 0, min_held_out_tokens >= 1, "
                "min_held_out_samples >= 2, "
                "retry_seconds > 0, max_wait_seconds >= 0, "
                "min_samples >= 2, max_samples >= min_samples, 0 < held_out_fraction < 1, batch_size >= 1, "
                "max_tokens_per_sample >= 2, timeouts > 0, max_attempts >= 1)"
            )


@dataclass(frozen=True)
class RetentionPolicy:
    """How many router versions the registry keeps on disk, and in how many bytes: past either, the oldest versions
    nothing needs (not version 0, not on the promotion stack, not marked good, not the newest good one, not a
    proposal waiting to be applied) are deleted."""

    max_versions: int = 100
    max_bytes: int = 4 << 30  # DeepSeek-V3's full router state is ~0.2 GB a version; bias re-fits ~60 KB

    def __post_init__(self) -> None:
        for name, lowest in (("max_versions", 2), ("max_bytes", 1024)):
            value = getattr(self, name)
            if not is_integer(value) or value < lowest:
                raise ValueError(f"router version retention {name} = {value!r}: expected an integer >= {lowest}")


class JobStoreError(Exception):
    """The job store cannot be used; the message names the file and the cause."""


@dataclass
class JobSpec:
    """Everything a job needs, JSON-able (it is stored, and handed to an external command)."""

    routers: list[str]  # the routers the job may change
    strategies: list[str]  # tried in order until one passes the gates
    watched: list[str] = field(default_factory=list)  # routers the band gate checks besides ``routers``
    business_line: str | None = None  # whose traffic to train on (None: every line captured)
    band: dict[str, Any] = field(default_factory=DEFAULT_BAND.as_dict)
    trigger: dict[str, Any] = field(default_factory=dict)  # source (alert|cli|api), alert labels, value, at
    dataset: str | None = None  # a JSONL file instead of captured traffic
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # strategy -> its options
    max_perplexity_increase: float | str = DEFAULT_MARGIN
    version: int | None = None  # gate and promote this saved version (`mla-watch retune apply N`), no new fit
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    created_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})


def job_result(
    spec: JobSpec,
    attempts: list[dict[str, Any]],
    data: dict[str, Any],
    *,
    started: float,
    finished: float,
    version: int | None = None,
    strategy: str | None = None,
    timings: Mapping[str, float] | None = None,
    engine: bool = False,
) -> dict[str, Any]:
    """The result a try of a job records (the job store's ``result``, the admin API's answer).

    ``version``: the router version it promoted or proposed (``None``: none, and ``error`` says why from the
    attempts' reasons); ``strategy``: the one that did, else the last one tried; ``timings``: the phases measured,
    to which the total and, for a promotion after a triggered job, the seconds from the trigger are added;
    ``engine``: the routers re-tuned are an engine's.
    """
    timings = {**(timings or {}), "total_seconds": round(finished - started, 3)}
    trigger_at = spec.trigger.get("at")
    if version is not None and isinstance(trigger_at, int | float):
        timings["trigger_to_promoted_seconds"] = round(finished - trigger_at, 3)
    reasons = [f"{a['strategy']}: {a['reason']}" for a in attempts if a.get("reason")]
    result: dict[str, Any] = {
        "version": version,
        "strategy": strategy or (attempts[-1]["strategy"] if attempts else None),
        "attempts": attempts,
        "data": data,
        "timings": timings,
    }
    if engine:
        result["engine"] = True
    result["error"] = None if version is not None else ("; ".join(reasons) or "no strategy was tried")
    return result


_JOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, updated_at REAL NOT NULL, result TEXT);
"""
_JOB_COLUMNS = "id, spec, status, attempts, created_at, updated_at, result"


class JobStore:
    """Job records in ``path`` (sqlite), safe to use from the scheduler's and the server's threads."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise JobStoreError(f"re-tune job store {self.path}: cannot open it: {error}") from error
        self._store = PrivateDatabase(self.path, what="re-tune job store", error=JobStoreError, schema=_JOBS_SCHEMA)

    def add(self, spec: JobSpec) -> dict[str, Any]:
        now = self._clock()
        self._store.execute(
            "INSERT INTO jobs (id, spec, status, attempts, created_at, updated_at) VALUES (?, ?, 'pending', 0, ?, ?)",
            (spec.id, json.dumps(spec.as_dict()), now, now),
        )
        return self.get(spec.id)

    def get(self, job_id: str) -> dict[str, Any]:
        rows = self._store.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise KeyError(f"no re-tune job with id {job_id!r}")
        return _record(rows[0])

    def list(self, *, limit: int = 50, statuses: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` jobs (newest first), optionally only those in ``statuses``."""
        query = f"SELECT {_JOB_COLUMNS} FROM jobs"
        params: list[Any] = []
        if statuses:
            query += f" WHERE status IN ({', '.join('?' * len(statuses))})"
            params.extend(statuses)
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        return [_record(row) for row in self._store.execute(query, [*params, limit])]

    def start(self, job_id: str) -> dict[str, Any]:
        """Mark a job running and count the attempt."""
        self._store.execute(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, updated_at = ? WHERE id = ?",
            (self._clock(), job_id),
        )
        return self.get(job_id)

    def finish(self, job_id: str, status: str, result: Mapping[str, Any]) -> dict[str, Any]:
        if status not in STATUSES:
            raise ValueError(f"status={status!r}: expected one of {STATUSES}")
        self._store.execute(
            "UPDATE jobs SET status = ?, result = ?, updated_at = ? WHERE id = ?",
            (status, json.dumps(result), self._clock(), job_id),
        )
        return self.get(job_id)

    def wait(self, job_id: str, result: Mapping[str, Any]) -> dict[str, Any]:
        """A job that lacked data to decide: ``waiting`` (its attempts start again), ``result`` says until when."""
        self._store.execute(
            "UPDATE jobs SET status = 'waiting', attempts = 0, result = ?, updated_at = ? WHERE id = ?",
            (json.dumps(result), self._clock(), job_id),
        )
        return self.get(job_id)

    def end_waiting(self, job_id: str, status: str, result: Mapping[str, Any]) -> bool:
        """End a job only while it waits for data (a job running or ended is left as it is); whether it did."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status={status!r}: expected one of {FINAL_STATUSES}")
        changed = self._store.run(
            lambda db: (
                db.execute(
                    "UPDATE jobs SET status = ?, result = ?, updated_at = ? WHERE id = ? AND status = 'waiting'",
                    (status, json.dumps(result), self._clock(), job_id),
                ).rowcount
            )
        )
        return bool(changed)

    def resume(self, job_id: str) -> None:
        """A waiting job whose retry is due goes back to ``pending``."""
        self._store.execute(
            "UPDATE jobs SET status = 'pending', updated_at = ? WHERE id = ? AND status = 'waiting'",
            (self._clock(), job_id),
        )

    def requeue(self, job_id: str, note: str) -> None:
        """A job interrupted while running goes back to ``pending``, with ``note`` saying why."""
        self._store.execute(
            "UPDATE jobs SET status = 'pending', result = ?, updated_at = ? WHERE id = ?",
            (json.dumps({"note": note}), self._clock(), job_id),
        )

    def set_spec(self, job_id: str, spec: JobSpec) -> None:
        self._store.execute(
            "UPDATE jobs SET spec = ?, updated_at = ? WHERE id = ? AND status IN ('pending', 'waiting')",
            (json.dumps(spec.as_dict()), self._clock(), job_id),
        )

    def close(self) -> None:
        self._store.close()


def _record(row: tuple) -> dict[str, Any]:
    job_id, spec, status, attempts, created_at, updated_at, result = row
    return {
        "id": job_id,
        "spec": json.loads(spec),
        "status": status,
        "attempts": attempts,
        "created_at": created_at,
        "updated_at": updated_at,
        "result": json.loads(result) if result else None,
    }
