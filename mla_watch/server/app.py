"""The sidecar's HTTP application: the composition root that wires the parts together.

OpenAI-compatible generation (served by the local model, or forwarded to ``--upstream``),
with the business line's sampling policy enforced on every request; routing statistics,
Prometheus metrics, health, policies, policy reload and routing-snapshot ingestion; the
status page at ``/`` and the JSON behind it (``/v1/status``).

The parts live in their own modules: the routing sources (:mod:`.sources`), the read endpoints
(:mod:`.read_views`), generation (:mod:`.generation`), the admin and re-tuning API (:mod:`.admin`),
bearer tokens (:mod:`.auth`), re-tuning's start and callbacks (:mod:`.retuning`), what faces the
upstream engine (:mod:`.upstream_side`). :class:`Sidecar` builds them, connects their callbacks,
and builds the routes and the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route

from mla_watch.alerting.alert_service import AlertService
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.alerting.vocabulary import RuleSet
from mla_watch.common.directory_store import DirectoryStore, ReloadResult
from mla_watch.common.setting_errors import FieldNamer, SettingsError
from mla_watch.common.state_dir import ensure_private_dir
from mla_watch.common.state_writes import StateWrites
from mla_watch.common.stop_budget import PARTS_SECONDS, StopBudget
from mla_watch.engines.routing_fields import RoutingLayout
from mla_watch.history.store import HISTORY_FILE, HistoryStore, HistoryStoreError
from mla_watch.policy.files import PolicyStore
from mla_watch.references.client_load import ClientLatency
from mla_watch.references.representative import BaselineCheck
from mla_watch.routing.baselines import Baselines
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.footprint import FootprintSampler
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS, RouterStats, RoutingSnapshot
from mla_watch.server import read_views
from mla_watch.server.admin import Admin
from mla_watch.server.auth import Auth
from mla_watch.server.config import ServerConfig, ServerConfigError, check_tokens
from mla_watch.server.fleet_api import FleetApi
from mla_watch.server.generation import Generation
from mla_watch.server.handler_context import HandlerContext, Serving
from mla_watch.server.history import HistorySampler
from mla_watch.server.metrics import ServerMetrics
from mla_watch.server.reads import BoundedReads, monitoring_executor
from mla_watch.server.reference_readings import References
from mla_watch.server.requests import ApiError
from mla_watch.server.retuning import Retuning
from mla_watch.server.sources import RoutingSources
from mla_watch.server.upstream_side import UpstreamSide, build_upstream_side

if TYPE_CHECKING:
    from mla_watch.engines.watch import EngineRouting
    from mla_watch.probe.probe import Probe
    from mla_watch.retune.service import RetuneService
    from mla_watch.routing.ingest import RemoteRouting
    from mla_watch.server.model_worker import ModelWorker

__all__ = ["ServerConfig", "ServerConfigError", "Sidecar", "build_sidecar"]

log = logging.getLogger("mla_watch.server")


class Sidecar:
    """Owns the model (or the upstream client), the policies and the metrics; builds the app."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_loader: Callable[..., tuple[Any, Any]] | None = None,
        open_history: Callable[..., HistoryStore] = HistoryStore,
    ) -> None:
        self.config = config
        self.clock = clock
        self._model_loader = model_loader  # mla_watch.load_model's signature; None: load_model itself
        self._open_history = open_history  # HistoryStore's signature: the durable history at STATE_DIR
        check_tokens(config)
        ensure_private_dir(config.state_dir)  # 0700 before anything is written there: it holds traffic
        # Which of its files cannot be written (a full or read-only disk): every store tells it; /readyz and
        # /metrics read it; the log says it once per change.
        self.state_writes = StateWrites(config.state_dir)
        self.policies = PolicyStore(config.policies, on_reload=self._on_policy_reload)  # raises PolicyError
        # The rules are judged before any state file is opened: a start they refuse leaves STATE_DIR as it was.
        self.rules: DirectoryStore[RuleSet] | None = (
            None
            if config.rules is None
            else DirectoryStore(config.rules, load_rules_dir, what="rules", on_reload=self._on_rules_reload)
        )  # RuleError at start-up
        self.registry = registry or CollectorRegistry()
        self.metrics = ServerMetrics(
            self.registry,
            lambda: self.sources.routing_snapshot(),
            expert_counts=config.export_expert_counts,
            expert_series_budget=config.expert_series_budget,
        )
        self.metrics.policy_version.set(self.policies.version)
        self.history_store, self.history_store_error = self._open_history_store()  # trend rules read it
        self.baselines = self._open_baselines()
        self.metrics.watch_baselines(self.baselines)
        self.alerts = self._alert_service() if config.rules is not None else None
        self.metrics.watch_state_writes(
            self.state_writes, None if self.alerts is None else lambda: cast(AlertService, self.alerts).outbox.held
        )
        self.serving = Serving(model_name="bundled" if config.model == "bundled" else Path(config.model).name)
        # Who sends each line's traffic: a baseline is learned from a line's traffic, never one client's; the
        # reference prompts tell the traffic's changes from the model's.
        self.clients = ClientShares(window_tokens=config.window_tokens or DEFAULT_WINDOW_TOKENS)
        # The local model's windows, the engine's (beside vLLM / SGLang), the workers' that report.
        self.sources = RoutingSources(
            config,
            self.registry,
            self.baselines,
            clock=clock,
            learn_excluded=self.alerts.engine.active_series if self.alerts else None,
            clients=self.clients,
        )
        # Beside an engine, how long clients wait: reference readings yield while it is above its usual level.
        self.client_latency = ClientLatency() if config.upstream else None
        self.references = References(
            config,
            clients=self.clients,
            alerts=self.alerts,  # ReferenceSetError at start-up
            writes=self.state_writes,
            client_latency=self.client_latency,
        )
        self.metrics.watch_reference(lambda: self.references.prober)
        # Each reading of a line's reference prompts also judges the line's learned baselines: one that is not the
        # line's traffic is dropped and learned again.
        self.references.baseline_check = BaselineCheck(
            self.baselines,
            lambda line: self.sources.routing_snapshot().for_line(line),
            self.sources.window_clients,
            tolerance_bits=config.reference.tolerance_bits,
        )
        self.metrics.watch_footprint(self._footprint)
        if config.position_metrics:
            self.metrics.watch_positions(lambda: None if self.sources.probe is None else self.sources.probe.positions)
        if self.alerts is not None:
            self.alerts.judge_causes_with(self.references)
        self.retuning = Retuning(
            config=config,
            serving=self.serving,
            sources=self.sources,
            metrics=self.metrics,
            alerts=self.alerts,
            references=self.references,
            writes=self.state_writes,
        )
        if self.alerts is not None:
            self.alerts.on_retune(self.retuning.on_retune_action)
        self.auth = Auth(config, self.metrics)
        self._upstream_side: UpstreamSide | None = None
        self._stop_watches: list[Callable[[], None]] = []
        # The status page's live hour is the durable store's full tier; without that store, the same hour in memory.
        self.history = self.history_store or HistoryStore(
            None,
            interval_seconds=config.history_interval_seconds,
            span_seconds=config.history_span_seconds,
            max_series=config.history_max_series,
        )
        self._history_sampler = HistorySampler(
            self.history, lambda: [*self.sources.routing_snapshot().records, *self.references.history_records()]
        )
        # Off the default executor, which alert evaluation shares: public reads cannot starve monitoring.
        self.heavy_reads = BoundedReads()  # /v1/history, /v1/status: bounded, 429 past it
        self._monitoring = monitoring_executor()  # /metrics, /v1/routing: never behind a heavy read
        self.reads = read_views.ReadViews(
            config=config,
            serving=self.serving,
            sources=self.sources,
            policies=self.policies,
            metrics=self.metrics,
            registry=self.registry,
            alerts=self.alerts,
            history=self.history,
            history_store=self.history_store,
            history_store_error=self.history_store_error,
            baselines=self.baselines,
            heavy_reads=self.heavy_reads,
            monitoring=self._monitoring,
            references=self.references,
            clients=self.clients,
            state_writes=self.state_writes,
        )
        self.handlers = HandlerContext(
            config=config,
            clock=clock,
            auth=self.auth,
            policies=self.policies,
            metrics=self.metrics,
            sources=self.sources,
            alerts=self.alerts,
            serving=self.serving,
            reload_rules=self.reload_rules,
            clients=self.clients,
            client_latency=self.client_latency,
        )
        self.app = Starlette(
            routes=self._routes(), lifespan=self._lifespan, exception_handlers={ApiError: self.auth.api_error}
        )

    # ------------------------------------------------------------------ what tests and tools read
    @property
    def probe(self) -> Probe | None:
        return self.sources.probe

    @property
    def engine_routing(self) -> EngineRouting | None:
        return self.sources.engine_routing

    @property
    def remote(self) -> RemoteRouting:
        return self.sources.remote

    @property
    def model_worker(self) -> ModelWorker | None:
        return self.serving.model_worker

    @property
    def retune(self) -> RetuneService | None:
        return self.serving.retune

    @property
    def load_error(self) -> str | None:
        return self.serving.load_error

    def routing_snapshot(self) -> RoutingSnapshot:
        return self.sources.routing_snapshot()

    def _footprint(self) -> FootprintSampler | None:
        """The footprint of a batch: the served model's requests, or the engine's answers beside one."""
        if self.serving.model_worker is not None:
            return self.serving.model_worker.footprint
        engine = self.sources.engine_routing
        return engine.footprint if engine is not None else None

    def wait_ready(self, timeout: float) -> bool:
        return self.serving.ready.wait(timeout)

    # ------------------------------------------------------------------ the parts' stores
    def _open_history_store(self) -> tuple[HistoryStore | None, str | None]:
        """The durable history, or why there is none: serving never depends on it."""
        config = self.config
        if not config.history_retention_days:
            return None, "the durable routing history is off (serve --history-retention 0)"
        path = config.state_dir / HISTORY_FILE
        try:
            store = self._open_history(
                path,
                interval_seconds=config.history_interval_seconds,
                span_seconds=config.history_span_seconds,
                retention_days=config.history_retention_days,
                max_series=config.history_max_series,
                writes=self.state_writes,
            )
        except HistoryStoreError as error:  # a state directory it cannot write: a corrupt file is set aside inside
            log.error("no durable routing history: %s", error)
            return None, f"the durable routing history could not be opened: {error}"
        return store, None

    def _open_baselines(self) -> Baselines:
        """STATE_DIR/baseline.json: learned from healthy traffic, or set by POST /admin/baseline; kept across
        restarts. Learning waits until the routers served are known to be good (``sources.trust_baselines``)."""
        config = self.config
        learn = (
            config.baseline_tokens
            if config.window_tokens is None
            else min(config.baseline_tokens, config.window_tokens)
        )
        baselines = Baselines(
            config.state_dir / "baseline.json", learn_tokens=learn, writes=self.state_writes, gate=config.baseline_gate
        )
        baselines.load()
        return baselines

    # ------------------------------------------------------------------ alerting
    def _alert_service(self) -> AlertService:
        assert self.rules is not None  # made only with rules
        service = AlertService(
            self.rules.current,
            self.config.state_dir,
            records=self._alert_records,
            interval=self.config.alert_interval,
            status_url=self.config.public_url.rstrip("/") + "/" if self.config.public_url else "",
            external_url=self.config.public_url,
            on_notification=lambda receiver, outcome: self.metrics.notifications.labels(receiver, outcome).inc(),
            before_round=self.rules.check_for_changes,  # a changed rule file is loaded by the next round
            trend_source=self.history_store,
            writes=self.state_writes,
        )
        self.metrics.watch_alerts(service.engine)
        return service

    def _alert_records(self) -> tuple[RouterStats, ...]:
        return self.sources.routing_snapshot().records  # baselines it learns are judged from the next round on

    def reload_rules(self) -> list[str]:
        """Load the rules again; on errors keep the rules in force and return the errors."""
        return self.rules.reload().errors if self.rules is not None else []

    def _on_rules_reload(self, result: ReloadResult) -> None:
        if result.changed and self.alerts is not None and self.rules is not None:
            self.alerts.replace_rules(self.rules.current)

    def _on_policy_reload(self, result: ReloadResult) -> None:  # the store logs it
        self.metrics.policy_reloads.labels("ok" if result.ok else "refused").inc()
        self.metrics.policy_version.set(result.version)

    # ------------------------------------------------------------------ life cycle
    def load_model(self) -> None:
        """Load the model, run the attention self-test, attach the probe, start the engine."""
        from mla_watch.models.loading import load_model
        from mla_watch.probe import attach
        from mla_watch.server.model_worker import ModelWorker
        from mla_watch.server.selftest import attention_self_test

        serving, config = self.serving, self.config
        started = time.monotonic()
        log.info(
            'loading the model %s (device %s): until it is ready, completions answer 503 and /readyz "loading"',
            config.model,
            config.device,
        )
        try:
            model, tokenizer = (self._model_loader or load_model)(config.model, device=config.device)
            serving.self_test = attention_self_test(model, config.attn_implementation)
            (log.warning if serving.self_test.refused else log.info)(serving.self_test.message)
            self.metrics.attention_fallback.set(1 if serving.self_test.refused else 0)
            # The counting buffer is sized once (CUDA-graph safe): room for every policy's line and then some;
            # a line added by a later reload past it is counted as `overflow`, with a warning.
            lines = max(16, 2 * len(self.policies.current.lines) + 1)
            probe = self.sources.probe = attach(
                model,
                window_tokens=config.window_tokens,
                window_seconds=config.window_seconds,
                clock=self.clock,
                max_business_lines=lines,
                count_positions=config.routing_by_position,
            )
            if config.return_routed_experts:
                experts = [info for info in probe.routers if info.kind == "expert"]
                serving.routing_layout = RoutingLayout(
                    [info.layer for info in experts],
                    int(model.config.num_hidden_layers),
                    max((info.num_slots for info in experts), default=1),
                )
            serving.model_worker = ModelWorker(
                model,
                tokenizer,
                probe,
                max_queue=config.max_queue,
                clock=self.clock,
                on_job_done=lambda job, seconds: self.metrics.queue_depth.set(
                    cast(ModelWorker, serving.model_worker).queue_depth
                ),
            )  # this worker
            probe.windows.baselines = self.baselines
            expert_slots = [info.num_slots for info in probe.routers if info.kind == "expert"]
            if expert_slots:
                serving.model_worker.footprint = FootprintSampler(max(expert_slots))
            self.retuning.start_local(model, tokenizer)
            self.sources.trust_baselines(serving.retune)
            if self.alerts is not None:  # readings tell the causes of alerts
                self.references.start_local(model, tokenizer, serving.model_worker.model_lock, serving.retune)
            gc.freeze()
            serving.ready.set()
            log.info(
                "ready: the model generates (loaded and checked in %.1f s); /readyz answers 200",
                time.monotonic() - started,
            )
        except Exception as error:
            serving.load_error = f"{type(error).__name__}: {error}"
            log.exception("model failed to load")

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
        config, engine_routing = self.config, self.sources.engine_routing
        if engine_routing is not None:
            engine_routing.windows.baselines = self.baselines
            engine_routing.clients = self.clients
        if config.upstream:
            # No local model to health-check: the engine's routers, or workers' reports.
            self.sources.trust_baselines(self.serving.retune)
            capture = self.retuning.open_capture() if engine_routing is not None else None
            side = self._upstream_side = build_upstream_side(
                config, engine_routing, None if capture is None else self.retuning.capture_answers(capture)
            )
            self.serving.upstream, self.serving.upstream_health = side.upstream, side.health
            self.retuning.start_engine(capture)  # says what it does, or why it does not, in engine_retune_note
            if engine_routing is not None and self.alerts is not None:  # readings tell the causes of alerts
                self.references.start_engine(engine_routing.geometry, self.serving.retune)
            side.start()
            self.serving.ready.set()
        else:
            threading.Thread(target=self.load_model, name="mla-watch-load", daemon=True).start()
        if config.policy_poll_seconds:
            self._stop_watches = [
                self.policies.watch(config.policy_poll_seconds),
                self.references.sets.watch(config.policy_poll_seconds),
            ]
        if self.alerts is not None:
            self.alerts.start()
        self._history_sampler.start()
        if config.public_url:
            log.info("status page: %s/", config.public_url.rstrip("/"))

    async def _shutdown(self) -> None:
        # One budget for every part (mla_watch.common.stop_budget): a part that overruns leaves less to the next.
        budget = StopBudget()
        log.info("stopping: what is in flight is given %g s", PARTS_SECONDS)
        self.references.abandon()  # first: no reading is learned or recorded once the stop began
        self.heavy_reads.shutdown()
        self._monitoring.shutdown(wait=False, cancel_futures=True)
        self._history_sampler.stop()
        if self._upstream_side is not None:  # counts queued: counted within their drain, or dropped and counted so
            await self._upstream_side.close(budget)
        for stop in self._stop_watches:
            stop()
        await asyncio.to_thread(self.references.stop, budget.left())
        if self.alerts is not None:  # the outbox and the alert state saved
            await asyncio.to_thread(self.alerts.stop, budget.left())
        if self.history_store is not None:  # once nothing writes (the reference readings) or reads it (trend rules)
            self.history_store.close()
        if self.serving.model_worker is not None:
            await asyncio.to_thread(self.serving.model_worker.close, budget.left())
        if self.serving.fleet is not None:  # before the re-tune service: a round may promote through it
            await asyncio.to_thread(self.serving.fleet.stop, budget.left())
        if self.serving.retune is not None:
            await asyncio.to_thread(self.serving.retune.stop, budget.left())
        log.info("stopped in %.1f s", PARTS_SECONDS - budget.left())

    # ------------------------------------------------------------------ routes
    def _routes(self) -> list[Route]:
        generation, admin, reads = Generation(self.handlers), Admin(self.handlers), self.reads
        fleet = FleetApi(self.handlers)
        return [
            Route("/v1/completions", generation.completions, methods=["POST"]),
            Route("/v1/chat/completions", generation.chat_completions, methods=["POST"]),
            Route("/v1/models", reads.models, methods=["GET"]),
            Route("/v1/routing", reads.get_routing, methods=["GET"]),
            Route("/v1/routing/ingest", admin.ingest, methods=["POST"]),
            Route("/v1/baseline", reads.get_baseline, methods=["GET"]),
            Route("/v1/reference", reads.get_reference, methods=["GET"]),
            Route("/v1/policies", reads.get_policies, methods=["GET"]),
            Route("/v1/alerts", reads.get_alerts, methods=["GET"]),
            Route("/metrics", reads.scrape, methods=["GET"]),
            Route("/healthz", reads.healthz, methods=["GET"]),
            Route("/readyz", reads.readyz, methods=["GET"]),
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
            Route("/v1/fleet", fleet.get_fleet, methods=["GET"]),
            Route("/admin/fleet/rollout", fleet.rollout, methods=["POST"]),
            Route("/admin/fleet/abort", fleet.abort, methods=["POST"]),
            Route("/", read_views.status_page_index, methods=["GET"]),
            Route("/static/{name}", read_views.static, methods=["GET"]),
            Route("/v1/status", reads.get_status, methods=["GET"]),
            Route("/v1/history", reads.get_history, methods=["GET"]),
        ]


def build_sidecar(config: ServerConfig, *, name_field: FieldNamer | None = None, **kwargs: Any) -> Sidecar:
    """A :class:`Sidecar`, with a configuration error at start-up reported as one readable message, each
    setting named by ``name_field`` (the command line's flags) where it gives a name."""
    from mla_watch.alerting.outbox import OutboxError

    try:
        return Sidecar(config, **kwargs)
    except SettingsError as error:  # the policies, the rules, or the server's own settings
        raise SystemExit(
            f"mla-watch: the {error.what} cannot be used:\n  " + "\n  ".join(error.messages(name_field))
        ) from error
    except (OutboxError, OSError) as error:  # OSError: the state directory cannot even be created
        raise SystemExit(f"mla-watch: the state directory is not usable: {error}") from error
