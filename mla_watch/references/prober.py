"""The reference prompts read on a schedule and on demand, and the cause of each routing alert judged from them.

:class:`ReferenceProber` reads every set of reference prompts (:mod:`mla_watch.references.prompts`) every
``interval_seconds``, and the sets of a business line whenever an alert on that line goes pending
(:meth:`ReferenceProber.request`, as the alert engine's :class:`~mla_watch.alerting.causes.CauseJudge`).
While the routers serving are known to be good, a set's reading is its healthy baseline (learned again when
another known-good router version serves). A set whose reading failed is read again ``retry_seconds`` later.

The cause of an alert on a router and a line (:meth:`ReferenceProber.judge`), from the line's sets read since
the alert went pending:

* ``model``: their routing departs from its healthy baseline by more than ``tolerance_bits`` of
  Jensen-Shannon divergence, or the alert's own rule breaches on them (judged against their baseline where
  the rule is relative to one): the same prompts through the same routers route the same way, so the routers
  changed;
* ``traffic``: they route as they did while healthy, and the rule holds on them: only what clients send
  changed; the clients whose share of the line moved most are named;
* ``undetermined``: no set describes the line, or no reading could be taken (the reason is said).

An alert that concerns positions short prompts do not reach (:mod:`mla_watch.references.reach`: a rule on
``long_context_drift``, any alert on a DSA indexer) is judged only by readings that reached them - the line's
sets or the long sets (``long: true``) - at those positions; while none reached them its cause is
``undetermined``, saying how far each set reaches. Long sets are read at start, every
``long_interval_seconds``, and when such an alert is due; a long reading that took ``T`` seconds is followed
by no other for ``T x (1 / long_share - 1)`` seconds, so that long sets take at most ``long_share`` of the
reader's time (the engine's prefill beside vLLM or SGLang; the model's here).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mla_watch.alerting.causes import Cause, undetermined
from mla_watch.references.judgement import cause_of, unreached
from mla_watch.references.prompts import ReferenceSet, ReferenceSets
from mla_watch.references.reach import Need, needed, reaches
from mla_watch.references.readers import ReadingDeferred, ReferenceReader
from mla_watch.references.readings import ReferenceBaseline, ReferenceBaselines, ReferenceReading, compare
from mla_watch.references.reference_settings import DEFAULT_TOLERANCE_BITS, ReferenceSettings
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.windows import ALL_LINES, RouterStats

__all__ = ["DEFAULT_TOLERANCE_BITS", "ReferenceProber", "ReferenceSettings"]

log = logging.getLogger("mla_watch.references")


class ReferenceProber:
    """Reads the reference prompts and judges the cause of routing alerts (see the module docstring).

    ``sets`` gives the sets in force; ``router_version`` the router version serving (``None``: not known);
    ``trusted(reading)`` is ``None`` when a reading may become its set's healthy baseline, else why not.
    ``clock`` is the alert engine's wall clock: readings are stamped with it.
    """

    def __init__(
        self,
        sets: Callable[[], ReferenceSets],
        reader: ReferenceReader,
        baselines: ReferenceBaselines,
        *,
        settings: ReferenceSettings | None = None,
        router_version: Callable[[], int | None] = lambda: None,
        trusted: Callable[[ReferenceReading], str | None] = lambda reading: None,
        clients: ClientShares | None = None,
        clock: Callable[[], float] = time.time,
        on_reading: Callable[[ReferenceReading], None] | None = None,
    ) -> None:
        self._sets = sets
        self.reader = reader
        self.baselines = baselines
        self.settings = settings or ReferenceSettings()
        self._router_version = router_version
        self._trusted = trusted
        self.clients = clients
        self._clock = clock
        self._on_reading = on_reading
        self._lock = threading.Lock()
        self._readings: dict[str, ReferenceReading] = {}
        self._failures: dict[str, tuple[float, str]] = {}  # set -> (when, why) of its last failed reading
        self._not_learning: dict[str, str] = {}  # set -> why its latest reading was not learned
        self._noted: dict[str, str] = {}  # set -> what its reading cuts or leaves out, said once
        self._wanted: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Held while a reading is recorded and learned: a stop waits for one under way, and none starts after it.
        self._recording = threading.Lock()
        self._thread: threading.Thread | None = None
        self._retry_at: dict[str, float] = {}  # a set whose reading failed, read again then (monotonic)
        self._long_free_at = 0.0  # no long set is read before then (monotonic): long_share of the reader's time
        self._long_last_seconds = 0.0  # how long the last round of long readings took
        self._deferred: set[str] = set()  # long sets asked for, read once they may be
        self.readings_taken = 0
        self.rounds_deferred = 0  # rounds stopped early: clients waited longer than usual

    @property
    def wait_seconds(self) -> float:
        return self.settings.wait_seconds

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mla-watch-reference", daemon=True)
        self._thread.start()

    def abandon(self) -> None:
        """Stop reading at once: no set is started again, the reader sends no further request, and a reading still in
        flight is discarded when it ends (never learned as a baseline, never recorded)."""
        recording = self._recording.acquire(timeout=1.0)  # a reading being recorded (a file write) ends first
        try:
            self._stop.set()
        finally:
            if recording:
                self._recording.release()
        self._wake.set()
        cancel = getattr(self.reader, "cancel", None)
        if cancel is not None:
            cancel()

    def stop(self, timeout: float = 60.0) -> None:
        """:meth:`abandon`, then wait up to ``timeout`` seconds for the reading thread (one blocked in an engine's
        answer is left to end with the process: what it would bring is discarded)."""
        self.abandon()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.info("the reference reading in flight through %s was abandoned at the stop", self.reader.where)

    def _run(self) -> None:
        interval, long_interval = self.settings.interval_seconds, self.settings.long_interval_seconds
        # Every set once at start, whatever the interval: a baseline learned while the routers are known good is what
        # later readings are compared with, and damage done in place later changes no router version.
        self._wanted |= set(self._sets().sets)
        started = time.monotonic()
        due = started + interval if interval else math.inf
        long_due = started + long_interval if long_interval else math.inf
        while not self._stop.is_set():
            with self._lock:
                next_at = min(
                    [due, long_due, *self._retry_at.values(), *([self._long_free_at] if self._deferred else [])]
                )
            timeout = None if next_at == math.inf else max(0.0, next_at - time.monotonic())
            if not self._wanted and (timeout is None or timeout > 0):
                self._wake.wait(timeout)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            sets = self._sets()
            with self._lock:
                asked, self._wanted = set(self._wanted), set()
                retries = {name for name, at in self._retry_at.items() if at <= now}
            periodic: set[str] = set()
            if now >= due:
                periodic |= {reference.name for reference in sets.for_line(None)}
                due = now + interval
            if now >= long_due:
                periodic |= {reference.name for reference in sets.long_sets()}
                long_due = now + long_interval
            names = self._pace_long(asked | retries | periodic, sets, now)
            # The sets a pending alert asked for first: its page waits for its own line's sets, not for a round.
            first = sorted(names & asked)
            try:
                self.read_now([*first, *sorted(names - set(first))], asked_first=True)
            except Exception:  # the prober must outlive whatever one round hits
                log.exception("reading the reference prompts failed")

    def _defer(self, names: list[str], why: str) -> None:
        """The sets ``names`` read ``retry_seconds`` from now: clients wait longer than usual (no failure: an alert
        asking meanwhile waits for them, within its wait)."""
        at = time.monotonic() + self.settings.retry_seconds
        with self._lock:
            for name in names:
                self._retry_at[name] = at
            self.rounds_deferred += 1
        log.info("reference prompts %s: read again in %g s (%s)", ", ".join(names), self.settings.retry_seconds, why)

    def _asked_first(self, order: list[str]) -> list[str]:
        """``order`` with the sets asked for since it was made ahead of the rest (long ones within their share)."""
        with self._lock:
            asked, self._wanted = set(self._wanted), set()
        if not asked:
            return order
        asked = self._pace_long(asked, self._sets(), time.monotonic())
        return [*sorted(asked), *(name for name in order if name not in asked)]

    def _pace_long(self, names: set[str], sets: ReferenceSets, now: float) -> set[str]:
        """``names`` less the long sets that may not be read yet (kept for when they may), plus those that now may."""
        long = {reference.name for reference in sets.long_sets()}
        with self._lock:
            if now < self._long_free_at:
                self._deferred |= names & long
                return names - long
            names, self._deferred = names | (self._deferred & long), set()
        return names

    # ------------------------------------------------------------------ readings
    def read_now(self, names: Sequence[str] | None = None, *, asked_first: bool = False) -> list[ReferenceReading]:
        """Read the sets ``names`` (every set for ``None``) now, in this thread; the readings taken. ``asked_first``:
        before each set, the sets an alert asked for meanwhile (:meth:`request`) go ahead of those left."""
        sets = self._sets().sets
        taken = []
        long_seconds = 0.0
        order = list(sets) if names is None else list(names)
        while order:
            if asked_first:
                order = self._asked_first(order)
            name = order.pop(0)
            reference = sets.get(name)
            if reference is None or self._stop.is_set():
                continue
            started = time.monotonic()
            try:
                reading = self._read(reference)
            except ReadingDeferred as deferred:  # clients first: this set and the rest of the round, later
                self._defer([name, *order], str(deferred))
                break
            if reference.long:
                long_seconds += time.monotonic() - started
            if reading is not None:
                taken.append(reading)
        if long_seconds:
            with self._lock:  # long readings take at most long_share of the reader's time
                self._long_last_seconds = long_seconds
                self._long_free_at = time.monotonic() + long_seconds * (1.0 / self.settings.long_share - 1.0)
        return taken

    def _read(self, reference: ReferenceSet) -> ReferenceReading | None:
        started = time.monotonic()
        # Stamped when it starts: the routers it reads are the ones serving then (the embedded reader copies them
        # first), so a reading begun before an alert went pending never speaks for that alert.
        taken_at = self._clock()
        version = self._router_version()
        yielding = getattr(self.reader, "yielding", None)  # beside an engine: clients first
        try:
            with contextlib.nullcontext() if yielding is None else yielding():
                score = self.reader.read(reference)
        except ReadingDeferred:
            raise
        except Exception as error:  # an engine restarting, a full queue: said when an alert asks
            if self._stop.is_set():  # abandoned at the stop: not a failure of the engine
                return None
            why = f"{type(error).__name__}: {str(error)[:300]}"
            with self._lock:
                self._failures[reference.name] = (self._clock(), why)
                self._retry_at[reference.name] = time.monotonic() + self.settings.retry_seconds
            log.warning(
                "the reference prompts of %s could not be read through %s (again in %g s): %s",
                reference.name,
                self.reader.where,
                self.settings.retry_seconds,
                why,
            )
            return None
        with self._recording:
            if self._stop.is_set():  # taken past the stop: its routers may be mid-swap, and nobody waits for it
                log.info(
                    "the reading of the reference prompts %s, ended after the stop began, is discarded", reference.name
                )
                return None
            return self._record(reference, taken_at, version, score, started)

    def _record(
        self, reference: ReferenceSet, taken_at: float, version: int | None, score: Any, started: float
    ) -> ReferenceReading:
        plan = self.reader.plan(reference)
        note = None if plan is None else plan.note
        if note is not None and note != self._noted.get(reference.name):
            self._noted[reference.name] = note
            log.warning("reference prompts %s read through %s: %s", reference.name, self.reader.where, note)
        reading = ReferenceReading(
            reference.name,
            reference.version,
            reference.digest,
            taken_at,
            version,
            score,
            time.monotonic() - started,
            note,
            reference.long,
        )
        with self._lock:
            self._readings[reference.name] = reading
            self._failures.pop(reference.name, None)
            self._retry_at.pop(reference.name, None)
            self.readings_taken += 1
        self._learn(reading)
        if self._on_reading is not None:
            try:
                self._on_reading(reading)
            except Exception:
                log.exception("a reference reading's consumer failed")
        return reading

    def _learn(self, reading: ReferenceReading) -> None:
        self.baselines.save_again()  # a save the disk refused earlier
        known = self.baselines.of(reading)
        if known is not None and known.router_version == reading.router_version:
            return
        why_not = self._trusted(reading)
        if why_not is None:
            self.baselines.put(ReferenceBaseline.of(reading))
            self._not_learning.pop(reading.set_name, None)
        elif self._not_learning.get(reading.set_name) != why_not:
            self._not_learning[reading.set_name] = why_not
            log.warning("reference prompts %s: their reading is not learned as healthy: %s", reading.set_name, why_not)

    def readings(self) -> dict[str, ReferenceReading]:
        with self._lock:
            return dict(self._readings)

    # ------------------------------------------------------------------ the alert engine's cause judge
    def request(self, business_line: str | None, since: float) -> None:
        names = {reference.name for reference in self._sets().for_line(business_line)}
        with self._lock:
            fresh = {
                name
                for name in names
                if (reading := self._readings.get(name)) is not None and reading.taken_at >= since
            }
            wanted = names - fresh
            self._wanted |= wanted
        if wanted:
            self._wake.set()

    def latest(self, business_line: str | None) -> float | None:
        sets = self._sets().for_line(business_line)
        with self._lock:
            times = [
                reading.taken_at
                for reference in sets
                if (reading := self._readings.get(reference.name)) is not None and reading.digest == reference.digest
            ]
        return min(times) if sets and len(times) == len(sets) else None

    def judge(self, rule: Any, record: RouterStats, since: float) -> Cause | None:
        line = record.line_label
        sets = self._sets().for_line(record.business_line)
        need = needed(rule, record)
        if need is not None:
            return self._judge_reach(rule, record, since, need, sets)
        if not sets:
            return undetermined(
                f"no reference prompts describe {line} (add {line}.yaml, or default.yaml, to the "
                "reference prompt directory)"
            )
        with self._lock:
            readings = [self._readings.get(reference.name) for reference in sets]
            failures = [self._failures.get(reference.name) for reference in sets]
        fresh = [
            reading
            for reading, reference in zip(readings, sets, strict=True)
            if reading is not None and reading.digest == reference.digest and reading.taken_at >= since
        ]
        if len(fresh) < len(sets):
            failed = [failure for failure in failures if failure is not None and failure[0] >= since]
            if failed:
                return undetermined(
                    f"the reference prompts of {line} could not be read through {self.reader.where}: {failed[0][1]}"
                )
            if self._thread is None or not self._thread.is_alive():
                return undetermined("no reference prompts are being read")
            self.request(record.business_line, since)
            return None
        comparison = compare(record.router, fresh, [self.baselines.of(r) for r in fresh])
        if comparison is None:
            return undetermined(f"the reading of the reference prompts holds no routing of {record.router.name}")
        return cause_of(rule, record, comparison, fresh, tolerance=self.settings.tolerance_bits, clients=self.clients)

    def _judge_reach(
        self, rule: Any, record: RouterStats, since: float, need: Need, line_sets: list[ReferenceSet]
    ) -> Cause | None:
        """The cause of an alert that concerns the positions ``need`` names: from the readings since ``since``, of
        the line's sets and the long sets, that reached them; ``None`` while one that may reach them is coming."""
        sets = [*line_sets, *self._sets().long_sets()]
        with self._lock:
            readings = {reference.name: self._readings.get(reference.name) for reference in sets}
            failures = {reference.name: self._failures.get(reference.name) for reference in sets}
        current = {
            name: reading
            for name, reading in readings.items()
            if reading is not None
            and any(reading.digest == reference.digest for reference in sets if reference.name == name)
        }
        fresh = [reading for reading in current.values() if reading.taken_at >= since]
        reached = [reading for reading in fresh if reaches(reading, need)]
        if reached:
            comparison = compare(
                record.router,
                reached,
                [self.baselines.of(r) for r in reached],
                from_position=need.start if need.by_position else None,
            )
            if comparison is None:
                return undetermined(
                    f"the readings of the reference prompts that reached {need.what} hold no "
                    f"routing of {record.router.name}"
                )
            tolerance = self.settings.tolerance_bits
            return cause_of(rule, record, comparison, reached, tolerance=tolerance, clients=self.clients, need=need)
        # A set not read since the alert began may reach them, unless its last reading, of the same prompts, did not.
        coming = [
            reference
            for reference in sets
            if not (
                (reading := current.get(reference.name)) is not None
                and (reading.taken_at >= since or not reaches(reading, need))
            )
        ]
        failed = [
            failure
            for reference in coming
            if (failure := failures.get(reference.name)) is not None and failure[0] >= since
        ]
        if failed:
            return undetermined(
                f"the reference prompts that may reach {need.what} could not be read through "
                f"{self.reader.where}: {failed[0][1]}"
            )
        if coming:
            wait = self._long_wait([reference for reference in coming if reference.long])
            if wait is not None:
                return undetermined(wait)
            if not self.read_soon({reference.name for reference in coming}):
                return undetermined("no reference prompts are being read")
            return None
        return undetermined(unreached(need, sets, current, where=self.reader.where, limit=self.reader.limit))

    def read_soon(self, names: set[str]) -> bool:
        """Have the sets ``names`` read soon, on the prober's thread (long ones within their share of the reader's
        time); ``False`` where no thread reads them."""
        if self._thread is None or not self._thread.is_alive():
            return False
        with self._lock:
            self._wanted |= names
        self._wake.set()
        return True

    def _long_wait(self, long_sets: list[ReferenceSet]) -> str | None:
        """Why ``long_sets`` cannot be read within the wait an alert is given (``None``: they can)."""
        if not long_sets:
            return None
        with self._lock:
            left, took = self._long_free_at - time.monotonic(), self._long_last_seconds
        if left <= self.settings.wait_seconds:
            return None
        names = ", ".join(f"{reference.name} v{reference.version}" for reference in long_sets)
        return (
            f"no reading since the alert began reached the positions it concerns, and the long reference prompts "
            f"({names}) are next read in {left:.0f} s: their last reading took {took:.1f} s, and long sets take "
            f"at most {self.settings.long_share:.0%} of {self.reader.where}'s time (--reference-long-share)"
        )

    # ------------------------------------------------------------------ what /v1/reference shows
    def describe(self) -> dict[str, Any]:
        with self._lock:
            readings, failures = dict(self._readings), dict(self._failures)
        sets = self._sets()
        out = []
        for name, reference in sets.sets.items():
            reading = readings.get(name)
            baseline = self.baselines.of(reading) if reading is not None else self.baselines.get(name, reference.digest)
            routers = []
            if reading is not None and reading.digest == reference.digest:
                for router in reading.score.routers.values():
                    comparison = compare(router.router, [reading], [baseline])
                    if comparison is None:
                        continue
                    routers.append(
                        {
                            "name": router.router.name,
                            "layer": router.router.layer,
                            "kind": router.router.kind,
                            **comparison.stats.as_dict(),
                            "healthy_entropy_bits": None
                            if comparison.baseline is None
                            else comparison.baseline.entropy_bits,
                            "changed": comparison.changed(self.settings.tolerance_bits),
                        }
                    )
            failure = failures.get(name)
            out.append(
                {
                    **reference.as_dict(),
                    "reading": None if reading is None else reading.summary(),
                    "baseline": None
                    if baseline is None
                    else {"taken_at": baseline.taken_at, "router_version": baseline.router_version},
                    "not_learning": self._not_learning.get(name),
                    "last_failure": None if failure is None else {"at": failure[0], "error": failure[1]},
                    "routers": routers,
                }
            )
        with self._lock:
            free_in = self._long_free_at - time.monotonic()
        return {
            "reader": self.reader.where,
            "interval_seconds": self.settings.interval_seconds,
            "wait_seconds": self.settings.wait_seconds,
            "tolerance_bits": self.settings.tolerance_bits,
            "rate": self.settings.rate,
            "readings_taken": self.readings_taken,
            "all_lines": ALL_LINES,
            "rounds_deferred": self.rounds_deferred,
            "priority": self.settings.priority,
            "prompt_tokens": self.reader.limit,
            "long_interval_seconds": self.settings.long_interval_seconds,
            "long_share": self.settings.long_share,
            "long_next_at": None if free_in <= 0 else round(self._clock() + free_in, 3),
            "sets": out,
        }
