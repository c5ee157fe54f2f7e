"""Re-tuning as the server runs it: triggers, a persistent schedule, one job at a time, promotion.

Jobs come from a rule's ``retune`` action (:meth:`RetuneService.on_alert`), the CLI and the
admin API (:meth:`RetuneService.submit`). They run on APScheduler 3.x with a SQLite job store
in the state directory, one worker thread (one job at a time), ``coalesce`` and a generous
``misfire_grace_time``: a job scheduled while the server was down still runs when it comes
back, and one that is too late is failed and recorded, not silently dropped. A per-router
cooldown keeps a flapping alert from starting a storm of jobs. The job records themselves
live in :class:`mla_watch.retune.jobs.JobStore`; a job found ``running`` at start-up was
interrupted and is retried up to ``max_attempts`` times, then failed.

A job that lacked the data to decide (too few captured samples, or gates that found the
held-out set too small to tell), and one whose every candidate was rejected while the router
still reads outside its band (a rejection is no repair: the router is still broken), is
``waiting``: it runs again every ``retry_seconds`` while
capture collects more, for at most ``max_wait_seconds``, then fails saying what it still
needed. A waiting job, and one that failed for lack of data or configuration, holds no
cooldown: only a job that tried a candidate does. New alerts for its business line and
strategies join a waiting job, as they join a pending one. When a job promotes a version, the
pending and waiting jobs for no other router than its own are ``superseded``: the router they
were for is serving new tensors, and the alert that asked for them resolves or fires again.

Promotion and rollback hold the model lock that the decode loop holds around each forward
pass, so router tensors change between two passes and no in-flight request is dropped; the
routing windows of the changed routers are then restarted, so they describe the router now
serving.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from apscheduler.events import EVENT_JOB_MISSED, JobEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler

from mla_watch.alerting.vocabulary import RETUNE_STRATEGIES
from mla_watch.common.state_dir import ensure_private_dir, ensure_private_file
from mla_watch.retune.capture import TrafficCapture
from mla_watch.retune.hosts import RouterHost
from mla_watch.retune.jobs import JobSpec, JobStore, RetuneSettings
from mla_watch.retune.specs import alert_job_spec
from mla_watch.retune.versions import RouterVersions

__all__ = ["DEFAULT_STRATEGIES", "Cooldown", "JobAbandoned", "RetuneRunner", "RetuneService"]

log = logging.getLogger("mla_watch.retune")

DEFAULT_STRATEGIES = RETUNE_STRATEGIES

# APScheduler stores a job as a reference to a module-level function plus its arguments;
# the function finds the service of its state directory here.
_SERVICES: dict[str, RetuneService] = {}


def _run_scheduled(service_key: str, job_id: str) -> None:
    service = _SERVICES.get(service_key)
    if service is None:
        raise RuntimeError(f"no re-tune service for {service_key} in this process")
    service.execute(job_id)


class RetuneRunner(Protocol):
    """What runs the jobs of a :class:`RetuneService`: :class:`mla_watch.retune.runner.Retuner` (a model in this
    process) or :class:`mla_watch.retune.engine_retuning.EngineRetuner` (the routers of an engine beside the
    sidecar)."""

    @property
    def host(self) -> RouterHost:
        """The routers the jobs re-tune; promotions and rollbacks swap them."""

    @property
    def capture(self) -> TrafficCapture | None:
        """The captured traffic the jobs fit and gate on (``None``: capture is off, a job needs a dataset)."""

    def run(self, spec: JobSpec, previous: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Run ``spec`` (``previous``: the result it waited with); ``(status, result)``."""

    def remove_work(self, job_id: str | None = None) -> None:
        """Delete the work files of job ``job_id`` (of every job for ``None``)."""


class JobAbandoned(RuntimeError):
    """A job still running when the sidecar's stop ran out of time: nothing of it is promoted or recorded."""


class Cooldown(Exception):
    """A router had a job too recently; the message says which, and until when."""


class RetuneService:
    def __init__(
        self,
        *,
        state_dir: Path,
        settings: RetuneSettings,
        retuner: RetuneRunner,
        versions: RouterVersions,
        model_lock: Any,
        on_promoted: Callable[[str, list[str]], None] | None = None,
        on_outcome: Callable[[str, str], None] | None = None,
        on_rejected: Callable[[JobSpec, dict[str, Any]], None] | None = None,
        on_proposed: Callable[[JobSpec, dict[str, Any]], None] | None = None,
        health_check: Callable[[Any], dict[str, Any]] | None = None,
        resume_jobs: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = ensure_private_dir(state_dir)  # 0700: captured traffic and job files live here
        self.settings = settings
        self.retuner = retuner
        self.versions = versions
        self.store = JobStore(self.state_dir / "retune_jobs.sqlite", clock=clock)
        self._model_lock = model_lock
        self._on_promoted = on_promoted
        self._on_outcome = on_outcome  # (strategy, outcome) of each job, and of each one refused by cooldown
        self._on_rejected = on_rejected
        self._on_proposed = on_proposed  # serve --engine-retune propose: on-call hears the command that applies it
        self._health_check = health_check  # judges the routers the server starts with (router version 0)
        # In a fleet the fleet decides again after a restart: a job left unfinished here is ended, not resumed.
        self._resume_jobs = resume_jobs
        self._clock = clock
        self._submit_lock = threading.Lock()
        self._stopping = threading.Event()
        self._abandoned = threading.Event()  # a job still running when the stop's time ran out: it promotes nothing
        self._promoting = threading.Lock()
        self._key = str(self.state_dir.resolve())
        ensure_private_file(self.state_dir / "retune_schedule.sqlite")
        self._executor = ThreadPoolExecutor(max_workers=1)
        self.scheduler = BackgroundScheduler(
            jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{self.state_dir / 'retune_schedule.sqlite'}")},
            executors={"default": self._executor},
            job_defaults={
                "coalesce": True,
                "max_instances": 1,
                "misfire_grace_time": int(settings.misfire_grace_seconds),
            },
            timezone="UTC",
        )
        self.scheduler.add_listener(self._missed, EVENT_JOB_MISSED)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Record version 0 (health-checked; or re-apply the live version), recover interrupted jobs, start the
        scheduler."""
        host = self.retuner.host
        if self.versions.live_version() is None:
            health = None
            if self._health_check is not None:
                try:
                    with self._model_lock:
                        health = self._health_check(host)
                except Exception as error:  # serving must not depend on it: version 0 is then just not known good
                    log.exception("the start-up health check of the routers failed")
                    health = {
                        "passed": False,
                        "checked": False,
                        "reason": f"the health check failed: {type(error).__name__}: {str(error)[:200]}",
                    }
                log.log(
                    logging.INFO if health.get("passed") else logging.WARNING,
                    "router version 0 (the routers served now) %s: %s",
                    "passed its start-up health check"
                    if health.get("passed")
                    else "is not known to be good; `restore` will not put it back",
                    health.get("reason"),
                )
            self.versions.record_initial(host, health)
        else:
            differences = self.versions.initial_differences(host)
            live = self.versions.live_version()
            if differences:
                log.warning(
                    "the served routers differ from router version 0 in %d tensors (%s ...): a new model "
                    "or a damaged deploy; serving them as loaded (the `restore` strategy puts router "
                    "version %s back)",
                    len(differences),
                    differences[0],
                    self.versions.last_good(),
                )
            elif live:
                try:
                    self._apply_live_state()
                    log.info("router version %d re-applied after the restart", live)
                except Exception as error:  # an engine not up yet must not stop the sidecar: promote it again later
                    log.error(
                        "router version %d could not be re-applied after the restart (%s: %s); serving what "
                        "the model loaded until `mla-watch retune promote %d`",
                        live,
                        type(error).__name__,
                        str(error)[:200],
                        live,
                    )
        _SERVICES[self._key] = self
        self.retuner.remove_work()  # left by a job that a crash interrupted (it starts afresh if retried)
        if not self._resume_jobs:
            for record in self.store.list(limit=1000, statuses=["running", "pending", "waiting"]):
                self.store.finish(
                    record["id"],
                    "failed",
                    {
                        "error": "interrupted by a restart; in a fleet the fleet decides again",
                        "attempts": [],
                        "cannot_run": True,
                    },
                )
        for record in self.store.list(limit=1000, statuses=["running"]):
            self._recover(record)
        # Paused first: a pending job the schedule lost (a crash between recording and scheduling it)
        # is found and scheduled before any job runs or is declared missed.
        self.scheduler.start(paused=True)
        for record in self.store.list(limit=1000, statuses=["pending"]):
            if self.scheduler.get_job(record["id"]) is None:
                self._schedule(record["id"])
        for record in self.store.list(limit=1000, statuses=["waiting"]):
            if self.scheduler.get_job(record["id"]) is None:
                self._schedule(record["id"], at=(record["result"] or {}).get("retry_at"))
        self.scheduler.resume()

    def stop(self, timeout: float | None = None) -> None:
        """Stop scheduling; pending jobs stay in the store for the next start. A running job finishes first, or,
        past ``timeout`` seconds, is abandoned: it promotes nothing from then on, and stays ``running`` in the store,
        which the next start records as interrupted (and retries, up to ``max_attempts``)."""
        if self.scheduler.running:
            self._stopping.set()  # from now on the job store alone records what is due (start() schedules it)
            self.scheduler.pause()
            # APScheduler 3's loop runs one more round after shutdown() even when paused; a job due
            # then fails to submit and is deleted from the store. Detach the store first.
            self.scheduler.remove_jobstore("default")
            # The running job is waited for here, not in shutdown(wait=True): that holds the scheduler's
            # job-store lock while it waits, and a finishing job that supersedes or re-schedules a job
            # needs the same lock (a deadlock).
            waiting = threading.Thread(
                target=self._executor.shutdown, kwargs={"wait": True}, name="mla-watch-retune-stop", daemon=True
            )
            waiting.start()
            waiting.join(timeout)
            if waiting.is_alive():
                with self._promoting:  # a promotion under way ends first; none starts after this
                    self._abandoned.set()
                running = [record["id"] for record in self.store.list(limit=10, statuses=["running"])]
                log.warning(
                    "re-tune job(s) %s abandoned at the stop: nothing of them is promoted; the next start "
                    "records them as interrupted",
                    ", ".join(running) or "?",
                )
            self.scheduler.shutdown(wait=False)
        _SERVICES.pop(self._key, None)
        self.store.close()

    def _recover(self, record: Mapping[str, Any]) -> None:
        if record["attempts"] < self.settings.max_attempts:
            log.warning(
                "re-tune job %s was interrupted by a restart (attempt %d of %d): running it again",
                record["id"],
                record["attempts"],
                self.settings.max_attempts,
            )
            self.store.requeue(record["id"], f"interrupted during attempt {record['attempts']}; retried")
            self._schedule(record["id"])
        else:
            self.store.finish(
                record["id"],
                "failed",
                {
                    "error": f"interrupted {record['attempts']} times by a restart (max_attempts "
                    f"{self.settings.max_attempts})",
                    "attempts": [],
                },
            )

    # ------------------------------------------------------------------ triggers
    def submit(self, spec: JobSpec, *, force: bool = False) -> dict[str, Any]:
        """Schedule ``spec`` now; ``Cooldown`` if a router had a job within the cooldown (unless ``force``).

        While a job for the same business line and strategies is still pending, its routers are
        added to that job instead of scheduling another one.
        """
        unknown = [name for name in spec.strategies if name not in RETUNE_STRATEGIES]
        if not spec.strategies or unknown:
            raise ValueError(
                f"strategies={spec.strategies!r}: expected a non-empty list of {sorted(RETUNE_STRATEGIES)}"
            )
        routers = self.retuner.host.router_names()
        bad = [name for name in spec.routers if name not in routers]
        if not spec.routers or bad:
            raise ValueError(f"routers={spec.routers!r}: expected expert routers of the model, among {list(routers)}")
        with self._submit_lock:
            now = self._clock()
            recent = self.store.list(limit=500)
            for record in recent:
                other = JobSpec.from_dict(record["spec"])
                if (
                    record["status"] in ("pending", "waiting")
                    and other.business_line == spec.business_line
                    and other.strategies == spec.strategies
                    and other.dataset == spec.dataset
                    and other.version == spec.version
                ):
                    other.routers = list(dict.fromkeys([*other.routers, *spec.routers]))
                    other.watched = list(dict.fromkeys([*other.watched, *spec.watched]))
                    self.store.set_spec(other.id, other)
                    return self.store.get(other.id)
            if not force:
                for record in recent:
                    if record["status"] == "waiting" or (record.get("result") or {}).get("cannot_run"):
                        continue  # a job that lacked data or configuration tried nothing: it holds no cooldown
                    shared = set(record["spec"]["routers"]) & set(spec.routers)
                    if shared and now - record["created_at"] < self.settings.cooldown_seconds:
                        raise Cooldown(
                            f"router {sorted(shared)[0]} had re-tune job {record['id']} ({record['status']}) "
                            f"{now - record['created_at']:.0f} s ago; the cooldown is "
                            f"{self.settings.cooldown_seconds:g} s (force it from the CLI or the admin API)"
                        )
            record = self.store.add(spec)
            self._schedule(spec.id)
        log.info(
            "re-tune job %s scheduled: %s on %s (%s)",
            spec.id,
            "/".join(spec.strategies),
            ", ".join(spec.routers),
            spec.trigger.get("source", "?"),
        )
        return record

    def alert_spec(self, action: Any) -> JobSpec:
        """The job a rule's ``retune`` action asks for: the alert's router, in the band of its rule."""
        return alert_job_spec(
            action,
            watched=self.watched_by(action.rule),
            default_strategies=DEFAULT_STRATEGIES,
            max_perplexity_increase=self.settings.max_perplexity_increase,
            at=self._clock(),
        )

    def on_alert(self, action: Any) -> dict[str, Any] | None:
        """A rule's ``retune`` action: one job for the alert's router, in the band of its rule."""
        labels = action.alert.labels
        spec = self.alert_spec(action)
        try:
            return self.submit(spec)
        except Cooldown as error:
            log.warning("re-tune requested by %s not scheduled: %s", labels.get("alertname"), error)
            if self._on_outcome is not None:
                self._on_outcome(spec.strategies[0], "cooldown")
            return None

    def watched_by(self, rule: Any | None) -> list[str]:
        """The expert routers ``rule`` watches (every one for ``None``): those the band gate checks."""
        return [
            info.name
            for info in self.retuner.host.routers()
            if rule is None or rule.selector.matches({"name": info.name, "layer": info.layer, "kind": "expert"})
        ]

    # ------------------------------------------------------------------ running
    def _schedule(self, job_id: str, at: float | None = None) -> None:
        """Run ``job_id`` now, or at wall-clock time ``at`` (the scheduler's own clock is the wall clock)."""
        if self._stopping.is_set():
            return  # recorded pending or waiting (with its retry_at) in the job store: the next start() schedules it
        when = None if at is None else datetime.fromtimestamp(max(at, time.time()), tz=timezone.utc)
        self.scheduler.add_job(
            _run_scheduled,
            trigger="date",
            run_date=when,
            args=[self._key, job_id],
            id=job_id,
            name=f"retune {job_id}",
            replace_existing=True,
        )

    def _missed(self, event: JobEvent) -> None:
        try:
            record = self.store.get(event.job_id)
        except KeyError:
            return
        if record["status"] in ("pending", "waiting"):
            self.store.finish(
                event.job_id,
                "failed",
                {
                    "error": f"missed: the scheduler was down for longer than misfire_grace_time "
                    f"({self.settings.misfire_grace_seconds:g} s)",
                    "attempts": [],
                },
            )

    def execute(self, job_id: str) -> dict[str, Any]:
        """Run one job now (the scheduler's worker thread calls this)."""
        record = self.store.get(job_id)
        if record["status"] not in ("pending", "waiting"):
            return record
        waiting_since = (record["result"] or {}).get("waiting_since") if record["status"] == "waiting" else None
        was_waiting, record_result = record["status"] == "waiting", record["result"] or {}
        was_rejected = bool(record_result.get("rejected_while_outside_band"))
        record = self.store.start(job_id)
        spec = JobSpec.from_dict(record["spec"])
        if self._abandoned.is_set():
            return record
        try:
            status, result = self.retuner.run(spec, previous=record_result if was_waiting else None)
        except JobAbandoned:  # left `running`: the next start records it as interrupted
            log.info("re-tune job %s abandoned at the stop", job_id)
            return record
        except Exception as error:  # the record must say what happened, whatever it was
            log.exception("re-tune job %s failed", job_id)
            status, result = (
                "failed",
                {"error": f"{type(error).__name__}: {error}", "attempts": [], "strategy": spec.strategies[0]},
            )
        if self._abandoned.is_set():  # the store is closed: left `running`, the next start records it as interrupted
            log.info("re-tune job %s ended %s after the stop abandoned it: not recorded", job_id, status)
            return record
        if status == "waiting":
            if result.get("rejected_while_outside_band") and not was_rejected and self._on_rejected is not None:
                self._on_rejected(spec, result)  # on-call hears of the first rejection; the job goes on trying
            record = self._wait(job_id, result, waiting_since)
            status = record["status"]
            if status == "waiting":
                if self._on_outcome is not None:
                    self._on_outcome(str(result.get("strategy") or spec.strategies[0]), status)
                return record
        else:
            record = self.store.finish(job_id, status, result)
        if status == "promoted":
            self._supersede(record)
        log.info(
            "re-tune job %s ended %s%s",
            job_id,
            status,
            "" if status == "promoted" else f": {record['result'].get('error')}",
        )
        if status == "rejected" and self._on_rejected is not None:
            self._on_rejected(spec, result)
        if status == "proposed" and self._on_proposed is not None:
            self._on_proposed(spec, result)
        if self._on_outcome is not None:
            self._on_outcome(str(result.get("strategy") or spec.strategies[0]), status)
        return record

    def _supersede(self, promoted: Mapping[str, Any]) -> None:
        routers = set(promoted["spec"]["routers"])
        for record in self.store.list(limit=1000, statuses=["pending", "waiting"]):
            if set(record["spec"]["routers"]) <= routers:
                with contextlib.suppress(JobLookupError):
                    self.scheduler.remove_job(record["id"])
                self.store.finish(
                    record["id"],
                    "superseded",
                    {
                        "superseded_by": promoted["id"],
                        "version": None,
                        "attempts": [],
                        "cannot_run": True,
                        "error": f"superseded: job {promoted['id']} promoted router version "
                        f"{promoted['result'].get('version')} for {', '.join(sorted(routers))}",
                    },
                )
                log.info("re-tune job %s superseded by job %s", record["id"], promoted["id"])

    def withdraw(self, job_id: str, reason: str) -> bool:
        """End job ``job_id`` while it waits for data: ``superseded``, its error ``reason``. Whether it was waiting
        (a job running now, or ended, is left as it is)."""
        record = self.store.get(job_id)
        result = {**(record["result"] or {}), "version": None, "cannot_run": True, "error": f"superseded: {reason}"}
        if not self.store.end_waiting(job_id, "superseded", result):
            return False
        with contextlib.suppress(JobLookupError):
            self.scheduler.remove_job(job_id)
        log.info("re-tune job %s withdrawn while it waited for data: %s", job_id, reason)
        return True

    def _wait(self, job_id: str, result: dict[str, Any], since: float | None) -> dict[str, Any]:
        """Park a job that lacked data until its next try, or fail it once it has waited long enough."""
        now = self._clock()
        since = now if since is None else since
        if now - since >= self.settings.max_wait_seconds:
            return self.store.finish(
                job_id,
                "failed",
                {
                    **result,
                    "cannot_run": True,
                    "error": f"not enough data to decide after waiting {now - since:.0f} s (max_wait_seconds "
                    f"{self.settings.max_wait_seconds:g}): {result.get('needs')}",
                },
            )
        retry_at = now + self.settings.retry_seconds
        record = self.store.wait(job_id, {**result, "waiting_since": since, "retry_at": retry_at})
        self._schedule(job_id, at=time.time() + self.settings.retry_seconds)
        log.info(
            "re-tune job %s waits for more data (retry in %g s): %s",
            job_id,
            self.settings.retry_seconds,
            result.get("needs"),
        )
        return record

    def wait_idle(self, timeout: float) -> bool:
        """True once no job is pending or running (for tests and the CLI's --wait)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.store.list(limit=1, statuses=["pending", "running"]):
                return True
            time.sleep(0.05)
        return False

    # ------------------------------------------------------------------ promotion
    def promote(self, version: int) -> dict[str, Any]:
        """Swap ``version`` into the live model between two forward passes (into the engine: one swap at a time);
        what the swap took."""
        if self._abandoned.is_set():
            raise JobAbandoned(f"router version {version} is not promoted: the sidecar stopped during its job")
        tensors = self.versions.load(version)  # read and checked before the lock is taken
        names = sorted({name.rsplit(".", 1)[0] for name in tensors})
        with self._promoting:
            if self._abandoned.is_set():
                raise JobAbandoned(f"router version {version} is not promoted: the sidecar stopped during its job")
            with self._model_lock:
                taken = self.versions.promote(self.retuner.host, version)
                self._changed("promote", names)
        log.info("router version %d promoted (%s)", version, ", ".join(names))
        return taken

    def apply_spec(self, version: int) -> JobSpec:
        """The job that gates a proposed ``version`` through the engine (``mla-watch retune apply N``): swapped in,
        scored, kept or rolled back, as the job of its proposal would have."""
        manifest = self.versions.manifest(self.versions.check_version(version))
        if version == 0 or not manifest.get("routers"):
            raise ValueError(
                f"router version {version} is not a candidate a job proposed: expected one of "
                f"{[n for n in self.versions.version_numbers() if n]}"
            )
        try:
            proposal = JobSpec.from_dict(self.store.get(str(manifest.get("job")))["spec"])
        except KeyError:
            proposal = JobSpec(routers=list(manifest["routers"]), strategies=[str(manifest.get("strategy"))])
        return JobSpec(
            routers=list(manifest["routers"]),
            strategies=[str(manifest.get("strategy") or "restore")],
            watched=proposal.watched,
            business_line=proposal.business_line,
            band=proposal.band,
            max_perplexity_increase=proposal.max_perplexity_increase,
            version=version,
            trigger={**proposal.trigger, "source": "apply", "proposed_by": manifest.get("job")},
        )

    def apply(self, version: int) -> dict[str, Any]:
        """Schedule the gate of a proposed ``version`` (:meth:`apply_spec`); the new job's record."""
        return self.submit(self.apply_spec(version), force=True)

    def mark_good(self, version: int) -> int:
        """An operator vouches for ``version`` (see :meth:`RouterVersions.mark_good`)."""
        number = self.versions.mark_good(version)
        log.info("router version %d marked good by an operator", number)
        return number

    def rollback(self) -> int:
        """Restore exactly the router state before the last promotion; returns the version now live."""
        top = self.versions.live_version()
        names = sorted({name.rsplit(".", 1)[0] for name in self.versions.load(top)}) if top is not None else []
        with self._model_lock:
            version = self.versions.rollback(self.retuner.host)
            self._changed("rollback", names)
        log.info("router version %s rolled back; version %d is live", top, version)
        return version

    def _apply_live_state(self) -> None:
        with self._model_lock:
            self.retuner.host.apply(self.versions.live_state())

    def _changed(self, kind: str, routers: Sequence[str]) -> None:
        if self._on_promoted is not None:
            self._on_promoted(kind, list(routers))
