"""The reference prompts read on a schedule and on demand, and the cause of each routing alert judged from them.

:class:`ReferenceProber` reads every set of reference prompts (:mod:`mla_watch.cause.prompts`) every
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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mla_watch.alerting.causes import Cause, undetermined
from mla_watch.alerting.model import breached, judged_window
from mla_watch.cause.prompts import ReferenceSet, ReferenceSets
from mla_watch.cause.readers import ReferenceReader
from mla_watch.cause.readings import ReferenceBaseline, ReferenceBaselines, ReferenceReading, RouterComparison, compare
from mla_watch.common.values import is_number
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.windows import ALL_LINES, RouterStats

__all__ = ["DEFAULT_TOLERANCE_BITS", "ReferenceProber", "ReferenceSettings"]

log = logging.getLogger("mla_watch.cause")

# The same prompts through the same routers route identically on the model served here (JS 0); an engine's
# batching moves a few near-tied picks (measured on the real vLLM: bench/traffic_or_damage.py). The faults
# mla_watch pages for move the reference routing by 0.05 bits and more.
DEFAULT_TOLERANCE_BITS = 0.01


@dataclass(frozen=True)
class ReferenceSettings:
    interval_seconds: float = 300.0  # every set read this often (0: at start, then only on demand)
    wait_seconds: float = 120.0  # an alert due to fire waits this long past its `for` for the reading it asked for
    tolerance_bits: float = DEFAULT_TOLERANCE_BITS  # JS from the set's baseline beyond which the model changed
    rate: float = 16.0  # reference prompts a second, at most, to an engine beside the sidecar
    retry_seconds: float = 30.0  # a set whose reading failed (an engine restarting, a full queue) is read again then

    def problems(self) -> list[str]:
        checks = [("--reference-interval", self.interval_seconds, self.interval_seconds >= 0, "seconds >= 0"),
                  ("--reference-wait", self.wait_seconds, self.wait_seconds >= 0, "seconds >= 0"),
                  ("--reference-tolerance", self.tolerance_bits, 0 <= self.tolerance_bits < 1, "bits in [0, 1)"),
                  ("--reference-rate", self.rate, self.rate > 0, "prompts a second > 0")]
        return [f"{flag} {value!r}: expected {expected}" for flag, value, ok, expected in checks
                if not (is_number(value, finite=True) and ok)]


class ReferenceProber:
    """Reads the reference prompts and judges the cause of routing alerts (see the module docstring).

    ``sets`` gives the sets in force; ``router_version`` the router version serving (``None``: not known);
    ``trusted(reading)`` is ``None`` when a reading may become its set's healthy baseline, else why not.
    ``clock`` is the alert engine's wall clock: readings are stamped with it.
    """

    def __init__(self, sets: Callable[[], ReferenceSets], reader: ReferenceReader, baselines: ReferenceBaselines, *,
                 settings: ReferenceSettings | None = None, router_version: Callable[[], int | None] = lambda: None,
                 trusted: Callable[[ReferenceReading], str | None] = lambda reading: None,
                 clients: ClientShares | None = None, clock: Callable[[], float] = time.time,
                 on_reading: Callable[[ReferenceReading], None] | None = None) -> None:
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
        self._wanted: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._retry_at: dict[str, float] = {}  # a set whose reading failed, read again then (monotonic)
        self.readings_taken = 0

    @property
    def wait_seconds(self) -> float:
        return self.settings.wait_seconds

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mla-watch-reference", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        interval = self.settings.interval_seconds
        # Every set once at start, whatever the interval: a baseline learned while the routers are known good is what
        # later readings are compared with, and damage done in place later changes no router version.
        self._wanted |= set(self._sets().sets)
        due = time.monotonic() + interval if interval else math.inf
        while not self._stop.is_set():
            with self._lock:
                next_at = min([due, *self._retry_at.values()])
            timeout = None if next_at == math.inf else max(0.0, next_at - time.monotonic())
            if not self._wanted and (timeout is None or timeout > 0):
                self._wake.wait(timeout)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with self._lock:
                names, self._wanted = set(self._wanted), set()
                retries = {name for name, at in self._retry_at.items() if at <= now}
            names |= retries
            if now >= due:
                names |= set(self._sets().sets)
                due = now + interval
            try:
                self.read_now(sorted(names))
            except Exception:  # the prober must outlive whatever one round hits
                log.exception("reading the reference prompts failed")

    # ------------------------------------------------------------------ readings
    def read_now(self, names: Sequence[str] | None = None) -> list[ReferenceReading]:
        """Read the sets ``names`` (every set for ``None``) now, in this thread; the readings taken."""
        sets = self._sets().sets
        taken = []
        for name in (list(sets) if names is None else names):
            reference = sets.get(name)
            if reference is None:
                continue
            reading = self._read(reference)
            if reading is not None:
                taken.append(reading)
        return taken

    def _read(self, reference: ReferenceSet) -> ReferenceReading | None:
        started = time.monotonic()
        # Stamped when it starts: the routers it reads are the ones serving then (the embedded reader copies them
        # first), so a reading begun before an alert went pending never speaks for that alert.
        taken_at = self._clock()
        version = self._router_version()
        try:
            score = self.reader.read(reference)
        except Exception as error:  # an engine restarting, a full queue: said when an alert asks
            why = f"{type(error).__name__}: {str(error)[:300]}"
            with self._lock:
                self._failures[reference.name] = (self._clock(), why)
                self._retry_at[reference.name] = time.monotonic() + self.settings.retry_seconds
            log.warning("the reference prompts of %s could not be read through %s (again in %g s): %s",
                        reference.name, self.reader.where, self.settings.retry_seconds, why)
            return None
        reading = ReferenceReading(reference.name, reference.version, reference.digest, taken_at, version,
                                   score, time.monotonic() - started)
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
        known = self.baselines.get(reading.set_name, reading.digest)
        if known is not None and known.router_version == reading.router_version:
            return
        why_not = self._trusted(reading)
        if why_not is None:
            self.baselines.put(ReferenceBaseline.of(reading))
            self._not_learning.pop(reading.set_name, None)
        elif self._not_learning.get(reading.set_name) != why_not:
            self._not_learning[reading.set_name] = why_not
            log.warning("reference prompts %s: their reading is not learned as healthy: %s", reading.set_name,
                        why_not)

    def readings(self) -> dict[str, ReferenceReading]:
        with self._lock:
            return dict(self._readings)

    # ------------------------------------------------------------------ the alert engine's cause judge
    def request(self, business_line: str | None, since: float) -> None:
        names = {reference.name for reference in self._sets().for_line(business_line)}
        with self._lock:
            fresh = {name for name in names
                     if (reading := self._readings.get(name)) is not None and reading.taken_at >= since}
            wanted = names - fresh
            self._wanted |= wanted
        if wanted:
            self._wake.set()

    def latest(self, business_line: str | None) -> float | None:
        sets = self._sets().for_line(business_line)
        with self._lock:
            times = [reading.taken_at for reference in sets
                     if (reading := self._readings.get(reference.name)) is not None
                     and reading.digest == reference.digest]
        return min(times) if sets and len(times) == len(sets) else None

    def judge(self, rule: Any, record: RouterStats, since: float) -> Cause | None:
        line = record.line_label
        sets = self._sets().for_line(record.business_line)
        if not sets:
            return undetermined(f"no reference prompts describe {line} (add {line}.yaml, or default.yaml, to the "
                                "reference prompt directory)")
        with self._lock:
            readings = [self._readings.get(reference.name) for reference in sets]
            failures = [self._failures.get(reference.name) for reference in sets]
        fresh = [reading for reading, reference in zip(readings, sets, strict=True)
                 if reading is not None and reading.digest == reference.digest and reading.taken_at >= since]
        if len(fresh) < len(sets):
            failed = [failure for failure in failures if failure is not None and failure[0] >= since]
            if failed:
                return undetermined(f"the reference prompts of {line} could not be read through {self.reader.where}:"
                                    f" {failed[0][1]}")
            if self._thread is None or not self._thread.is_alive():
                return undetermined("no reference prompts are being read")
            self.request(record.business_line, since)
            return None
        comparison = compare(record.router, fresh, [self.baselines.get(r.set_name, r.digest) for r in fresh])
        if comparison is None:
            return undetermined(f"the reading of the reference prompts holds no routing of {record.router.name}")
        return self._cause(rule, record, comparison, fresh)

    def _cause(self, rule: Any, record: RouterStats, comparison: RouterComparison,
               readings: list[ReferenceReading]) -> Cause:
        tolerance = self.settings.tolerance_bits
        changed = comparison.changed(tolerance)
        breach = _rule_breach(rule, comparison)
        metric = rule.metric
        value = getattr(comparison.stats, metric)
        healthy = None if comparison.baseline is None else getattr(comparison.baseline, metric)
        js = comparison.stats.js_divergence if comparison.baseline is not None else None
        sets = ", ".join(f"{reading.set_name} v{reading.set_version}" for reading in readings)
        figures = (f"{record.router.name} reads {metric} {_number(value)} on them"
                   + (f" ({_number(healthy)} while healthy)" if healthy is not None else "")
                   + (f", {js:.4f} bits (Jensen-Shannon) from their healthy routing, tolerance {tolerance:g}"
                      if js is not None else ", with no healthy baseline of them yet"))
        details: dict[str, Any] = {
            "sets": [reading.summary() for reading in readings], "router": record.router.name, "metric": metric,
            "value": _json_number(value), "healthy": _json_number(healthy), "js_bits": _json_number(js),
            "tolerance_bits": tolerance, "rule_breached": breach, "changed": changed}
        reading_at = min(reading.taken_at for reading in readings)
        if changed or breach:
            why = "route differently now" if changed else f"breach {rule.name} too"
            return Cause("model", f"the reference prompts ({sets}) {why}: {figures}", reading_at, details)
        if changed is None and breach is None:
            return Cause("undetermined", f"the reference prompts ({sets}) cannot tell: {figures}, and {rule.name} "
                         "cannot judge them", reading_at, details)
        summary = f"the reference prompts ({sets}) route as while healthy: {figures}; what changed is the traffic"
        if self.clients is not None:
            movers = self.clients.movers(record.business_line)
            details["clients"] = [mover.as_dict() for mover in movers]
            if movers:
                summary += ": " + "; ".join(mover.describe() for mover in movers)
        return Cause("traffic", summary, reading_at, details)

    # ------------------------------------------------------------------ what /v1/reference shows
    def describe(self) -> dict[str, Any]:
        with self._lock:
            readings, failures = dict(self._readings), dict(self._failures)
        sets = self._sets()
        out = []
        for name, reference in sets.sets.items():
            reading = readings.get(name)
            baseline = self.baselines.get(name, reference.digest)
            routers = []
            if reading is not None and reading.digest == reference.digest:
                for router in reading.score.routers.values():
                    comparison = compare(router.router, [reading], [baseline])
                    if comparison is None:
                        continue
                    routers.append({"name": router.router.name, "layer": router.router.layer,
                                    "kind": router.router.kind, **comparison.stats.as_dict(),
                                    "healthy_entropy_bits": None if comparison.baseline is None
                                    else comparison.baseline.entropy_bits,
                                    "changed": comparison.changed(self.settings.tolerance_bits)})
            failure = failures.get(name)
            out.append({**reference.as_dict(), "reading": None if reading is None else reading.summary(),
                        "baseline": None if baseline is None else {"taken_at": baseline.taken_at,
                                                                   "router_version": baseline.router_version},
                        "not_learning": self._not_learning.get(name),
                        "last_failure": None if failure is None else {"at": failure[0], "error": failure[1]},
                        "routers": routers})
        return {"reader": self.reader.where, "interval_seconds": self.settings.interval_seconds,
                "wait_seconds": self.settings.wait_seconds, "tolerance_bits": self.settings.tolerance_bits,
                "rate": self.settings.rate, "readings_taken": self.readings_taken, "all_lines": ALL_LINES,
                "sets": out}


def _rule_breach(rule: Any, comparison: RouterComparison) -> bool | None:
    """Whether ``rule`` breaches on the reference reading (its levels from their baseline where it is relative
    to one); ``None`` when it cannot judge it (a slope, a metric not measured, a reading under its minimum)."""
    trend = getattr(rule, "trend", None)
    if trend is not None and trend.kind == "slope":
        return None
    stats = comparison.stats
    value = getattr(stats, rule.metric, None)
    if value is None or value != value or not judged_window(stats.tokens, rule.min_tokens, stats.min_tokens):
        return None
    healthy = None if comparison.baseline is None else getattr(comparison.baseline, rule.metric, None)
    levels = rule.levels(healthy)
    if levels is None:
        return None
    return breached(float(value), levels[0], levels[1])


def _number(value: Any) -> str:
    return "n/a" if value is None or value != value else f"{float(value):.3f}"


def _json_number(value: Any) -> float | None:
    return None if value is None or value != value else round(float(value), 6)
