"""A fleet member's step of a rollout: claimed in turn, the version swapped in and checked on the member's own
reference prompts and rules, kept or rolled back, on-call paged when it failed (the rollout halts), and the outcome
recorded in the store (again at the next round, where the store missed it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mla_watch.fleet.check import StepResult
from mla_watch.fleet.fleet_rows import FleetView, VersionRow
from mla_watch.fleet.fleet_store import FleetStore, FleetStoreError
from mla_watch.fleet.halted_page import halted_page
from mla_watch.fleet.served_routers import ServedRouters
from mla_watch.retune.service import RetuneService

__all__ = ["RolloutStep"]

log = logging.getLogger("mla_watch.fleet")


class RolloutStep:
    """Member ``name``'s steps of its base's rollouts. What it is handed: its ``routers`` (which take the version),
    ``retune`` (its router versions), ``check`` (a version's check here), ``on_step`` (each outcome), ``read_again``
    (the reference prompts, once a good version serves), ``page`` (on-call), ``current`` (the version the replicas
    not reached keep, for the page), ``heartbeat`` (the member's heartbeat after a step) and ``store_down`` (a
    store that failed)."""

    def __init__(
        self,
        store: FleetStore,
        name: str,
        routers: ServedRouters,
        retune: RetuneService,
        *,
        check: Callable[[Mapping[str, Any]], StepResult],
        on_step: Callable[[str], None],
        read_again: Callable[[], None],
        page: Callable[[dict[str, str], dict[str, str]], None],
        current: Callable[[], int | str],
        heartbeat: Callable[[], None],
        store_down: Callable[[FleetStoreError], None],
    ) -> None:
        self.store = store
        self.name = name
        self.routers = routers
        self.retune = retune
        self._check = check
        self._on_step = on_step
        self._read_again = read_again
        self._page = page
        self._current = current
        self._heartbeat = heartbeat
        self._store_down = store_down
        self.stepping = False  # a step under way: the member's lease keeper says it is alive meanwhile
        self._unrecorded: tuple[int, str, dict[str, Any]] | None = None  # a step whose outcome the store missed

    def step(self, view: FleetView, *, busy: bool) -> None:
        """This member's step of ``view``'s rolling rollout, when it is its turn (never while ``busy``)."""
        rollout = view.rollout
        if rollout is None or rollout.state != "rolling" or busy or rollout.version in view.bad:
            return
        mine = rollout.step(self.name)
        if mine is not None and mine.outcome != "lost":
            return
        version = self.store.version(self.routers.base, rollout.version)
        if version is None or not self.store.claim_step(self.name, rollout.id):
            return
        self.stepping = True
        try:
            self._take_step(rollout.id, version)
        finally:
            self.stepping = False

    def take_first(self, number: int) -> tuple[VersionRow, StepResult]:
        """An operator's rollout of fleet version ``number`` from this member: taken and checked here first, as a
        canary would (``ValueError``, rolled back, when it fails). The version and its check."""
        version = self.store.version(self.routers.base, number)
        if version is None:
            raise ValueError(f"fleet version {number} does not exist for this replica's checkpoint")
        local = self.routers.adopt(version, checked=False, why=f"an operator's rollout of version {number}")
        result = self._check(version.manifest) if number else StepResult(True, "version 0 is the checkpoint")
        if not result.passed:
            if local is not None:
                self.retune.rollback()
                self.routers.refresh()
            raise ValueError(f"fleet version {number} failed its check on this replica: {result.reason}")
        if local is not None:
            self.retune.versions.update_manifest(local, {"gates": {"passed": True, "fleet": result.reason}})
        return version, result

    def _take_step(self, rollout_id: int, version: VersionRow) -> None:
        started = time.monotonic()
        log.info("rollout %d: this replica takes fleet version %d", rollout_id, version.number)
        previous_digest = self.routers.digest
        try:
            local = self.routers.adopt(version, checked=False, why=f"rollout {rollout_id}")
        except Exception as error:  # a swap the engine refused: the step fails, nothing changed here
            self._end_step(
                rollout_id,
                version,
                "failed",
                {"reason": f"the swap failed: {type(error).__name__}: {str(error)[:300]}"},
                started,
            )
            return
        result = self._check(version.manifest)
        detail = {**result.as_dict(), "local_version": local, "seconds": round(time.monotonic() - started, 3)}
        if result.passed:
            if local is not None:
                self.retune.versions.update_manifest(local, {"gates": {"passed": True, "fleet": result.reason}})
                self._read_again()  # now a good version: its readings become the baselines, and the peers hear
            self._end_step(rollout_id, version, "passed", detail, started)
            return
        if local is not None:
            self.retune.rollback()
            digest = self.routers.refresh()
            if digest != previous_digest:
                log.error(
                    "rollout %d: the rollback left digest %s, not %s",
                    rollout_id,
                    digest[:12],
                    previous_digest[:12],
                )
        self._end_step(rollout_id, version, "failed", detail, started)

    def _end_step(
        self, rollout: int, version: VersionRow, outcome: str, detail: dict[str, Any], started: float
    ) -> None:
        self._on_step(outcome)
        if outcome == "failed":
            log.error(
                "rollout %d halted: fleet version %d failed its check on this replica (%s): %s; the replicas "
                "not reached keep the fleet's current version",
                rollout,
                version.number,
                self.name,
                detail.get("reason"),
            )
            self._page_halted(rollout, version, str(detail.get("reason")))
        else:
            log.info(
                "rollout %d: fleet version %d passed its check here in %.1f s",
                rollout,
                version.number,
                time.monotonic() - started,
            )
        self._unrecorded = (rollout, outcome, detail)
        self.record_unrecorded()
        try:
            self._heartbeat()
        except FleetStoreError as error:
            self._store_down(error)

    def record_unrecorded(self) -> None:
        """Record a step's outcome the store missed (it could not be reached then)."""
        if self._unrecorded is None:
            return
        rollout, outcome, detail = self._unrecorded
        try:
            self.store.end_step(self.name, rollout, outcome, detail)
        except FleetStoreError as error:
            self._store_down(error)
            return
        self._unrecorded = None

    def _page_halted(self, rollout: int, version: VersionRow, reason: str) -> None:
        labels, annotations = halted_page(rollout, version, self.name, self._current(), reason)
        try:
            self._page(labels, annotations)
        except Exception:
            log.exception("the page for halted rollout %d could not be queued", rollout)
