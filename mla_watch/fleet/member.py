"""A sidecar as a member of a fleet: one re-tuning decision for the fleet, a canary, a checked rollout.

Every replica of a checkpoint runs its own sidecar; with ``serve --fleet URL`` they share a PostgreSQL store
(:mod:`mla_watch.fleet.fleet_store`) and repair as one:

1. **One decision.** A model-caused alert asks the fleet (:meth:`FleetMember.on_model_alert`). A replica whose
   routers are not the fleet's version restores that version (its routers were changed here alone). A replica
   whose peers, serving the same version, read healthy on their reference prompts re-applies the version (a
   reload gone wrong here). Otherwise, unless a fleet job for that router is running or in its cooldown, it takes
   the fleet's re-tuning lease and runs the job on its own model or engine: it is the canary. The others wait.
2. **Canary, then rollout.** Once the canary's job promotes (its gates, the reference prompts among them, passed
   there), the version's changed tensors are written to the store and a rollout starts. Each member takes its
   step in turn (``rollout_batch`` at a time): swaps the version in and checks it on its own reference prompts and
   rules (:class:`~mla_watch.fleet.check.StepCheck`). A failed check rolls that replica back and halts the
   rollout (on-call is paged, naming it); the replicas not reached keep the fleet's last good version. The lease
   holder coordinates: when every live member has passed, the version becomes the fleet's current one.
3. **Joining and crashing.** A member that starts adopts the fleet's current version before it judges its
   routers, and at every round converges on the version the fleet says it serves: a replica is never left on
   routers the store does not know. A lease holder that stops renewing loses the lease at its expiry; another
   member then takes over a rollout, or a job without a version is abandoned and decided again.
4. **The store down.** Serving, counting, alerting and notifying go on; re-tuning waits (no member repairs
   alone), and the alerts that asked are asked again once the store answers.

One thread per member runs the rounds (every ``poll_seconds``); a decision asked by an alert is made at once
when the member is free, else by the next round.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mla_watch.fleet import fleet_decision as notes
from mla_watch.fleet.canary_job import CanaryJob, ended_without_version, publish_canary
from mla_watch.fleet.check import StepResult
from mla_watch.fleet.fleet_decision import WaitingAlert, gives_way_to, peer_readings
from mla_watch.fleet.fleet_description import DESCRIBE_SECONDS as DESCRIBE_SECONDS  # importable here as before
from mla_watch.fleet.fleet_description import FleetDescription
from mla_watch.fleet.fleet_store import FleetStore, FleetStoreError, FleetView, VersionRow
from mla_watch.fleet.halted_page import FLEET_HALTED_ALERT, RUNBOOK
from mla_watch.fleet.rollout_step import RolloutStep
from mla_watch.fleet.served_routers import ServedRouters, router_of
from mla_watch.fleet.settings import FleetSettings
from mla_watch.retune.data import distinct_count
from mla_watch.retune.jobs import FINAL_STATUSES
from mla_watch.retune.service import RetuneService
from mla_watch.routing.series import BUSINESS_LINE, ROUTER

__all__ = ["FLEET_HALTED_ALERT", "RUNBOOK", "FleetMember", "FleetRefusal", "router_of"]

log = logging.getLogger("mla_watch.fleet")

_DECIDE_WAIT_SECONDS = 0.5  # an alert's decision waits this long for a member busy with a step, then a round makes it


class FleetRefusal(Exception):
    """What an operator asked of the fleet cannot be done now (the lease is held, a job runs here); says why."""


class FleetMember:
    """This sidecar's part in a fleet (see the module docstring)."""

    def __init__(
        self,
        store: FleetStore,
        settings: FleetSettings,
        *,
        retune: RetuneService,
        check: Callable[[Mapping[str, Any]], StepResult],
        health: Callable[[], dict[str, dict[str, Any]]],
        still_wanted: Callable[[str, str | None], bool],
        page: Callable[[dict[str, str], dict[str, str]], None],
        on_store: Callable[[bool, str | None], None] = lambda up, why: None,
        on_step: Callable[[str], None] = lambda outcome: None,
        on_serving: Callable[[int | None, str], None] = lambda version, digest: None,
        read_again: Callable[[], None] = lambda: None,
        url: str | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.name = settings.name
        self.retune = retune
        self._health = health
        self._still_wanted = still_wanted
        self._on_store = on_store
        self._on_step = on_step
        self._on_serving = on_serving
        # base and digest: what serves here; read_again: the reference prompts, once other routers serve (the peers
        # hear of these)
        self.routers = ServedRouters(store, retune, read_again)
        self.base = self.routers.base
        self._url = url
        self._lock = threading.RLock()  # one decision, adoption or step at a time
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.version: int | None = None  # the fleet's number of the version served, once known
        self.joined = False
        self.store_up: bool | None = None
        self.store_error: str | None = None
        self.view: FleetView | None = None  # the latest read of the store
        self.rounds = 0  # rounds this member's thread has ended
        self._wants: dict[tuple[str, str | None], WaitingAlert] = {}  # alerts waiting for the fleet's decision
        self._canary: CanaryJob | None = None
        self._held: str | None = None  # the fleet job whose lease this member holds: renewed by its own thread
        self._keeper: threading.Thread | None = None
        self._description = FleetDescription(store, self.base, self.name, settings)
        self._steps = RolloutStep(
            store,
            self.name,
            self.routers,
            retune,
            check=check,
            on_step=on_step,
            read_again=read_again,
            page=page,
            current=lambda: self.view.current.number if self.view is not None else "the last good one",
            heartbeat=lambda: self._heartbeat(self._read()),
            store_down=self._store_down,
        )

    @property
    def digest(self) -> str:
        """The digest of the routers serving here, as last computed (a round does not hash every tensor)."""
        return self.routers.digest

    # ------------------------------------------------------------------ life cycle
    def join(self) -> None:
        """Join the fleet and adopt its current version (before the routers are judged); a store that cannot be
        reached is joined by a later round."""
        with self._lock:
            try:
                self._join()
            except FleetStoreError as error:
                self._store_down(error)

    def _join(self) -> None:
        self.store.join(self.name, self.base, self.digest, self._url)
        self.store.release(self.name)  # a lease held under this name was held by this replica before a restart
        self.joined = True
        view = self._read()
        self._converge(view, why="joining the fleet")
        self._heartbeat(self._read())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mla-watch-fleet", daemon=True)
        self._thread.start()
        # Renewals apart from the rounds: a round taking a rollout step (a swap, a reading through an engine) may
        # run past the lease.
        self._keeper = threading.Thread(target=self._keep_lease, name="mla-watch-fleet-lease", daemon=True)
        self._keeper.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Leave the fleet's rounds; ``timeout``: the seconds this may wait for a round under way (one still running
        then is left to end with the process; its lease is released here)."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        for thread in (self._thread, self._keeper):
            if thread is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        # A job of this replica is abandoned, a rollout it coordinates is taken over: at once, not at expiry.
        with contextlib.suppress(FleetStoreError):
            self.store.release(self.name)
        self.store.close()

    def _keep_lease(self) -> None:
        while not self._stop.wait(self.settings.poll_seconds):
            job = self._held
            try:
                if self._steps.stepping:
                    self.store.touch(self.name)
                if (
                    job is not None
                    and not self.store.renew(self.name, job, self.settings.lease_seconds)
                    and self._held == job
                ):
                    log.error("fleet job %s: this replica lost the fleet's re-tuning lease (not renewed in time)", job)
                    self._held = None
            except FleetStoreError as error:
                self._store_down(error)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self.rounds += 1
            self._wake.wait(self.settings.poll_seconds)
            self._wake.clear()

    def tick(self) -> None:
        """One round: heartbeat, converge, the canary's job, coordination, this member's step, waiting alerts."""
        with self._lock:
            try:
                if not self.joined:
                    self._join()
                view = self._read()
                self._steps.record_unrecorded()
                if self._converge(view, why="the fleet's version"):
                    view = self._read()
                self._heartbeat(view)
                self._watch_canary()
                self._coordinate(view)
                # its claim is checked against the rollout as stored: an older view is safe
                self._steps.step(view, busy=self._busy())
                self._retry_wants()
            except FleetStoreError as error:
                self._store_down(error)
            except Exception:  # a round must never end the member's thread
                log.exception("a fleet round failed")

    # ------------------------------------------------------------------ the store's state
    def _read(self) -> FleetView:
        view = self.store.view(self.base)
        self.view = view
        if self.store_up is not True:
            if self.store_up is False:
                log.warning("the fleet store %s answers again: re-tuning goes on", self.store.where)
            self.store_up, self.store_error = True, None
            self._on_store(True, None)
        return view

    def _store_down(self, error: FleetStoreError) -> None:
        if self.store_up is not False:
            log.error(
                "%s; serving, counting and alerting go on, re-tuning waits for the store (no replica repairs alone)",
                error,
            )
        self.store_up, self.store_error = False, str(error)
        self._on_store(False, str(error))

    def status(self) -> dict[str, Any]:
        """What ``/readyz`` and ``/v1/status`` say of this member."""
        return {
            "name": self.name,
            "store": self.store.where,
            "store_up": self.store_up,
            "store_error": self.store_error,
            "joined": self.joined,
            "base": self.base,
            "digest": self.digest,
            "version": self.version,
            "waiting_alerts": sorted({router for router, _ in self._wants}),
            "canary_job": None if self._canary is None else self._canary.fleet_job,
            "rounds": self.rounds,
        }

    def _heartbeat(self, view: FleetView) -> None:
        self.version = view.version_of(self.digest)
        self.store.heartbeat(self.name, self.digest, self.version, self._health())
        self._on_serving(self.version, self.digest)

    def _target(self, view: FleetView) -> VersionRow:
        """The version the fleet says this member serves: a rollout's version once it passed its step there (unless
        the rollout was aborted), else the base's current version."""
        rollout = view.rollout
        if rollout is not None and rollout.state in ("rolling", "halted", "done") and rollout.version not in view.bad:
            step = rollout.step(self.name)
            if step is not None and step.outcome == "passed" and rollout.version != view.current.number:
                found = self.store.version(self.base, rollout.version)
                if found is not None:
                    return found
        return view.current

    def _busy(self) -> bool:
        return self._canary is not None

    # ------------------------------------------------------------------ versions: full state, adopting
    def full_state(self, number: int) -> dict[str, np.ndarray]:
        """The router tensors of fleet version ``number`` (:meth:`ServedRouters.full_state`)."""
        return self.routers.full_state(number)

    def _converge(self, view: FleetView, *, why: str) -> bool:
        """Adopt the version the fleet says this member serves, if it serves another; whether it changed."""
        if self._busy():
            return False
        return self.routers.converge(self._target(view), view, why=why)

    # ------------------------------------------------------------------ one decision
    def on_model_alert(self, action: Any) -> str:
        """A model-caused alert's ``retune`` action: the fleet decides; what became of it (the page's ``retune``)."""
        labels = action.alert.labels
        router, line = labels.get(ROUTER, ""), labels.get(BUSINESS_LINE)
        want = WaitingAlert(router, None if line in (None, "", "all") else line, action)
        if not self._lock.acquire(timeout=_DECIDE_WAIT_SECONDS):
            self._wants[want.key] = want
            self._wake.set()
            want.note = notes.busy_note(router)
            return want.note
        try:
            return self._decide(want)
        finally:
            self._lock.release()

    def _decide(self, want: WaitingAlert, *, first: bool = True) -> str:
        self._wants[want.key] = want
        if self.store_up is False and first:  # no connection attempt in the alert's path: the rounds retry
            want.note = notes.store_down_note(self.store_error)
            self._wake.set()
            return want.note
        try:
            view = self._read()
            want.note = self._decide_with(view, want, recompute_digest=first)
        except FleetStoreError as error:
            self._store_down(error)
            want.note = notes.store_down_note(error)
        except Exception as error:  # a swap refused, a version this replica cannot take: the page says so
            log.exception("the fleet's decision for %s failed", want.router)
            want.note = f"no re-tune job: the fleet's decision failed here: {type(error).__name__}: {str(error)[:300]}"
        return want.note

    def _decide_with(self, view: FleetView, want: WaitingAlert, *, recompute_digest: bool) -> str:
        router = want.router
        if self._canary is not None:
            return f"fleet re-tune job {self._canary.fleet_job} runs on this replica"
        if recompute_digest:  # damage done in place shows here, not in any version (a round reuses it: hashing
            self.routers.refresh()  # every router tensor each round would cost a large model)
        target = self._target(view)
        if self.digest != target.digest:
            self.routers.adopt(
                target,
                checked=True,
                why=f"{router} read damaged here, on routers that are not the fleet's version {target.number}",
            )
            self._forget(router)
            self._heartbeat(self._read())
            return notes.restored_note(target)
        healthy, damaged = peer_readings(
            view, router, name=self.name, base=self.base, digest=self.digest, settings=self.settings
        )
        if healthy and not damaged:
            self.routers.adopt(
                target,
                checked=True,
                force_routers=(router,),
                why=f"{router} read damaged here while {len(healthy)} replica(s) serving the same version read healthy",
            )
            self._forget(router)
            return notes.reapplied_note(target, healthy)
        spec = self.retune.alert_spec(want.action)
        decision = self.store.decide(
            self.name,
            self.base,
            spec.id,
            spec.routers,
            spec.business_line,
            cooldown_seconds=self.retune.settings.cooldown_seconds,
            lease_seconds=self.settings.lease_seconds,
        )
        if decision["decision"] == "lease":
            try:
                record = self.retune.submit(spec, force=True)
            except ValueError as error:
                self.store.finish_job(self.name, spec.id, "failed", tried=False, detail={"error": str(error)})
                return f"no re-tune job: {error}"
            self._canary = CanaryJob(spec.id, str(record["id"]), target.number)
            self._held = spec.id
            self._wants.pop(want.key, None)  # another line's alert on this router stays: it may be decided next
            log.info(
                "fleet re-tune job %s runs here (the canary) for %s; the other replicas take its version once "
                "it passes here",
                spec.id,
                router,
            )
            return notes.canary_note(spec.id, record.get("status"))
        return notes.waiting_note(decision)

    def _forget(self, router: str) -> None:
        """The alerts waiting on ``router``, of every line: this replica's routers were set right."""
        for key in [key for key in self._wants if key[0] == router]:
            del self._wants[key]

    def _retry_wants(self) -> None:
        for key, want in list(self._wants.items()):
            if not self._still_wanted(want.router, want.business_line):
                self._wants.pop(key, None)
                continue
            if self._canary is None:
                self._decide(want, first=False)

    # ------------------------------------------------------------------ the canary
    def _watch_canary(self) -> None:
        canary = self._canary
        if canary is None:
            return
        if self._held != canary.fleet_job or not self.store.renew(
            self.name, canary.fleet_job, self.settings.lease_seconds
        ):
            log.error(
                "fleet job %s: this replica lost the fleet's re-tuning lease (not renewed in time); its result "
                "will not be rolled out",
                canary.fleet_job,
            )
            self._canary = self._held = None
            return
        record = self.retune.store.get(canary.local_job)
        if record["status"] == "waiting":
            self._yield_for_data(canary, record)
            return
        if record["status"] not in FINAL_STATUSES:
            return
        if record["status"] != "promoted" or (record.get("result") or {}).get("version") is None:
            tried, detail = ended_without_version(canary, record)
            self.store.finish_job(self.name, canary.fleet_job, str(record["status"]), tried=tried, detail=detail)
            log.info(
                "fleet job %s ended %s on this replica, the canary: nothing is rolled out",
                canary.fleet_job,
                record["status"],
            )
            self._canary = self._held = None
            return
        self._publish(canary, record)

    def _yield_for_data(self, canary: CanaryJob, record: Mapping[str, Any]) -> None:
        """A canary job waiting for data of its line gives way to a waiting alert on the same router whose line's
        captured traffic holds more distinct texts: both ask for one repair, and a line whose traffic repeats one
        prompt would hold the fleet's lease for as long as a job may wait (on a replica alone, a job that lacks data
        holds no cooldown either). More distinct texts each time: two lines never hand the lease back and forth."""
        spec = record["spec"]
        line = spec.get("business_line")
        chosen = gives_way_to(self._wants.values(), spec["routers"], line, self._distinct_texts)
        if chosen is None:
            return
        other, distinct = chosen
        needs = str((record.get("result") or {}).get("needs") or "more data")[:300]
        reason = notes.gives_way_reason(canary.fleet_job, line, needs, other, distinct)
        if not self.retune.withdraw(canary.local_job, reason):
            return  # it runs now: it is watched again next round
        self.store.finish_job(
            self.name,
            canary.fleet_job,
            "superseded",
            tried=False,
            detail={"local_job": canary.local_job, "error": reason},
        )
        log.info("%s: the fleet decides again", reason)
        self._canary = self._held = None

    def _distinct_texts(self, line: str | None) -> int:
        capture = self.retune.retuner.capture
        if capture is None:
            return 0
        return distinct_count(capture.samples(line, limit=self.retune.settings.max_samples))

    def _publish(self, canary: CanaryJob, record: Mapping[str, Any]) -> None:
        result = record["result"]
        tensors = self.retune.versions.load(int(result["version"]))
        number, rollout = publish_canary(self.store, self.routers, self.settings, canary, record, tensors)
        self._canary = None
        self._on_step("passed")
        self.routers.refresh()
        log.info(
            "fleet version %d (%s) written by the canary; rollout %d starts (%d replica(s) at a time)",
            number,
            result.get("strategy"),
            rollout,
            self.settings.rollout_batch,
        )

    # ------------------------------------------------------------------ rollouts
    def _coordinate(self, view: FleetView) -> None:
        lease, job = view.lease, view.lease_job
        if lease.expired:
            taken = self.store.take_over(self.name, self.settings.lease_seconds)
            if taken is None:
                return
            log.warning("took over the rollout of fleet job %s from %s, whose lease expired", taken["id"], lease.holder)
            job = taken
        elif not (lease.held and lease.holder == self.name and job is not None and job["state"] == "rolling"):
            return
        self._held = job["id"]
        state = self.store.coordinate(self.name, job["id"], member_seconds=self.settings.member_seconds)
        if state != "rolling":
            self._held = None
        if state == "done":
            log.info("fleet job %s: every replica serves its version; it is the fleet's current version", job["id"])
        elif state in ("halted", "aborted"):
            log.warning("fleet job %s ended: its rollout was %s", job["id"], state)

    # ------------------------------------------------------------------ an operator's job or rollout
    def submit(self, spec: Any, *, force: bool) -> dict[str, Any]:
        """A job an operator asked for (``POST /admin/retune``, ``retune apply``): run here as the fleet's canary,
        under the fleet's lease (``force``: whatever the cooldown); :class:`FleetRefusal` when the fleet has a job or
        a rollout under way. The local job's record."""
        with self._lock:
            if self._canary is not None:
                raise FleetRefusal(f"fleet re-tune job {self._canary.fleet_job} runs on this replica: one at a time")
            target = self._target(self._read())
            decision = self.store.decide(
                self.name,
                self.base,
                spec.id,
                spec.routers,
                spec.business_line,
                cooldown_seconds=0 if force else self.retune.settings.cooldown_seconds,
                lease_seconds=self.settings.lease_seconds,
            )
            if decision["decision"] != "lease":
                job = decision.get("job") or {}
                raise FleetRefusal(
                    f"the fleet has re-tuning under way or cooling down ({decision['decision']}: job "
                    f"{job.get('id')}, {job.get('state')}, on {job.get('canary')}): see GET /v1/fleet"
                )
            try:
                record = self.retune.submit(spec, force=True)
            except ValueError as error:
                self.store.finish_job(self.name, spec.id, "failed", tried=False, detail={"error": str(error)})
                raise
            self._canary = CanaryJob(spec.id, str(record["id"]), target.number)
            self._held = spec.id
            return record

    def start_rollout(self, number: int) -> dict[str, Any]:
        """Roll fleet version ``number`` out from this replica (an operator's choice: a halted rollout resumed, or
        an earlier version put back): this replica takes it and checks it first, as a canary would. The rollout."""
        with self._lock:
            if self._busy():
                raise ValueError("this replica runs a fleet job now: try again once it ends")
            view = self._read()
            version, result = self._steps.take_first(number)
            parent = view.version_of(self.digest) if version.parent is None else version.parent
            self._held = None  # the operator's rollout takes the lease: its job is made by the store
            self.store.publish(
                self.name,
                None,
                self.base,
                parent=parent or 0,
                digest=version.digest,
                changes={},
                manifest=dict(version.manifest),
                batch=self.settings.rollout_batch,
                canary_detail={"reason": f"an operator's rollout: {result.reason}"},
                lease_seconds=self.settings.lease_seconds,
            )
            self._on_step("passed")
            self._heartbeat(self._read())
            assert self.view is not None and self.view.rollout is not None
            return self.view.rollout.as_dict()

    def abort(self, reason: str) -> dict[str, Any] | None:
        with self._lock:
            rollout = self.store.abort(self.base, reason)
            self._wake.set()
            return None if rollout is None else rollout.as_dict()

    def describe(self) -> dict[str, Any]:
        """``GET /v1/fleet``: the members, the current or last rollout, the lease, the versions. Read from the store
        at most once a second, whoever asks how often: an open endpoint must not become the store's load."""
        return self._description.describe()
