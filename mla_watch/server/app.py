"""The sidecar's HTTP application: the composition root that wires the parts together.

OpenAI-compatible generation (served by the local model, or forwarded to ``--upstream``),
with the business line's sampling policy enforced on every request; routing statistics,
Prometheus metrics, health, policies, policy reload and routing-snapshot ingestion; the
status page at ``/`` and the JSON behind it (``/v1/status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mla_watch.alerting.engine import Action
from mla_watch.alerting.model import RuleSet
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.alerting.service import AlertService
from mla_watch.baselines import Baselines
from mla_watch.config import ConfigError, DirectoryStore, ReloadResult
from mla_watch.engines.decoder import RoutingDecoder
from mla_watch.engines.geometry import load_geometry
from mla_watch.engines.watch import UNATTRIBUTED_LINE, EngineMetrics, EngineRouting
from mla_watch.ingest import RemoteRouting
from mla_watch.policy_files import PolicyStore
from mla_watch.retune.jobs import ENGINE_RETUNE_MODES, JobSpec
from mla_watch.server import status as status_page
from mla_watch.server.admin import Admin, proposed_notice, rejected_notice
from mla_watch.server.config import ADMIN_TOKEN_ENV, ENGINE_CHOICES, INGEST_TOKEN_ENV, MIN_TOKEN_LENGTH, ServerConfig
from mla_watch.server.generation import Generation
from mla_watch.server.history import HistorySampler, RoutingHistory
from mla_watch.server.history_api import MAX_CELLS, HistoryQuery, encode_history, parse_history_query, too_large
from mla_watch.server.history_store import HISTORY_FILE, HistoryStore, HistoryStoreError
from mla_watch.server.http import authorise, error_response, read_json
from mla_watch.server.metrics import ServerMetrics
from mla_watch.server.proxy import Upstream
from mla_watch.server.reads import BoundedReads, monitoring_executor
from mla_watch.server.requests import ApiError, describe_value
from mla_watch.server.responses import RoutingLayout
from mla_watch.statedir import ensure_private_dir
from mla_watch.windows import NAME_RE, NAME_RULE, RouterWindows, RoutingSnapshot, take_snapshot

if TYPE_CHECKING:
    from mla_watch.probe.probe import Probe
    from mla_watch.retune.service import RetuneService
    from mla_watch.server.engine import Engine
    from mla_watch.server.selftest import SelfTestResult

__all__ = ["ServerConfig", "Sidecar"]

log = logging.getLogger("mla_watch.server")
BASELINE_VIEW_LIMIT = 5000  # series in one GET /v1/baseline (a fleet's workers may report many more)



class Sidecar:
    """Owns the model (or the upstream client), the policies and the metrics; builds the app."""

    def __init__(self, config: ServerConfig, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        _check_tokens(config)
        ensure_private_dir(config.state_dir)  # 0700 before anything is written there: it holds traffic
        self._snapshot: tuple[tuple, RoutingSnapshot] | None = None
        self._snapshot_lock = threading.Lock()
        self.policies = PolicyStore(config.policies, on_reload=self._on_policy_reload)  # raises PolicyError
        self.registry = registry or CollectorRegistry()
        self.metrics = ServerMetrics(self.registry, self.routing_snapshot)
        self.metrics.policy_version.set(self.policies.version)
        self.rules: DirectoryStore[RuleSet] | None = None
        self.history_store, self.history_store_error = self._open_history_store()  # trend rules read it
        self.baselines = self._open_baselines()
        self.alerts = self._alert_service() if config.rules is not None else None
        self.model_name = "bundled" if config.model == "bundled" else Path(config.model).name
        self.engine: Engine | None = None
        self.probe: Probe | None = None
        self.routing_layout: RoutingLayout | None = None  # with --return-routed-experts, once the model is in
        self.retune: RetuneService | None = None  # once a local model is loaded
        if self.alerts is not None:
            self.alerts.on_retune(self._on_retune_action)
        self.remote = RemoteRouting(config.ingest_limits, window_tokens=config.window_tokens,
                                    window_seconds=config.window_seconds, clock=clock, baselines=self.baselines)
        self.engine_routing = self._engine_routing()  # beside vLLM / SGLang: their routers' windows
        self._decoder: RoutingDecoder | None = None
        self._recorder: Any = None
        self.self_test: SelfTestResult | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()  # set once the model is loaded (or the upstream client made)
        self._stop_watches: list[Callable[[], None]] = []
        self.upstream: Upstream | None = None
        self.engine_retune_note = ENGINE_RETUNE_NOTE  # what re-tuning the engine's routers can do, once started
        self.history = RoutingHistory(span_seconds=config.history_span_seconds,
                                      interval_seconds=config.history_interval_seconds)
        self._history_sampler = HistorySampler(self.history, lambda: self.routing_snapshot().as_dicts(),
                                               sinks=[self.history_store] if self.history_store is not None else [])
        # Off the default executor, which alert evaluation shares: public reads cannot starve monitoring.
        self.heavy_reads = BoundedReads()  # /v1/history, /v1/status: bounded, 429 past it
        self._monitoring = monitoring_executor()  # /metrics, /v1/routing: never behind a heavy read
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan,
                             exception_handlers={ApiError: self._api_error})

    def _open_history_store(self) -> tuple[HistoryStore | None, str | None]:
        """The durable history, or why there is none: serving never depends on it."""
        config = self.config
        if not config.history_retention_days:
            return None, "the durable routing history is off (serve --history-retention 0)"
        path = config.state_dir / HISTORY_FILE
        try:
            store = HistoryStore(path, interval_seconds=config.history_interval_seconds,
                                 span_seconds=config.history_span_seconds,
                                 retention_days=config.history_retention_days, max_series=config.history_max_series)
        except HistoryStoreError as error:  # a state directory it cannot write: a corrupt file is set aside inside
            log.error("no durable routing history: %s", error)
            return None, f"the durable routing history could not be opened: {error}"
        return store, None

    # ------------------------------------------------------------------ beside an engine
    def _engine_routing(self) -> EngineRouting | None:
        config = self.config
        if config.engine not in ENGINE_CHOICES:
            raise ServerConfigError([f"--engine {config.engine!r}: expected one of {', '.join(ENGINE_CHOICES)}"])
        if problems := config.replay.problems():  # the command line checks them; the Python API comes here
            raise ServerConfigError(problems)
        if config.engine_retune not in ENGINE_RETUNE_MODES:
            raise ServerConfigError([f"--engine-retune {describe_value(config.engine_retune, 40)}: expected one of "
                                     f"{', '.join(ENGINE_RETUNE_MODES)}"])
        reading = config.engine != "none" or config.sglang_recorder_dir is not None
        if not reading:
            return None
        flag = "--engine" if config.engine != "none" else "--sglang-recorder-dir"
        if not config.upstream:
            raise ServerConfigError([f"{flag} reads an engine's routing: it needs --upstream URL (the engine)"])
        if config.model_config is None:
            raise ServerConfigError([f"{flag} needs --model-config: the config.json the engine loaded (or its "
                                     "directory), which says where its MoE layers are"])
        geometry = load_geometry(config.model_config)  # GeometryError names the file and the key
        log.info("engine routers from %s: %s", config.model_config, geometry.describe())
        engine = config.engine if config.engine != "none" else "sglang"
        return EngineRouting(engine, geometry, EngineMetrics(self.registry), window_tokens=config.window_tokens,
                             window_seconds=config.window_seconds, clock=self.clock)

    def own_windows(self) -> RouterWindows | None:
        """The windows of the routers this sidecar serves or stands beside (not the workers' that report)."""
        if self.probe is not None:
            self.probe.collect()
            return self.probe.windows
        if self.engine_routing is None:
            return None
        self.engine_routing.collect()
        return self.engine_routing.windows

    # ------------------------------------------------------------------ healthy baselines
    def _open_baselines(self) -> Baselines:
        """STATE_DIR/baseline.json: learned from healthy traffic, or set by POST /admin/baseline; kept across
        restarts. Learning waits until the routers served are known to be good (:meth:`_trust_baselines`)."""
        config = self.config
        learn = config.baseline_tokens if config.window_tokens is None else min(config.baseline_tokens,
                                                                                config.window_tokens)
        baselines = Baselines(config.state_dir / "baseline.json", learn_tokens=learn)
        baselines.load()
        return baselines

    def _trust_baselines(self) -> None:
        """Learn baselines only from routers known to be good: beside the model, the version served passed its
        start-up health check or a quality gate. Beside an engine (or workers) no health check runs before
        traffic: what is learned there is the first traffic no alert is pending or firing on."""
        retune = self.retune
        if self.probe is None or retune is None:
            self.baselines.trust(None)
            return
        registry = retune.registry
        live = registry.live_version()
        if live is None:
            self.baselines.trust("no router version is recorded yet")
        elif registry.is_good(live):
            self.baselines.trust(None)
        else:
            health = registry.manifest(live).get("health") or {}
            self.baselines.trust(f"router version {live}, served now, is not known to be good "
                                 f"({health.get('reason') or 'no start-up health check passed'}); "
                                 "POST /admin/baseline sets the baselines by hand")

    def _learn_baselines(self, snapshot: RoutingSnapshot) -> None:
        alerts = self.alerts
        self.baselines.learn(snapshot.records, excluded=None if alerts is None else alerts.engine.active_series)

    def save_baseline(self, business_line: str | None) -> dict[str, Any] | None:
        """The windows now become the healthy baselines of their series (``business_line``'s, or every
        line's and all lines summed), replacing what was learned; kept in STATE_DIR/baseline.json."""
        windows = self.own_windows()
        if windows is None:
            return None
        taken = windows.set_baselines(business_line)  # windows.baselines is self.baselines, kept in STATE_DIR
        return {"path": str(self.baselines.path), "business_line": business_line,
                "routers": list(dict.fromkeys(baseline.router for baseline in taken)), "series": len(taken)}

    def engine_routers(self) -> set[str]:
        return set(self.engine_routing.geometry.router_names) if self.engine_routing is not None else set()

    def _engine_status(self) -> dict[str, Any] | None:
        routing = self.engine_routing
        if routing is None:
            return None
        return {"engine": routing.engine, "url": self.config.upstream, "routers": routing.geometry.describe(),
                "recorder_dir": str(self.config.sglang_recorder_dir) if self.config.sglang_recorder_dir else None,
                "unattributed_line": UNATTRIBUTED_LINE, "retune": self.engine_retune_note,
                "problems": routing.problems(),
                "counting": self._counting_status()}

    def _counting_status(self) -> dict[str, Any] | None:
        """Answers still to count (they are counted after the client has them) and vLLM streams' replays."""
        upstream = self.upstream
        if upstream is None or upstream.counter is None:
            return None
        replayer = upstream.replayer
        budget = None if replayer is None else dataclasses.asdict(replayer.budget)
        return {"queued": upstream.counter.queued, "queue_bytes": upstream.counter.max_bytes,
                "replays_waiting": 0 if replayer is None else replayer.waiting, "replay": budget}

    # ------------------------------------------------------------------ alerting
    def _alert_service(self) -> AlertService:
        self.rules = DirectoryStore(self.config.rules, load_rules_dir, what="rules",  # RuleError at start-up
                                    on_reload=self._on_rules_reload)
        service = AlertService(
            self.rules.current, self.config.state_dir, records=self._alert_records, interval=self.config.alert_interval,
            status_url=self.config.public_url.rstrip("/") + "/" if self.config.public_url else "",
            external_url=self.config.public_url,
            on_notification=lambda receiver, outcome: self.metrics.notifications.labels(receiver, outcome).inc(),
            before_round=self.rules.check_for_changes,  # a changed rule file is loaded by the next round
            trend_source=self.history_store,
        )
        self.metrics.watch_alerts(service.engine)
        return service

    def _alert_records(self) -> list[dict[str, Any]]:
        snapshot = self.routing_snapshot()
        self._learn_baselines(snapshot)  # what it learns is judged from the next round on
        return snapshot.as_dicts()

    def routing_snapshot(self) -> RoutingSnapshot:
        """Every router's statistics, per business line and summed: computed once per change of the
        counts, and shared by the metrics, alert evaluation, the history and the APIs."""
        sources = self._routing_sources()  # collects the local probe's counts first
        key = tuple((windows.serial, windows.version) for windows in sources)
        with self._snapshot_lock:
            cached = self._snapshot
            # Windows bounded by age change with time alone: their snapshot lives one second.
            if cached is not None and cached[0] == key and (
                    self.config.window_seconds is None or self.clock() - cached[1].taken_at < 1.0):
                return cached[1]
            snapshot = take_snapshot(sources, self.clock())
            self._snapshot = (key, snapshot)
            return snapshot

    def reload_rules(self) -> list[str]:
        """Load the rules again; on errors keep the rules in force and return the errors."""
        return self.rules.reload().errors if self.rules is not None else []

    def _on_rules_reload(self, result: ReloadResult) -> None:
        if result.changed and self.alerts is not None and self.rules is not None:
            self.alerts.replace_rules(self.rules.current)

    # ------------------------------------------------------------------ life cycle
    def load_model(self) -> None:
        """Load the model, run the attention self-test, attach the probe, start the engine."""
        import mla_watch
        from mla_watch.server.engine import Engine
        from mla_watch.server.selftest import attention_self_test

        try:
            model, tokenizer = mla_watch.load_model(self.config.model, device=self.config.device)
            self.self_test = attention_self_test(model, self.config.attn_implementation)
            (log.warning if self.self_test.refused else log.info)(self.self_test.message)
            self.metrics.attention_fallback.set(1 if self.self_test.refused else 0)
            # The counting buffer is sized once (CUDA-graph safe): room for every policy's line and then some;
            # a line added by a later reload past it is counted as `overflow`, with a warning.
            lines = max(16, 2 * len(self.policies.current.lines) + 1)
            self.probe = mla_watch.attach(model, window_tokens=self.config.window_tokens,
                                          window_seconds=self.config.window_seconds, clock=self.clock,
                                          max_business_lines=lines)
            if self.config.return_routed_experts:
                experts = [info for info in self.probe.routers if info.kind == "expert"]
                self.routing_layout = RoutingLayout([info.layer for info in experts],
                                                    int(model.config.num_hidden_layers),
                                                    max((info.num_slots for info in experts), default=1))
            self.engine = Engine(model, tokenizer, self.probe, max_queue=self.config.max_queue, clock=self.clock,
                                 on_job_done=lambda job, seconds: self.metrics.queue_depth.set(self.engine.queue_depth))
            self.probe.windows.baselines = self.baselines
            self._start_retune(model, tokenizer)
            self._trust_baselines()
            gc.freeze()
            self.ready.set()
        except Exception as error:
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("model failed to load")

    # ------------------------------------------------------------------ re-tuning
    def _start_retune(self, model: Any, tokenizer: Any) -> None:
        from mla_watch.retune.capture import TrafficCapture
        from mla_watch.retune.registry import RouterVersions
        from mla_watch.retune.runner import Retuner
        from mla_watch.retune.service import RetuneService
        from mla_watch.statedir import ensure_private_dir

        state = ensure_private_dir(self.config.state_dir)  # 0700: it holds captured traffic
        # Jobs from the admin API read datasets from here only (a bare file name, resolved inside it).
        datasets = self.config.dataset_dir if self.config.dataset_dir is not None else state / "datasets"
        ensure_private_dir(datasets)
        registry = RouterVersions(state / "routers")
        capture = None
        if self.config.capture:
            capture = TrafficCapture(state / "capture.sqlite", max_samples_per_line=self.config.capture_max_samples,
                                     max_age_seconds=self.config.capture_max_age_seconds)

            def record(line: str, token_ids: list[int], prompt_tokens: int) -> None:
                capture.add(line, token_ids, prompt_tokens=prompt_tokens)
                self.metrics.captured_samples.labels(line).inc()

            self.engine.capture = record
        reference = None
        if self.config.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers
            from mla_watch.retune.registry import router_state

            reference = load_reference_routers(self.config.reference_model, router_state(model))
        retuner = Retuner(model=model, tokenizer=tokenizer, registry=registry, settings=self.config.retune,
                          workdir=state / "retune-work", promote=lambda version: self.retune.promote(version),
                          capture=capture, model_lock=self.engine.model_lock, model_ref=self.config.model,
                          dataset_dir=datasets, reference=reference,
                          health_rules=None if self.alerts is None else lambda: self.alerts.rules.rules)
        self.retune = RetuneService(
            state_dir=state, settings=self.config.retune, retuner=retuner, registry=registry,
            model_lock=self.engine.model_lock, on_promoted=self._routers_changed, on_rejected=self._retune_rejected,
            on_outcome=lambda strategy, outcome: self.metrics.retune_jobs.labels(strategy, outcome).inc(),
            health_check=self._router_health(tokenizer),
        )
        self.retune.start()
        self.metrics.router_version.set(registry.live_version() or 0)

    # ------------------------------------------------------------------ re-tuning beside an engine
    def _open_capture(self) -> Any:
        """STATE_DIR/capture.sqlite (0600) when serving with --capture, else ``None``."""
        if not self.config.capture:
            return None
        from mla_watch.retune.capture import TrafficCapture

        return TrafficCapture(self.config.state_dir / "capture.sqlite",
                              max_samples_per_line=self.config.capture_max_samples,
                              max_age_seconds=self.config.capture_max_age_seconds)

    def _capture_answers(self, capture: Any) -> Callable[[str, list[tuple[list[int], int]]], None]:
        from mla_watch.retune.capture import CaptureError

        def record(line: str, samples: list[tuple[list[int], int]]) -> None:
            try:
                for token_ids, prompt_tokens in samples:
                    capture.add(line, token_ids, prompt_tokens=prompt_tokens)
                    self.metrics.captured_samples.labels(line).inc()
            except CaptureError as error:  # the client has its answer: a full disk costs the capture, not it
                log.warning("an answer of %s was not captured: %s", line, error)

        return record

    def _start_engine_retune(self, capture: Any) -> str:
        """The re-tune service for the engine's routers (``--engine-retune propose|apply``); else why there is none."""
        config = self.config
        if self.engine_routing is None:
            return ("re-tuning needs a local model, or an engine's routing read (--engine vllm|sglang with "
                    "--model-config) to re-tune the engine's routers")
        if config.engine_retune == "off":
            return "re-tuning the engine's routers is off (serve --engine-retune propose|apply)"
        if config.engine not in ("vllm", "sglang"):
            return (f"re-tuning the engine's routers needs --engine vllm or sglang (not {config.engine}): the swap "
                    "endpoints differ")
        from mla_watch.engines.weights import read_router_tensors
        from mla_watch.retune.engine import EngineRetuner, EngineRouters
        from mla_watch.retune.registry import RouterVersions
        from mla_watch.retune.service import RetuneService

        geometry = self.engine_routing.geometry
        checkpoint = Path(config.model_config)  # type: ignore[arg-type]
        try:
            if not checkpoint.is_dir():
                raise ValueError(f"--model-config {checkpoint} is a file: expected the engine's checkpoint directory "
                                 f"(config.json and its safetensors), where the routers' tensors are read")
            initial = read_router_tensors(checkpoint, geometry.moe_layers)
        except ValueError as error:
            log.warning("re-tuning the engine's routers is not available: %s", error)
            return f"re-tuning the engine's routers is not available: {error}"
        if config.engine == "vllm":
            from mla_watch.engines.weights import VllmWeights

            weights: Any = VllmWeights(config.upstream, timeout=max(config.request_timeout, 60.0),
                                       geometry=geometry, api_key=os.environ.get("MLA_WATCH_ENGINE_API_KEY"))
        else:
            from mla_watch.engines.sglang_weights import SglangWeights

            weights = SglangWeights(config.upstream, timeout=max(config.request_timeout, 60.0), geometry=geometry,
                                    api_key=os.environ.get("MLA_WATCH_ENGINE_API_KEY"),
                                    admin_api_key=os.environ.get("MLA_WATCH_ENGINE_ADMIN_API_KEY"))
        state = ensure_private_dir(config.state_dir)
        swap_dir = config.engine_swap_dir or state / "engine-swaps"
        host = EngineRouters(weights, geometry, initial, swap_dir=swap_dir, config_json=checkpoint / "config.json")
        registry = RouterVersions(state / "routers")
        reference = None
        if config.reference_model is not None:
            from mla_watch.retune.reference import load_reference_routers

            reference = load_reference_routers(config.reference_model, initial)
        windows = self.engine_routing

        def loads(router: str, line: str | None) -> Any:
            return windows.counts(line).get(router)

        retuner = EngineRetuner(host=host, registry=registry, settings=config.retune, mode=config.engine_retune,
                                capture=capture, promote=lambda version: self.retune.promote(version),
                                rollback=lambda: self.retune.rollback(), loads=loads, reference=reference,
                                gate_timeout=config.engine_gate_timeout)
        self.retune = RetuneService(
            state_dir=state, settings=config.retune, retuner=retuner, registry=registry, model_lock=threading.Lock(),
            on_promoted=self._routers_changed, on_rejected=self._retune_rejected, on_proposed=self._retune_proposed,
            on_outcome=lambda strategy, outcome: self.metrics.retune_jobs.labels(strategy, outcome).inc())
        self.retune.start()
        self.metrics.router_version.set(registry.live_version() or 0)
        def check() -> None:  # an engine still starting must not hold up the sidecar's own start
            problem = weights.problem()
            if problem is not None:
                log.warning("re-tuning the engine's routers: %s", problem)

        threading.Thread(target=check, name="mla-watch-engine-check", daemon=True).start()
        return f"re-tuning the engine's routers: {config.engine_retune} (swaps written to {swap_dir})"

    def _retune_proposed(self, spec: JobSpec, result: dict[str, Any]) -> None:
        if self.alerts is not None:
            labels, annotations = proposed_notice(spec, result)
            self.alerts.notify_event(labels=labels, annotations=annotations, receivers=spec.trigger.get("receivers"))

    def _router_health(self, tokenizer: Any) -> Callable[[Any], dict[str, Any]] | None:
        """The start-up health check of router version 0, by the loaded alert rules (none without rules)."""
        if self.alerts is None:
            return None
        from mla_watch.retune.health import startup_health

        rules = self.alerts.rules.rules
        return lambda host: startup_health(host.model, tokenizer, rules)

    def _on_retune_action(self, action: Action) -> str:
        """Schedule the job a rule's ``retune`` action asks for; say what became of it (for the page)."""
        router = action.alert.labels.get("router", "")
        if router in self.engine_routers() and self.retune is None:
            return f"no re-tune job: {router} is a router of the engine at {self.config.upstream}; " \
                   f"{self.engine_retune_note}"
        if self.retune is None:
            return "no re-tune job: this sidecar serves no local model to re-tune"
        if router not in self.retune.watched_by(None):
            return (f"no re-tune job: {router} is not an expert router of this sidecar's model (routing shipped by "
                    "another process is watched, not re-tuned here)")
        if self.retune.retuner.capture is None:
            return ("no re-tune job: traffic capture is off, so the job would have no data (serve with --capture to "
                    "record recent traffic per business line, or run `mla-watch retune run --dataset FILE`)")
        record = self.retune.on_alert(action)
        if record is None:
            return "no new re-tune job: this router is in its re-tune cooldown (see /v1/retune/jobs)"
        return f"re-tune job {record['id']} {record.get('status', 'scheduled')}"

    def _routers_changed(self, kind: str, routers: list[str]) -> None:
        """After a promotion or rollback: the windows restart, describing the routers now serving."""
        windows = self.own_windows()  # the counts so far collected first: they belong to the routers before
        if windows is not None:
            windows.reset(routers)
        self.metrics.router_promotions.labels(kind).inc()
        self.metrics.router_version.set(self.retune.registry.live_version() or 0)
        self._trust_baselines()

    def _retune_rejected(self, spec: JobSpec, result: dict[str, Any]) -> None:
        if self.alerts is not None:
            labels, annotations = rejected_notice(spec, result)
            self.alerts.notify_event(labels=labels, annotations=annotations, receivers=spec.trigger.get("receivers"))

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._startup()
        try:
            yield
        finally:
            await self._shutdown()

    def _startup(self) -> None:
        # What start-up made lives as long as the server: out of the collector's reach, a full
        # collection no longer scans it, holding the GIL - and so the event loop - for 200 ms
        # (measured by bench/attacks.py while /metrics built 27k series). Again once the model is in.
        gc.freeze()
        if self.engine_routing is not None:
            self.engine_routing.windows.baselines = self.baselines
        if self.config.upstream:
            self._trust_baselines()  # no local model to health-check: the engine's routers, or workers' reports
            # Every answer is parsed there, routing or not: no engine answer is parsed on the event loop.
            self._decoder = RoutingDecoder(self.config.decode_workers)
            self._decoder.start()
            capture = self._open_capture() if self.engine_routing is not None else None
            self.upstream = Upstream(self.config.upstream, self.config.request_timeout, decoder=self._decoder,
                                     routing=self.engine_routing if self.config.engine != "none" else None,
                                     max_bytes=self.config.upstream_max_bytes,
                                     credentials=self.config.upstream_credentials,
                                     replay=self.config.replay if self.config.replay.rate > 0 else None,
                                     count_queue_bytes=self.config.count_queue_bytes,
                                     capture=None if capture is None else self._capture_answers(capture))
            self.engine_retune_note = self._start_engine_retune(capture)
            if self.config.sglang_recorder_dir is not None:
                from mla_watch.engines.recorder import RecorderPoller

                self._recorder = RecorderPoller(self.config.sglang_recorder_dir, self.config.upstream,
                                                self.engine_routing, interval=self.config.sglang_recorder_interval,
                                                buffer_size=self.config.sglang_recorder_buffer,
                                                credentials=self.config.upstream_credentials)
                self._recorder.start()
            self.ready.set()
        else:
            threading.Thread(target=self.load_model, name="mla-watch-load", daemon=True).start()
        if self.config.policy_poll_seconds:
            self._stop_watches = [self.policies.watch(self.config.policy_poll_seconds)]
        if self.alerts is not None:
            self.alerts.start()
        self._history_sampler.start()
        if self.config.public_url:
            log.info("status page: %s/", self.config.public_url.rstrip("/"))

    async def _shutdown(self) -> None:
        self.heavy_reads.shutdown()
        self._monitoring.shutdown(wait=False, cancel_futures=True)
        self._history_sampler.stop()
        if self.history_store is not None:
            self.history_store.close()
        if self._recorder is not None:
            await asyncio.to_thread(self._recorder.stop)
        if self.upstream is not None:  # first: what it still has to count needs the decoder
            await self.upstream.close()
        if self._decoder is not None:
            self._decoder.close()
        for stop in self._stop_watches:
            stop()
        if self.alerts is not None:
            await asyncio.to_thread(self.alerts.stop)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        if self.retune is not None:
            await asyncio.to_thread(self.retune.stop)

    def wait_ready(self, timeout: float) -> bool:
        return self.ready.wait(timeout)

    def _on_policy_reload(self, result: ReloadResult) -> None:  # the store logs it
        self.metrics.policy_reloads.labels("ok" if result.ok else "refused").inc()
        self.metrics.policy_version.set(result.version)

    def _routing_sources(self) -> list[RouterWindows]:
        sources = []
        if self.probe is not None:
            self.probe.collect()  # safe beside a running forward: counts are read as deltas
            sources.append(self.probe.windows)
        if self.engine_routing is not None:
            self.engine_routing.collect()
            sources.append(self.engine_routing.windows)
        sources.extend(self.remote.windows())
        return sources

    # ------------------------------------------------------------------ routes
    def _routes(self) -> list[Route]:
        generation, admin = Generation(self), Admin(self)
        return [
            Route("/v1/completions", generation.completions, methods=["POST"]),
            Route("/v1/chat/completions", generation.chat_completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/routing", self._routing, methods=["GET"]),
            Route("/v1/routing/ingest", admin.ingest, methods=["POST"]),
            Route("/v1/baseline", self._baseline, methods=["GET"]),
            Route("/v1/policies", self._policies, methods=["GET"]),
            Route("/v1/alerts", self._alerts, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/readyz", self._readyz, methods=["GET"]),
            Route("/admin/reload", admin.reload, methods=["POST"]),
            Route("/admin/baseline", admin.baseline, methods=["POST"]),
            Route("/v1/retune/jobs", admin.jobs, methods=["GET"]),
            Route("/v1/retune/jobs/{job_id}", admin.job, methods=["GET"]),
            Route("/v1/retune/versions", admin.versions, methods=["GET"]),
            Route("/admin/retune", admin.retune, methods=["POST"]),
            Route("/admin/retune/promote", admin.promote, methods=["POST"]),
            Route("/admin/retune/rollback", admin.rollback, methods=["POST"]),
            Route("/admin/retune/apply", admin.apply, methods=["POST"]),
            Route("/admin/retune/mark-good", admin.mark_good, methods=["POST"]),
            Route("/", self._status_page, methods=["GET"]),
            Route("/static/{name}", self._static, methods=["GET"]),
            Route("/v1/status", self._status, methods=["GET"]),
            Route("/v1/history", self._history, methods=["GET"]),
        ]

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _readyz(self, request: Request) -> Response:
        problems = []
        if not self.ready.is_set():
            problems.append(self.load_error or "the model is loading")
        body: dict[str, Any] = {"ready": not problems, "problems": problems,
                                "policies_version": self.policies.version}
        if self.self_test is not None:
            body["attention"] = self.self_test.as_dict()
        return JSONResponse(body, status_code=200 if not problems else 503)

    async def _metrics(self, request: Request) -> Response:
        if self.engine is not None:
            self.metrics.queue_depth.set(self.engine.queue_depth)
        body = await asyncio.get_running_loop().run_in_executor(self._monitoring, generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        if self.upstream is not None:
            return await self.upstream.models(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "mla_watch"}]})

    async def _routing(self, request: Request) -> Response:
        line = request.query_params.get("business_line")
        # Encoded on the thread too: every router's record of a wide fleet is no job for the event loop.
        body = await asyncio.get_running_loop().run_in_executor(self._monitoring,
                                                                lambda: JSONResponse(self.routing(line)).body)
        return Response(body, media_type="application/json")

    async def _baseline(self, request: Request) -> Response:
        """``GET /v1/baseline``: whether healthy baselines are learned (and why not), and each series' healthy
        values (no counts), at most :data:`BASELINE_VIEW_LIMIT` series."""
        def body() -> bytes:
            document = self.baselines.describe()
            series = document["series"]
            document["series"], document["truncated"] = series[:BASELINE_VIEW_LIMIT], max(
                0, len(series) - BASELINE_VIEW_LIMIT)
            return JSONResponse(document).body

        return Response(await asyncio.get_running_loop().run_in_executor(self._monitoring, body),
                        media_type="application/json")

    def routing(self, business_line: str | None = None) -> dict[str, Any]:
        """``GET /v1/routing``: every router's statistics for one line (every line summed for ``None``).

        A line nobody has reported is answered with 404 naming the known ones: reading never
        creates a window, so a query string cannot grow memory.
        """
        snapshot = self.routing_snapshot()
        lines = list(snapshot.business_lines)
        if business_line is not None and business_line not in lines:
            shown = describe_value(business_line)
            if not NAME_RE.fullmatch(business_line):
                raise ApiError(400, f"business_line={shown} is invalid: expected {NAME_RULE}",
                               param="business_line", code="invalid_value")
            raise ApiError(404, f"business_line={shown} has no routing counts here; known lines: "
                                f"{', '.join(lines[:50]) or 'none yet'}", param="business_line", code="not_found")
        routers = [record.as_dict() for record in snapshot.for_line(business_line)]
        return {"business_line": business_line, "business_lines": lines, "routers": routers}

    def _reload_errors(self) -> list[str] | None:
        """Why the last policy reload was refused (``None`` if it was not)."""
        error = self.policies.last_error
        return None if error is None else error.errors

    def _alert_list(self) -> list[dict[str, Any]]:
        return [alert.as_dict() for alert in self.alerts.engine.alerts()] if self.alerts is not None else []

    def _policies_view(self) -> list[dict[str, Any]]:
        """Each line's tasks with what was clamped, refused and filled in by default, by parameter."""
        return status_page.policies_view(self.policies.current.as_dict(),
                                         status_page.counter_values(self.metrics.policy_adjustments),
                                         status_page.counter_values(self.metrics.policy_rejections),
                                         status_page.counter_values(self.metrics.policy_defaults))

    async def _policies(self, request: Request) -> Response:
        counts = {line["business_line"]: {task["task"]: {"clamped": task["adjustments"], "refused": task["rejections"],
                                                        "defaulted": task["defaults"]} for task in line["tasks"]}
                  for line in self._policies_view()}
        return JSONResponse({"version": self.policies.version, **self.policies.current.as_dict(),
                             "counts": counts, "last_reload_error": self._reload_errors()})

    async def _alerts(self, request: Request) -> Response:
        if self.alerts is None:
            return JSONResponse({"alerts": [], "rules": 0})
        return JSONResponse({"alerts": self._alert_list(), "rules": len(self.alerts.rules.rules),
                             "notifications_pending": self.alerts.outbox.pending(),
                             "notifications_unqueued": self.alerts.unqueued})

    # ------------------------------------------------------------------ status page
    async def _status_page(self, request: Request) -> Response:
        content, media_type = status_page.static_file("index.html")
        return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _static(self, request: Request) -> Response:
        try:
            content, media_type = status_page.static_file(request.path_params["name"])
        except KeyError:
            raise ApiError(404, f"no such file: {describe_value(request.path_params['name'])}: expected one of "
                                f"{sorted(status_page.STATIC_FILES)}", code="not_found") from None
        return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _status(self, request: Request) -> Response:
        since = request.query_params.get("since")
        try:
            since_value = None if since is None else float(since)
        except ValueError:
            since_value = float("nan")
        if since_value is not None and not np.isfinite(since_value):
            raise ApiError(400, f"since={describe_value(since)} is invalid: expected a time in seconds since the "
                                "epoch (the last `times` entry already shown)", param="since", code="invalid_value")
        body = await self.heavy_reads.run("GET /v1/status", lambda: JSONResponse(self.status(since_value)).body)
        return Response(body, media_type="application/json")

    def status(self, since: float | None = None) -> dict[str, Any]:
        """What the status page shows (``GET /v1/status``); ``since`` limits the history to newer points."""
        rules = list(self.alerts.rules.rules) if self.alerts is not None else []
        history = self.history.snapshot(since)
        for series in history["series"]:
            series["band"] = status_page.entropy_band(rules, series)
        policies = self._policies_view()
        body: dict[str, Any] = {
            "generated_at": time.time(), "model": self.model_name, "ready": self.ready.is_set(),
            "load_error": self.load_error, "upstream": self.config.upstream, "engine": self._engine_status(),
            "history": history,
            "history_store": None if self.history_store is None else {
                "retention_days": self.history_store.retention_days, "max_series": self.history_store.max_series,
                "series_dropped": self.history_store.dropped_series},
            "alerts": self._alert_list(), "rules": len(rules),
            "notifications_pending": self.alerts.outbox.pending() if self.alerts is not None else 0,
            "policies": {"version": self.policies.version, "lines": policies,
                         "last_reload_error": self._reload_errors()},
            "retune": None,
        }
        if self.retune is not None:
            registry = self.retune.registry
            body["retune"] = {"live": registry.live_version(), "last_good": registry.last_good(),
                              "jobs": self.retune.store.list(limit=20), "promotions": registry.promotions()[-50:]}
        return body

    async def _history(self, request: Request) -> Response:
        store = self.history_store
        if store is None:
            raise ApiError(404, f"{self.history_store_error}: /v1/status holds the last hour", code="not_found")
        query = parse_history_query(request.query_params, now=store.clock(), min_step=store.interval_seconds)
        # Megabytes of JSON: built and encoded on the heavy reads' threads, bounded in bytes (MAX_ANSWER_BYTES).
        body = await self.heavy_reads.run("GET /v1/history", lambda: encode_history(self.history_range(query)))
        return Response(body, media_type="application/json")

    def history_range(self, query: HistoryQuery) -> dict[str, Any]:
        """``GET /v1/history``: a metric's series over a range, one column per ``step`` (with bands for entropy)."""
        assert self.history_store is not None
        try:
            body = self.history_store.query(since=query.since, until=query.until, step=query.step,
                                            metric=query.metric, business_line=query.business_line,
                                            router=query.router, max_cells=MAX_CELLS)
        except ValueError as error:
            raise too_large(query.step, str(error)) from error
        rules = list(self.alerts.rules.rules) if self.alerts is not None and query.metric == "entropy_bits" else []
        for series in body["series"]:
            series["band"] = status_page.entropy_band(rules, series)
        return body

    # ------------------------------------------------------------------ admin
    def authorise_admin(self, request: Request) -> None:
        authorise(request, self.config.admin_token, what="admin", variables=ADMIN_TOKEN_ENV)

    def authorise_ingest(self, request: Request) -> None:
        """Workers hold the ingestion token, not the admin key (the admin token when none is set)."""
        authorise(request, self.config.ingest_token or self.config.admin_token, what="ingestion",
                  variables=f"{INGEST_TOKEN_ENV} or {ADMIN_TOKEN_ENV}")

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The request's JSON object: at most ``max_body_bytes``, arrived within ``body_timeout_seconds``."""
        return await read_json(request, self.config.max_body_bytes, self.config.body_timeout_seconds)

    def refused(self, request: Request, error: ApiError) -> Response:
        """The answer to a refused request, counted by reason when the client was at fault."""
        if error.status < 500:  # labelled by the route's template: /v1/retune/jobs/{job_id}, not each id asked for
            route = getattr(request.scope.get("route"), "path", "other")
            self.metrics.bad_requests.labels(route, error.code or str(error.status)).inc()
        return error_response(error)

    async def _api_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        return self.refused(request, error)


ENGINE_RETUNE_NOTE = "re-tuning the engine's routers starts with the sidecar (serve --engine-retune propose|apply)"


class ServerConfigError(ConfigError):
    """A setting of the server itself (an environment variable, a flag) cannot be served."""

    what = "server configuration"


def _check_tokens(config: ServerConfig) -> None:
    for variable, token in ((ADMIN_TOKEN_ENV, config.admin_token), (INGEST_TOKEN_ENV, config.ingest_token)):
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise ServerConfigError([f"{variable} has {len(token)} characters: expected at least {MIN_TOKEN_LENGTH}, "
                              "random (python -c 'import secrets; print(secrets.token_urlsafe())')"])


def build_sidecar(config: ServerConfig, **kwargs: Any) -> Sidecar:
    """A :class:`Sidecar`, with a configuration error at start-up reported as one readable message."""
    from mla_watch.alerting.outbox import OutboxError

    try:
        return Sidecar(config, **kwargs)
    except ConfigError as error:  # the policies, the rules, or the server's own settings
        raise SystemExit(f"mla-watch: the {error.what} cannot be used:\n  " + "\n  ".join(error.errors)) from error
    except (OutboxError, OSError) as error:  # OSError: the state directory cannot even be created
        raise SystemExit(f"mla-watch: the state directory is not usable: {error}") from error
