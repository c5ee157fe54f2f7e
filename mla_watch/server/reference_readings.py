"""The reference prompts as ``serve`` runs them: the sets in force, the prober reading them through the model
served here or the engine beside, and what their readings feed (the alert engine's causes, the metrics, the
routing history under the line ``reference:<set>``).

:class:`References` is built with the sidecar (the sets are validated at start-up like policies) and starts its
prober once a reader exists: after the model loaded, or at once beside vLLM / SGLang.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mla_watch.alerting.causes import Cause, undetermined
from mla_watch.common.directory_store import DirectoryStore
from mla_watch.common.state_writes import StateWrites
from mla_watch.engines.backends import SWAPPING_ENGINES, engine_weights
from mla_watch.references.client_load import ClientLatency
from mla_watch.references.gate import ReferenceGate
from mla_watch.references.prober import ReferenceProber
from mla_watch.references.prompts import ReferenceSets, load_reference_dir
from mla_watch.references.readers import EngineReader, ModelReader, ReferenceReader
from mla_watch.references.readings import BASELINE_FILE, ReferenceBaselines, ReferenceReading, compare
from mla_watch.references.representative import BaselineCheck
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.windows import RouterStats

if TYPE_CHECKING:
    from mla_watch.alerting.alert_service import AlertService
    from mla_watch.retune.service import RetuneService
    from mla_watch.server.config import ServerConfig

__all__ = ["REFERENCE_LINE_PREFIX", "References"]

log = logging.getLogger("mla_watch.server")

REFERENCE_LINE_PREFIX = "reference:"  # the history's line of a set's readings: no business line has a ':'


class References:
    """The reference prompts, their baselines and their prober (once started); the alert engine's cause judge
    (:class:`~mla_watch.alerting.causes.CauseJudge`): the prober's answers once it runs, ``undetermined`` (and
    why) before, or where none can run."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        clients: ClientShares,
        alerts: AlertService | None,
        writes: StateWrites | None = None,
        client_latency: ClientLatency | None = None,
    ) -> None:
        self.config = config
        self.client_latency = client_latency  # beside an engine: readings wait while clients wait longer than usual
        self.clients = clients
        self.alerts = alerts
        self._latest: dict[str, list[RouterStats]] = {}  # set -> its latest reading's records, for the history
        self.sets: DirectoryStore[ReferenceSets] = DirectoryStore(
            config.reference_prompts, load_reference_dir, what="reference prompts"
        )  # ReferenceSetError
        self.baselines = ReferenceBaselines(config.state_dir / BASELINE_FILE, writes=writes)
        self.gate = ReferenceGate(lambda: self.sets.current, self.baselines)  # what every re-tune candidate meets
        self.prober: ReferenceProber | None = None
        self.baseline_check: BaselineCheck | None = None  # the learned baselines judged after each reading
        self._engine_reader: EngineReader | None = None
        self.unavailable: str | None = "the reference prompts are read once the model is loaded"
        self._router_version: Callable[[], int | None] = lambda: None

    # ------------------------------------------------------------------ starting
    def start_local(self, model: Any, tokenizer: Any, model_lock: Any, retune: RetuneService | None) -> None:
        """Read them through the model served here; healthy while its router version is known good."""

        def trusted(reading: ReferenceReading) -> str | None:
            return _not_known_good(retune)

        self._start(ModelReader(model, tokenizer, model_lock), retune, trusted)

    def engine_reader(self, geometry: Any) -> EngineReader | None:
        """The reader of the engine beside (vLLM or SGLang), made once: the prober and engine re-tune gates share its
        pace; ``None`` beside another engine."""
        config = self.config
        if config.engine not in SWAPPING_ENGINES:  # an engine without a weight backend: its prompts cannot be read
            return None
        if self._engine_reader is None:
            assert config.upstream is not None  # beside an engine: --upstream
            weights = engine_weights(
                config.engine,
                config.upstream,
                timeout=max(config.request_timeout, 60.0),
                geometry=geometry,
                api_key=os.environ.get("MLA_WATCH_ENGINE_API_KEY"),
            )
            assert weights is not None  # a swapping engine's
            weights.priority = config.reference.priority  # scoring yields to clients in vLLM's priority scheduler
            latency = self.client_latency
            self._engine_reader = EngineReader(
                weights,
                geometry,
                rate=config.reference.rate,
                max_tokens=config.reference.max_tokens,
                busy=None if latency is None else latency.busy,
            )
        return self._engine_reader

    def start_engine(self, geometry: Any, retune: RetuneService | None) -> None:
        """Read them through vLLM or SGLang beside; healthy while no threshold rule breaches on them (no start-up
        check of the engine's routers runs otherwise) and, with engine re-tuning, the router version is good."""
        reader = self.engine_reader(geometry)
        if reader is None:
            self.unavailable = (
                f"the reference prompts are read through vLLM or SGLang (--engine "
                f"{'|'.join(SWAPPING_ENGINES)}), not "
                f"{self.config.engine}: the cause of a routing alert cannot be told"
            )
            log.warning(self.unavailable)
            return
        alerts = self.alerts

        def trusted(reading: ReferenceReading) -> str | None:
            from mla_watch.retune.health import judge_health

            health = judge_health(reading.score, alerts.rules.rules if alerts is not None else [])
            # Version 0 beside an engine is recorded before the engine can be read: its start-up health check is
            # the first reading of a reference set on which no rule breaches (a set of odd texts that breaches on a
            # healthy model must not condemn it; a damaged router breaches on every set).
            if (
                retune is not None
                and reading.router_version == 0
                and health.get("passed")
                and retune.versions.record_initial_health(
                    {**health, "source": f"the reference prompts ({reading.set_name}) read through the engine"}
                )
            ):
                log.info(
                    "router version 0 (the engine's routers served now) passed its start-up health check on the "
                    "reference prompts (%s): %s",
                    reading.set_name,
                    health.get("reason"),
                )
            if health.get("checked") and not health.get("passed"):
                return f"the engine's routers breach the alert rules on them: {health.get('reason')}"
            return _not_known_good(retune) if retune is not None else None

        self._start(reader, retune, trusted)

    def _start(
        self, reader: ReferenceReader, retune: RetuneService | None, trusted: Callable[[ReferenceReading], str | None]
    ) -> None:
        def version() -> int | None:
            return None if retune is None else retune.versions.live_version()

        self._router_version = version
        self.prober = ReferenceProber(
            lambda: self.sets.current,
            reader,
            self.baselines,
            settings=self.config.reference,
            router_version=version,
            trusted=trusted,
            clients=self.clients,
            on_reading=self._recorded,
        )
        self.unavailable = None
        self.prober.start()
        sets, settings = self.sets.current, self.config.reference
        log.info(
            "reference prompts: %d sets read through %s every %g s and whenever a routing alert goes pending; "
            "the long sets (%d) every %g s and when an alert on far positions is due, within %g of its time; "
            "%d tokens a prompt",
            len(sets.for_line(None)),
            reader.where,
            settings.interval_seconds,
            len(sets.long_sets()),
            settings.long_interval_seconds,
            settings.long_share,
            reader.limit,
        )

    # ------------------------------------------------------------------ the cause judge
    @property
    def wait_seconds(self) -> float:
        return self.config.reference.wait_seconds

    def request(self, business_line: str | None, since: float) -> None:
        if self.prober is not None:
            self.prober.request(business_line, since)

    def latest(self, business_line: str | None) -> float | None:
        return None if self.prober is None else self.prober.latest(business_line)

    def judge(self, rule: Any, record: RouterStats, since: float) -> Cause | None:
        if self.prober is None:
            return undetermined(self.unavailable or "no reference prompts are read here")
        return self.prober.judge(rule, record, since)

    def abandon(self) -> None:
        """Stop reading at once (a stop began): a reading in flight is discarded, none is learned from now on."""
        if self.prober is not None:
            self.prober.abandon()

    def stop(self, timeout: float = 60.0) -> None:
        if self.prober is not None:
            self.prober.stop(timeout)

    # ------------------------------------------------------------------ what readings feed
    def _recorded(self, reading: ReferenceReading) -> None:
        baseline = self.baselines.of(reading)
        records = []
        for record in reading.score.routers.values():
            comparison = compare(record.router, [reading], [baseline])
            if comparison is not None:
                records.append(
                    RouterStats(
                        record.router, REFERENCE_LINE_PREFIX + reading.set_name, comparison.stats, record.counts
                    )
                )
        self._latest[reading.set_name] = records
        if self.baseline_check is not None:
            self.baseline_check.after(reading, baseline)

    def router_health(self) -> dict[str, dict[str, Any]]:
        """Each expert router as the latest readings of every set show it: ``{"state", "at"}``, where ``state`` is
        ``damaged`` (a set's routing departed from its healthy baseline, or a threshold rule breaches on it),
        ``healthy`` (every set routes as while healthy and no rule breaches) or ``unknown`` (no baseline to
        compare with), and ``at`` the oldest reading's time. Readings of another router version than the one
        serving now say nothing of it and are left out. What a fleet's members tell each other."""
        from mla_watch.retune.health import judge_health

        if self.prober is None:
            return {}
        rules = self.alerts.rules.rules if self.alerts is not None else []
        tolerance = self.config.reference.tolerance_bits
        sets = self.sets.current.sets
        states: dict[str, list[str]] = {}
        times: dict[str, float] = {}
        live = self._router_version()
        for name, reading in self.prober.readings().items():
            reference = sets.get(name)
            if reference is None or reading.digest != reference.digest or reading.router_version != live:
                continue
            breached = {breach["router"] for breach in judge_health(reading.score, rules).get("breaches", [])}
            baseline = self.baselines.of(reading)
            for record in reading.score.routers.values():
                if record.router.kind != "expert":
                    continue
                comparison = compare(record.router, [reading], [baseline])
                changed = None if comparison is None else comparison.changed(tolerance)
                state = (
                    "damaged"
                    if changed or record.router.name in breached
                    else ("healthy" if changed is False else "unknown")
                )
                states.setdefault(record.router.name, []).append(state)
                times[record.router.name] = min(times.get(record.router.name, reading.taken_at), reading.taken_at)
        return {
            router: {
                "state": "damaged" if "damaged" in found else "unknown" if "unknown" in found else "healthy",
                "at": times[router],
            }
            for router, found in states.items()
        }

    def read_again(self) -> None:
        """Read every set again soon (the routers serving changed: what a fleet's peers are told must be of them)."""
        if self.prober is not None:
            self.prober.request(None, time.time())

    def history_records(self) -> list[RouterStats]:
        """The latest reading of each set, as the routing history samples it beside live traffic (its line:
        ``reference:<set>``, which no business line can be)."""
        return [record for records in list(self._latest.values()) for record in records]

    def describe(self) -> dict[str, Any]:
        """``GET /v1/reference``: the sets, their latest readings and baselines, and how each router compares."""
        if self.prober is None:
            return {"available": False, "why": self.unavailable, "sets": self.sets.current.as_dict()}
        return {"available": True, **self.prober.describe()}


def _not_known_good(retune: RetuneService | None) -> str | None:
    """Why the router version serving is not known good (``None``: it is)."""
    if retune is None:
        return "no router version is recorded here"
    versions = retune.versions
    live = versions.live_version()
    if live is None:
        return "no router version is recorded yet"
    if versions.is_good(live):
        return None
    return f"router version {live}, served now, is not known to be good"
