"""The sidecar's HTTP application: the composition root that wires the parts together.

OpenAI-compatible generation (served by the local model, or forwarded to ``--upstream``),
with the business line's sampling policy enforced on every request; routing statistics,
Prometheus metrics, health, policies, policy reload and routing-snapshot ingestion; the
status page at ``/`` and the JSON behind it (``/v1/status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mla_watch.ingest import IngestError, IngestLimits, RemoteRouting, parse_snapshot
from mla_watch.policy import PolicyError, PolicyRejection, PolicyStore, UnknownBusinessLine, UnknownTask, enforce
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.server import status as status_page
from mla_watch.server.history import HistorySampler, RoutingHistory
from mla_watch.server.metrics import ServerMetrics
from mla_watch.server.requests import (
    ApiError,
    GenerationRequest,
    describe_value,
    parse_body,
    parse_generation_request,
)
from mla_watch.shipped import SHIPPED_POLICIES, SHIPPED_RULES
from mla_watch.statedir import ensure_private_dir
from mla_watch.windows import ALL_LINES, RouterWindows, RoutingSnapshot, take_snapshot

__all__ = ["ServerConfig", "Sidecar"]

log = logging.getLogger("mla_watch.server")

ADMIN_TOKEN_ENV = "MLA_WATCH_ADMIN_TOKEN"
INGEST_TOKEN_ENV = "MLA_WATCH_INGEST_TOKEN"
MIN_TOKEN_LENGTH = 16  # a bearer token anyone could guess is refused at start-up
MAX_CHARS_PER_TOKEN = 32  # no tokenizer in use packs more characters into one token: a bound before tokenizing
MAX_QUERY_VALUE = 64  # characters of a business line in a query string


@dataclass
class ServerConfig:
    model: str = "bundled"
    device: str = "auto"
    policies: Path = SHIPPED_POLICIES
    rules: Path | None = SHIPPED_RULES  # None: no alerting
    state_dir: Path = Path("mla-watch-state")
    dataset_dir: Path | None = None  # re-tune datasets named over the admin API; None: STATE_DIR/datasets
    alert_interval: float = 15.0
    public_url: str = ""  # how on-call reaches this sidecar; links in alerts point there
    upstream: str | None = None
    attn_implementation: str = "sdpa"
    max_queue: int = 32
    request_timeout: float = 60.0
    max_body_bytes: int = 1_000_000
    window_tokens: int | None = 4096
    window_seconds: float | None = None
    policy_poll_seconds: float | None = 1.0
    admin_token: str | None = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV) or None)
    # Workers shipping routing counts hold this one, not the admin key (falls back to the admin token).
    ingest_token: str | None = field(default_factory=lambda: os.environ.get(INGEST_TOKEN_ENV) or None)
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    body_timeout_seconds: float = 10.0  # a request body still arriving after this is refused (408)
    capture: bool = False  # opt-in: record recent traffic (token ids) per business line for re-tuning
    capture_max_samples: int = 2000  # per business line
    capture_max_age_seconds: float = 7 * 86400.0
    retune: RetuneSettings = field(default_factory=RetuneSettings)
    history_interval_seconds: float = 10.0  # the status page's heat map: one point per interval ...
    history_span_seconds: float = 3600.0  # ... over this span


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
        self.alerts = self._alert_service() if config.rules is not None else None
        self._rules_signature = _directory_signature(config.rules) if config.rules is not None else None
        self.model_name = "bundled" if config.model == "bundled" else Path(config.model).name
        self.engine: Any = None
        self.probe: Any = None
        self.retune: Any = None  # the RetuneService, once a local model is loaded
        if self.alerts is not None:
            self.alerts.on_retune(self._on_retune_action)
        self.remote = RemoteRouting(config.ingest_limits, window_tokens=config.window_tokens,
                                    window_seconds=config.window_seconds, clock=clock)
        self.self_test: Any = None
        self.load_error: str | None = None
        self._ready = threading.Event()
        self._stop_watch: Callable[[], None] | None = None
        self._upstream: Any = None
        self.history = RoutingHistory(span_seconds=config.history_span_seconds,
                                      interval_seconds=config.history_interval_seconds)
        self._history_sampler = HistorySampler(self.history, lambda: self.routing_snapshot().as_dicts())
        self.app = Starlette(routes=self._routes(), lifespan=self._lifespan)

    # ------------------------------------------------------------------ alerting
    def _alert_service(self) -> Any:
        from mla_watch.alerting.rules import load_rules_dir
        from mla_watch.alerting.service import AlertService

        rules = load_rules_dir(self.config.rules)  # RuleError at start-up
        service = AlertService(
            rules, self.config.state_dir, records=self._alert_records, interval=self.config.alert_interval,
            status_url=self.config.public_url.rstrip("/") + "/" if self.config.public_url else "",
            external_url=self.config.public_url,
            on_notification=lambda receiver, outcome: self.metrics.notifications.labels(receiver, outcome).inc(),
        )
        self.metrics.watch_alerts(service.engine)
        return service

    def _alert_records(self) -> list[dict[str, Any]]:
        self._reload_rules_if_changed()
        return self.routing_snapshot().as_dicts()

    def routing_snapshot(self) -> RoutingSnapshot:
        """Every router's statistics, per business line and summed: computed once per change of the
        counts, and shared by the metrics, alert evaluation, the history and the APIs."""
        sources = self._routing_sources()  # collects the local probe's counts first
        key = tuple((id(windows), windows.version) for windows in sources)
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
        from mla_watch.alerting.rules import RuleError, load_rules_dir

        if self.alerts is None:
            return []
        self._rules_signature = _directory_signature(self.config.rules)
        try:
            rules = load_rules_dir(self.config.rules)
        except RuleError as error:
            log.error("rule reload refused, the last good rules stay in force: %s", "; ".join(error.errors))
            return error.errors
        self.alerts.replace_rules(rules)
        log.info("rules reloaded: %d rules", len(rules.rules))
        return []

    def _reload_rules_if_changed(self) -> None:
        if self.alerts is not None and _directory_signature(self.config.rules) != self._rules_signature:
            self.reload_rules()

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
            self.probe = mla_watch.attach(model, window_tokens=self.config.window_tokens,
                                          window_seconds=self.config.window_seconds, clock=self.clock)
            self.engine = Engine(model, tokenizer, self.probe, max_queue=self.config.max_queue, clock=self.clock,
                                 on_job_done=lambda job, seconds: self.metrics.queue_depth.set(self.engine.queue_depth))
            self._start_retune(model, tokenizer)
            self._ready.set()
        except Exception as error:
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("model failed to load")

    # ------------------------------------------------------------------ re-tuning
    def _start_retune(self, model: Any, tokenizer: Any) -> None:
        from mla_watch.retune.data import TrafficCapture
        from mla_watch.retune.registry import RouterRegistry
        from mla_watch.retune.runner import Retuner
        from mla_watch.retune.service import RetuneService
        from mla_watch.statedir import ensure_private_dir

        state = ensure_private_dir(self.config.state_dir)  # 0700: it holds captured traffic
        # Jobs from the admin API read datasets from here only (a bare file name, resolved inside it).
        datasets = self.config.dataset_dir if self.config.dataset_dir is not None else state / "datasets"
        ensure_private_dir(datasets)
        registry = RouterRegistry(state / "routers")
        capture = None
        if self.config.capture:
            capture = TrafficCapture(state / "capture.sqlite", max_samples_per_line=self.config.capture_max_samples,
                                     max_age_seconds=self.config.capture_max_age_seconds)

            def record(line: str, token_ids: list[int], prompt_tokens: int) -> None:
                capture.add(line, token_ids, prompt_tokens=prompt_tokens)
                self.metrics.captured_samples.labels(line).inc()

            self.engine.capture = record
        retuner = Retuner(model=model, tokenizer=tokenizer, registry=registry, settings=self.config.retune,
                          workdir=state / "retune-work", promote=lambda version: self.retune.promote(version),
                          capture=capture, model_lock=self.engine.model_lock, model_ref=self.config.model,
                          dataset_dir=datasets)
        self.retune = RetuneService(
            state_dir=state, settings=self.config.retune, retuner=retuner, registry=registry,
            model_lock=self.engine.model_lock, on_promoted=self._routers_changed, on_rejected=self._retune_rejected,
            on_outcome=lambda strategy, outcome: self.metrics.retune_jobs.labels(strategy, outcome).inc(),
        )
        self.retune.start()
        self.metrics.router_version.set(registry.live_version() or 0)

    def _on_retune_action(self, action: Any) -> str:
        """Schedule the job a rule's ``retune`` action asks for; say what became of it (for the page)."""
        router = action.alert.labels.get("router", "")
        if self.retune is None:
            return "no re-tune job: this sidecar serves no local model to re-tune"
        if router not in self.retune.watched_by(None):
            return (f"no re-tune job: {router} is not an expert router of this sidecar's model (routing shipped by "
                    "another process is watched, not re-tuned here)")
        record = self.retune.on_alert(action)
        if record is None:
            return "no new re-tune job: this router is in its re-tune cooldown (see /v1/retune/jobs)"
        return f"re-tune job {record['id']} {record.get('status', 'scheduled')}"

    def _routers_changed(self, kind: str, routers: list[str]) -> None:
        """After a promotion or rollback: the windows restart, describing the routers now serving."""
        self.probe.collect()
        self.probe.windows.reset(routers)
        self.metrics.router_promotions.labels(kind).inc()
        self.metrics.router_version.set(self.retune.registry.live_version() or 0)

    def _retune_rejected(self, spec: JobSpec, result: dict[str, Any]) -> None:
        if self.alerts is None:
            return
        trigger = spec.trigger
        figures = []
        for attempt in result.get("attempts", []):
            line = f"{attempt['strategy']}: {attempt.get('outcome')}"
            gates = attempt.get("gates")
            if gates:
                metric = gates["band"]["metric"]
                line += (f" (perplexity {gates['before']['perplexity']} -> {gates['after']['perplexity']}, "
                         f"{metric} " + ", ".join(f"{name} {gates['before'][metric].get(name)} -> {value}"
                                                  for name, value in gates["after"][metric].items()) + ")")
            if attempt.get("reason"):
                line += f": {attempt['reason']}"
            figures.append(line)
        line_name = spec.business_line or ALL_LINES
        self.alerts.notify_event(
            labels={"alertname": "RouterRetuneRejected", "severity": "warning", "router": ",".join(spec.routers),
                    "layer": str(trigger.get("layer", "")), "business_line": line_name, "job": spec.id},
            annotations={
                "summary": f"Re-tune job {spec.id} for {', '.join(spec.routers)} ({line_name}) was rejected by its "
                           "gates; the live routers are unchanged",
                "description": "; ".join(figures),
                "runbook_url": "https://github.com/mla-watch/mla_watch/blob/main/docs/runbooks.md"
                               "#routerretunerejected",
            },
            receivers=trigger.get("receivers"),
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._startup()
        try:
            yield
        finally:
            await self._shutdown()

    def _startup(self) -> None:
        if self.config.upstream:
            import httpx

            self._upstream = httpx.AsyncClient(base_url=self.config.upstream.rstrip("/"),
                                               timeout=httpx.Timeout(self.config.request_timeout, connect=5.0))
            self._ready.set()
        else:
            threading.Thread(target=self.load_model, name="mla-watch-load", daemon=True).start()
        if self.config.policy_poll_seconds:
            self._stop_watch = self.policies.watch(self.config.policy_poll_seconds)
        if self.alerts is not None:
            self.alerts.start()
        self._history_sampler.start()
        if self.config.public_url:
            log.info("status page: %s/", self.config.public_url.rstrip("/"))

    async def _shutdown(self) -> None:
        self._history_sampler.stop()
        if self._stop_watch is not None:
            self._stop_watch()
        if self.alerts is not None:
            await asyncio.to_thread(self.alerts.stop)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        if self.retune is not None:
            await asyncio.to_thread(self.retune.stop)
        if self._upstream is not None:
            await self._upstream.aclose()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def _on_policy_reload(self, result: Any) -> None:
        self.metrics.policy_reloads.labels("ok" if result.ok else "refused").inc()
        self.metrics.policy_version.set(result.version)
        if result.ok:
            log.info("policies reloaded (version %s)", result.version)
        else:
            log.error("policy reload refused, the last good policies stay in force: %s", "; ".join(result.errors))

    def _routing_sources(self) -> list[RouterWindows]:
        sources = []
        if self.probe is not None:
            self.probe.collect()  # safe beside a running forward: counts are read as deltas
            sources.append(self.probe.windows)
        sources.extend(self.remote.windows())
        return sources

    # ------------------------------------------------------------------ routes
    def _routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/routing", self._routing, methods=["GET"]),
            Route("/v1/routing/ingest", self._ingest, methods=["POST"]),
            Route("/v1/policies", self._policies, methods=["GET"]),
            Route("/v1/alerts", self._alerts, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/readyz", self._readyz, methods=["GET"]),
            Route("/admin/reload", self._admin_reload, methods=["POST"]),
            Route("/v1/retune/jobs", self._retune_jobs, methods=["GET"]),
            Route("/v1/retune/jobs/{job_id}", self._retune_job, methods=["GET"]),
            Route("/v1/retune/versions", self._retune_versions, methods=["GET"]),
            Route("/admin/retune", self._admin_retune, methods=["POST"]),
            Route("/admin/retune/promote", self._admin_promote, methods=["POST"]),
            Route("/admin/retune/rollback", self._admin_rollback, methods=["POST"]),
            Route("/", self._status_page, methods=["GET"]),
            Route("/static/{name}", self._static, methods=["GET"]),
            Route("/v1/status", self._status, methods=["GET"]),
        ]

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _readyz(self, request: Request) -> Response:
        problems = []
        if not self._ready.is_set():
            problems.append(self.load_error or "the model is loading")
        body: dict[str, Any] = {"ready": not problems, "problems": problems,
                                "policies_version": self.policies.version}
        if self.self_test is not None:
            body["attention"] = self.self_test.as_dict()
        return JSONResponse(body, status_code=200 if not problems else 503)

    async def _metrics(self, request: Request) -> Response:
        if self.engine is not None:
            self.metrics.queue_depth.set(self.engine.queue_depth)
        return Response(await asyncio.to_thread(generate_latest, self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        if self._upstream is not None:
            upstream = await self._upstream.get("/v1/models", headers=_forwarded_auth(request))
            return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "mla_watch"}]})

    async def _routing(self, request: Request) -> Response:
        line = request.query_params.get("business_line")
        try:
            body = await asyncio.to_thread(self.routing, line)
        except ApiError as error:
            return self._refused(request, error)
        return JSONResponse(body)

    def routing(self, business_line: str | None = None) -> dict[str, Any]:
        """``GET /v1/routing``: every router's statistics for one line (every line summed for ``None``).

        A line nobody has reported is answered with 404 naming the known ones: reading never
        creates a window, so a query string cannot grow memory.
        """
        snapshot = self.routing_snapshot()
        lines = list(snapshot.business_lines)
        if business_line is not None and business_line not in lines:
            shown = describe_value(business_line)
            if len(business_line) > MAX_QUERY_VALUE:
                raise ApiError(400, f"business_line={shown} is invalid: expected at most {MAX_QUERY_VALUE} "
                                    "characters", param="business_line", code="invalid_value")
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
            return _error_response(ApiError(404, f"no such file: {request.path_params['name']!r}: expected one of "
                                                 f"{sorted(status_page.STATIC_FILES)}", code="not_found"))
        return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _status(self, request: Request) -> Response:
        since = request.query_params.get("since")
        try:
            since_value = None if since is None else float(since)
        except ValueError:
            since_value = float("nan")
        if since_value is not None and not np.isfinite(since_value):
            return _error_response(ApiError(400, f"since={since!r} is invalid: expected a time in seconds since "
                                                 "the epoch (the last `times` entry already shown)",
                                            param="since", code="invalid_value"))
        return JSONResponse(await asyncio.to_thread(self.status, since_value))

    def status(self, since: float | None = None) -> dict[str, Any]:
        """What the status page shows (``GET /v1/status``); ``since`` limits the history to newer points."""
        rules = list(self.alerts.rules.rules) if self.alerts is not None else []
        history = self.history.snapshot(since)
        for series in history["series"]:
            series["band"] = status_page.entropy_band(rules, series)
        policies = self._policies_view()
        body: dict[str, Any] = {
            "generated_at": time.time(), "model": self.model_name, "ready": self._ready.is_set(),
            "load_error": self.load_error, "upstream": self.config.upstream, "history": history,
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

    # ------------------------------------------------------------------ admin
    def _authorise(self, request: Request, token: str | None = None, what: str = "admin") -> None:
        """The bearer token of ``what`` (default: the admin token), compared in constant time."""
        token = self.config.admin_token if what == "admin" else token
        if not token:
            variables = ADMIN_TOKEN_ENV if what == "admin" else f"{INGEST_TOKEN_ENV} or {ADMIN_TOKEN_ENV}"
            raise ApiError(403, f"{what} endpoints are disabled: set {variables} to enable them",
                           code="admin_disabled", error_type="permission_error")
        supplied = request.headers.get("authorization", "")
        if not hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode()):
            raise ApiError(401, "missing or wrong bearer token in the Authorization header",
                           code="unauthorized", error_type="authentication_error")

    def _refused(self, request: Request, error: ApiError) -> Response:
        """The answer to a request refused for bad input or credentials, counted by reason."""
        if error.status < 500:
            self.metrics.bad_requests.labels(request.url.path, error.code or str(error.status)).inc()
        return _error_response(error)

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most ``max_body_bytes``, arrived within ``body_timeout_seconds``."""
        timeout = self.config.body_timeout_seconds
        try:
            return await asyncio.wait_for(_read_body(request, self.config.max_body_bytes), timeout)
        except asyncio.TimeoutError as error:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from error

    async def _admin_reload(self, request: Request) -> Response:
        try:
            self._authorise(request)
        except ApiError as error:
            return _error_response(error)
        result = await asyncio.to_thread(self.policies.reload)
        rule_errors = await asyncio.to_thread(self.reload_rules)
        ok = result.ok and not rule_errors
        return JSONResponse({"ok": ok, "changed": result.changed, "errors": result.errors + rule_errors,
                             "version": result.version}, status_code=200 if ok else 422)

    # ------------------------------------------------------------------ re-tuning API
    def _retune_service(self) -> Any:
        if self.retune is None:
            raise ApiError(503, self.load_error or ("re-tuning needs a local model; this sidecar forwards to "
                                                    f"{self.config.upstream}" if self.config.upstream
                                                    else "the model is still loading"),
                           code="retune_unavailable", error_type="server_error")
        return self.retune

    async def _retune_jobs(self, request: Request) -> Response:
        try:
            service = self._retune_service()
        except ApiError as error:
            return _error_response(error)
        limit = request.query_params.get("limit", "50")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            return _error_response(ApiError(400, f"limit={limit!r} is invalid: expected an integer in [1, 1000]",
                                            param="limit", code="invalid_value"))
        return JSONResponse({"jobs": service.store.list(limit=int(limit))})

    async def _retune_job(self, request: Request) -> Response:
        try:
            service = self._retune_service()
            return JSONResponse(service.store.get(request.path_params["job_id"]))
        except ApiError as error:
            return _error_response(error)
        except KeyError as error:
            return _error_response(ApiError(404, str(error.args[0]), param="job_id", code="not_found"))

    async def _retune_versions(self, request: Request) -> Response:
        try:
            service = self._retune_service()
        except ApiError as error:
            return _error_response(error)
        registry = service.registry
        return JSONResponse({"live": registry.live_version(), "last_good": registry.last_good(),
                             "versions": registry.versions(), "promotions": registry.promotions()})

    async def _admin_retune(self, request: Request) -> Response:
        from mla_watch.retune.service import Cooldown

        try:
            self._authorise(request)
            service = self._retune_service()
            body = parse_body(await _read_body(request, self.config.max_body_bytes))
            spec, force = self._retune_spec(body)
            record = await asyncio.to_thread(service.submit, spec, force=force)
        except ApiError as error:
            return _error_response(error)
        except Cooldown as error:
            return _error_response(ApiError(409, str(error), code="cooldown", param="force"))
        except ValueError as error:
            return _error_response(ApiError(400, str(error), code="invalid_value"))
        return JSONResponse(record, status_code=202)

    def _retune_spec(self, body: dict[str, Any]) -> tuple[JobSpec, bool]:
        """A job from an admin request: ``routers`` (default: those out of band), ``business_line``,
        ``strategy`` (a name or a list), ``rule`` (whose band to meet), ``dataset``, ``options``, ``force``."""
        from mla_watch.retune.data import resolve_dataset, short_repr
        from mla_watch.retune.gates import Band, band_of_rule
        from mla_watch.retune.service import DEFAULT_STRATEGIES
        from mla_watch.windows import NAME_RE, NAME_RULE  # the rule policy files' line names follow

        known = {"routers", "business_line", "strategy", "rule", "dataset", "options", "force"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ApiError(400, f"unknown field(s) [{', '.join(short_repr(name, 40) for name in unknown[:5])}]: "
                                f"expected some of {sorted(known)}", param=unknown[0][:64], code="unknown_field")
        line = body.get("business_line")
        if line is not None and (not isinstance(line, str) or not NAME_RE.fullmatch(line)):
            raise ApiError(400, f"business_line={short_repr(line)} is invalid: expected a business line name of "
                                f"{NAME_RULE}", param="business_line", code="invalid_value")
        lines = sorted(self.policies.current.lines)
        if line is not None and line not in lines:
            raise ApiError(400, f"business_line={short_repr(line)} is not a business line of the policies: expected "
                                f"one of {lines}", param="business_line", code="invalid_value")
        strategies = body.get("strategy", list(DEFAULT_STRATEGIES))
        strategies = [strategies] if isinstance(strategies, str) else strategies
        from mla_watch.retune.strategies import STRATEGIES, get_strategy

        if (not isinstance(strategies, list) or not strategies
                or not all(isinstance(name, str) and name in STRATEGIES for name in strategies)):
            raise ApiError(400, f"strategy={short_repr(body.get('strategy'))} is invalid: expected one of "
                                f"{sorted(STRATEGIES)} or a list of them, tried in order", param="strategy",
                           code="invalid_value")
        rules = self.alerts.rules.rules if self.alerts is not None else ()
        rule_name = body.get("rule")
        candidates = [r for r in rules if (r.name == rule_name if rule_name else "retune" in r.actions)]
        if rule_name and not candidates:
            raise ApiError(400, f"rule={short_repr(rule_name)} is not a loaded rule; rules are "
                                f"{[r.name for r in rules]}", param="rule", code="invalid_value")
        rule = candidates[0] if candidates else None
        band = band_of_rule(rule) if rule is not None else Band("entropy_bits", low=5.2)
        watched = self.retune.watched_by(rule)
        routers = body.get("routers")
        if routers is None:
            self.probe.collect()
            records = self.probe.windows.stats(line)
            routers = [r["name"] for r in records if r["name"] in watched and not r.get("too_small")
                       and r.get(band.metric) is not None and not band.contains(float(r[band.metric]))]
            if not routers:
                raise ApiError(400, f"no watched router is out of band ({band.describe()}) for business line "
                                    f"{line or 'all'} in the current window; name the routers to re-tune",
                               param="routers", code="invalid_value")
        expert_names = self.retune.watched_by(None)
        if (not isinstance(routers, list) or not routers
                or not all(isinstance(name, str) and name in expert_names for name in routers)):
            raise ApiError(400, f"routers={short_repr(routers)} is invalid: expected a list of expert routers among "
                                f"{expert_names}", param="routers", code="invalid_value")
        options = body.get("options", {})
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise ApiError(400, f"options={short_repr(options)} is invalid: expected {{strategy: {{option: value}}}}",
                           param="options", code="invalid_value")
        for name, values in options.items():  # checked now, not when the job runs: a typo is a 400, not a failed job
            if name not in STRATEGIES:
                raise ApiError(400, f"options.{name[:40]}: no strategy is named {short_repr(name, 40)}: expected "
                                    f"options of the strategies {sorted(STRATEGIES)}",
                               param=f"options.{name[:40]}", code="invalid_value")
            try:
                get_strategy(name).parse_options({**self.config.retune.strategy_options.get(name, {}), **values},
                                                 f"options.{name}")
            except ValueError as error:
                raise ApiError(400, str(error), param=f"options.{name}", code="invalid_value") from None
        dataset = body.get("dataset")
        if dataset is not None:
            try:  # a bare name of a file in the dataset directory; any other value gets the same answer
                resolve_dataset(dataset, self.retune.retuner.dataset_dir or self.config.state_dir / "datasets")
            except ValueError as error:
                raise ApiError(400, str(error), param="dataset", code="invalid_value") from None
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise ApiError(400, f"force={short_repr(force)} is invalid: expected true or false", param="force",
                           code="invalid_value")
        spec = JobSpec(routers=routers, watched=watched, strategies=strategies, business_line=line,
                       band=band.as_dict(), dataset=dataset, options=options,
                       max_perplexity_increase=self.config.retune.max_perplexity_increase,
                       trigger={"source": "api", "rule": rule.name if rule else None,
                                "receivers": list(rule.receivers) if rule else None, "at": time.time()})
        return spec, force

    async def _admin_promote(self, request: Request) -> Response:
        try:
            self._authorise(request)
            service = self._retune_service()
            body = parse_body(await _read_body(request, self.config.max_body_bytes))
            from mla_watch.retune.data import short_repr

            version = body.get("version")
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ApiError(400, f"version={short_repr(version)} is invalid: expected a router version number",
                               param="version", code="invalid_value")
            # promote() refuses a version that is not saved (naming the versions there are) before any file access
            await asyncio.to_thread(service.promote, version)
        except ApiError as error:
            return _error_response(error)
        except ValueError as error:
            return _error_response(ApiError(400, str(error), param="version", code="invalid_value"))
        return JSONResponse({"ok": True, "live": service.registry.live_version()})

    async def _admin_rollback(self, request: Request) -> Response:
        try:
            self._authorise(request)
            service = self._retune_service()
            live = await asyncio.to_thread(service.rollback)
        except ApiError as error:
            return _error_response(error)
        except ValueError as error:
            return _error_response(ApiError(409, str(error), code="nothing_to_roll_back"))
        return JSONResponse({"ok": True, "live": live})

    async def _ingest(self, request: Request) -> Response:
        try:
            self._authorise(request, self.config.ingest_token or self.config.admin_token, "ingestion")
            body = parse_body(await self._read_body(request))
            snapshot = await asyncio.to_thread(parse_snapshot, body, self.config.ingest_limits)
            evicted = self.remote.ingest(snapshot)
        except IngestError as error:
            self.metrics.bad_requests.labels(request.url.path, error.code).inc()
            return _error_response(ApiError(error.status, str(error), param=error.field, code=error.code))
        except ApiError as error:
            return self._refused(request, error)
        if evicted is not None:
            with contextlib.suppress(KeyError):
                self.metrics.ingested.remove(evicted)
        self.metrics.ingested.labels(snapshot.source).inc()
        return JSONResponse({"ok": True})

    # ------------------------------------------------------------------ generation
    async def _completions(self, request: Request) -> Response:
        return await self._generation(request, "completion")

    async def _chat_completions(self, request: Request) -> Response:
        return await self._generation(request, "chat")

    async def _generation(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        started = time.perf_counter()
        policy_label: str | None = None
        try:
            if not self._ready.is_set():
                raise ApiError(503, self.load_error or "the model is still loading", code="not_ready",
                               error_type="server_error", headers={"Retry-After": "5"})
            body = parse_body(await self._read_body(request))
            parsed = parse_generation_request(kind, body, {k.lower(): v for k, v in request.headers.items()})
            decision, task = self._decide(parsed)
            policy_label = decision.policy_label
            self.metrics.count_adjustments(decision)
            if self._upstream is not None:
                response = await self._forward(request, parsed, body, decision)
            else:
                response = await self._generate_locally(request, parsed, decision, task)
        except ApiError as error:
            response = self._refused(request, error)
        response.headers["X-MLA-Policy"] = policy_label or "none"
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)
        return response

    def _decide(self, parsed: GenerationRequest) -> tuple[Any, Any]:
        """The policy decision and the task policy it came from (resolved once per request)."""
        try:
            policy, task = self.policies.current.resolve(parsed.business_line, parsed.task)
        except UnknownBusinessLine as error:
            raise ApiError(400, str(error), param="X-Business-Line", code="unknown_business_line") from error
        except UnknownTask as error:
            raise ApiError(400, str(error), param="X-Task", code="unknown_task") from error
        if parsed.model is not None and self._upstream is None and parsed.model != self.model_name:
            raise ApiError(404, f"model={parsed.model!r} is not served here; expected {self.model_name!r}",
                           param="model", code="model_not_found")
        try:
            return enforce(policy, task, parsed.sampling), task
        except PolicyRejection as error:
            self.metrics.policy_rejections.labels(error.business_line, error.task, error.param).inc()
            raise ApiError(400, str(error), param=error.param, code="policy_violation") from error
        except TypeError as error:
            raise ApiError(400, str(error), code="invalid_value") from error

    def _prompt_ids(self, parsed: GenerationRequest, decision: Any, task: Any) -> list[int]:
        """Tokenize the prompt (in a worker thread: it can take a while) and check it fits."""
        limit = int(self.engine.model.config.max_position_embeddings)
        most_tokens = min(limit, task.max_prompt_tokens or limit)
        chars = len(parsed.prompt) if parsed.kind != "chat" else sum(len(m["content"]) for m in parsed.messages)
        if chars > most_tokens * MAX_CHARS_PER_TOKEN:
            raise ApiError(400, f"the prompt has {chars} characters; at most {most_tokens * MAX_CHARS_PER_TOKEN} "
                                f"are read ({most_tokens} tokens of at most {MAX_CHARS_PER_TOKEN} characters)",
                           param="messages" if parsed.kind == "chat" else "prompt", code="prompt_too_long")
        tokenizer = self.engine.tokenizer
        if parsed.kind == "chat":
            encoded = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=True)
            ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        else:
            ids = tokenizer(parsed.prompt, add_special_tokens=False)["input_ids"]
        ids = [tokenizer.bos_token_id, *list(ids)]
        if task.max_prompt_tokens is not None and len(ids) > task.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the {decision.policy_label} policy allows at most "
                                f"{task.max_prompt_tokens}", param="messages" if parsed.kind == "chat" else "prompt",
                           code="prompt_too_long")
        max_tokens = int(decision.applied.get("max_tokens", 16))
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: "
                                f"{len(ids) + max_tokens} exceeds the model's context of {limit} tokens",
                           param="messages" if parsed.kind == "chat" else "prompt", code="context_length_exceeded")
        return ids

    async def _generate_locally(self, request: Request, parsed: GenerationRequest, decision: Any,
                                task: Any) -> Response:
        from mla_watch.sampling import SamplingParams
        from mla_watch.server.engine import Job, Overloaded

        prompt_ids = await asyncio.to_thread(self._prompt_ids, parsed, decision, task)
        applied = decision.applied
        try:
            params = SamplingParams(
                temperature=float(applied.get("temperature", 1.0)), top_p=float(applied.get("top_p", 1.0)),
                top_k=int(applied.get("top_k", 0)), repetition_penalty=float(applied.get("repetition_penalty", 1.0)),
                max_tokens=int(applied.get("max_tokens", 16)), n=int(applied.get("n", 1)), seed=parsed.seed,
                stop=parsed.stop,
            )
        except ValueError as error:  # a policy may allow what the sampler cannot do (top_p 0, say)
            raise ApiError(400, str(error), code="invalid_value") from error
        job = Job(prompt_ids=prompt_ids, params=params, business_line=decision.business_line,
                  deadline=self.clock() + self.config.request_timeout, loop=asyncio.get_running_loop(),
                  prompt_tokens=len(prompt_ids))
        try:
            self.engine.submit(job)
        except Overloaded as error:
            self.metrics.overloaded.inc()
            raise ApiError(429, str(error), code="overloaded", error_type="rate_limit_error",
                           headers={"Retry-After": str(error.retry_after)}) from error
        self.metrics.queue_depth.set(self.engine.queue_depth)
        self.metrics.prompt_tokens.labels(decision.business_line).inc(len(prompt_ids))
        answer = _Answer(parsed, decision, self.model_name, len(prompt_ids), params.n)
        if parsed.stream:
            return StreamingResponse(self._stream(job, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while (event := await job.next_event()) is not None:
                answer.add(event)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        except Exception as error:
            raise self._job_error(error) from error
        self.metrics.completion_tokens.labels(decision.business_line).inc(sum(answer.completion_tokens))
        return JSONResponse(answer.body())

    def _job_error(self, error: Exception) -> ApiError:
        from mla_watch.server.engine import JobTimedOut

        if isinstance(error, JobTimedOut):
            self.metrics.timeouts.inc()
            return ApiError(503, f"{error} (timeout {self.config.request_timeout:g} s)", code="timeout",
                            error_type="server_error", headers={"Retry-After": "1"})
        return ApiError(500, str(error), code="generation_failed", error_type="server_error")

    async def _stream(self, job: Any, answer: _Answer) -> AsyncIterator[bytes]:
        finished = False
        try:
            yield _sse(answer.first_chunk())
            while (event := await job.next_event()) is not None:
                chunk = answer.add(event)
                if chunk is not None:
                    yield _sse(chunk)
            if answer.parsed.include_usage:
                yield _sse(answer.usage_chunk())
            yield b"data: [DONE]\n\n"
            finished = True
            self.metrics.completion_tokens.labels(answer.decision.business_line).inc(sum(answer.completion_tokens))
        except Exception as error:
            api_error = self._job_error(error)
            yield _sse(api_error.body())
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away mid-stream: free the model for others
                job.cancelled.set()
                self.metrics.client_disconnects.inc()

    # ------------------------------------------------------------------ proxy
    async def _forward(self, request: Request, parsed: GenerationRequest, body: dict[str, Any],
                       decision: Any) -> Response:
        import httpx

        payload = parsed.upstream_body(body, decision.applied)
        headers = {"Content-Type": "application/json", **_forwarded_auth(request),
                   "X-Business-Line": decision.business_line, "X-Task": decision.task}
        path = request.url.path
        extra = decision.as_dict()
        try:
            if not parsed.stream:
                upstream = await self._upstream.post(path, json=payload, headers=headers)
                if upstream.status_code != 200:
                    return Response(upstream.content, status_code=upstream.status_code,
                                    media_type=upstream.headers.get("content-type", "application/json"))
                document = upstream.json()
                document["mla_watch"] = extra
                return JSONResponse(document)
            upstream_request = self._upstream.build_request("POST", path, json=payload, headers=headers)
            upstream = await self._upstream.send(upstream_request, stream=True)
        except httpx.HTTPError as error:
            raise ApiError(502, f"upstream {self.config.upstream} failed: {type(error).__name__}: {error}",
                           code="upstream_error", error_type="server_error") from error
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))
        return StreamingResponse(_relay_stream(upstream, extra), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


class _Answer:
    """Accumulates token events into an OpenAI response body or stream chunks."""

    def __init__(self, parsed: GenerationRequest, decision: Any, model: str, prompt_tokens: int, n: int) -> None:
        self.parsed = parsed
        self.decision = decision
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.texts = [""] * n
        self.finish = [None] * n
        self.completion_tokens = [0] * n

    @property
    def extra(self) -> dict[str, Any]:
        return self.decision.as_dict()

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.parsed.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.parsed.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, finish: str | None, chunk: bool) -> dict[str, Any]:
        if self.parsed.kind == "chat":
            key = "delta" if chunk else "message"
            content = {"content": text} if chunk else {"role": "assistant", "content": text}
            return {"index": index, key: content, "finish_reason": finish, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

    def add(self, event: Any) -> dict[str, Any] | None:
        index = event.index
        if event.token_id is not None:
            self.completion_tokens[index] += 1
        self.texts[index] += event.text
        if event.finish_reason is not None:
            self.finish[index] = event.finish_reason
        if not event.text and event.finish_reason is None:
            return None
        return {**self._envelope(chunk=True), "choices": [self._choice(index, event.text, event.finish_reason, True)]}

    def first_chunk(self) -> dict[str, Any]:
        if self.parsed.kind == "chat":
            choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                        "logprobs": None} for i in range(len(self.texts))]
        else:
            choices = [{"index": i, "text": "", "finish_reason": None, "logprobs": None}
                       for i in range(len(self.texts))]
        return {**self._envelope(chunk=True), "choices": choices, "mla_watch": self.extra}

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(chunk=True), "choices": [], "usage": self.usage()}

    def body(self) -> dict[str, Any]:
        choices = [self._choice(i, text, self.finish[i], False) for i, text in enumerate(self.texts)]
        return {**self._envelope(chunk=False), "choices": choices, "usage": self.usage(), "mla_watch": self.extra}


async def _relay_stream(upstream: Any, extra: dict[str, Any]) -> AsyncIterator[bytes]:
    """Pass the upstream's server-sent events through, adding mla_watch's object to the first chunk."""
    first = True
    try:
        async for line in upstream.aiter_lines():
            if first and line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                try:
                    chunk = json.loads(line[5:])
                    chunk["mla_watch"] = extra
                    line = "data: " + json.dumps(chunk)
                    first = False
                except json.JSONDecodeError:
                    pass
            yield (line + "\n").encode()
    finally:
        await upstream.aclose()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _forwarded_auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"Authorization": value} if value else {}


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; at most {limit} are accepted",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect as error:
        raise ApiError(400, "the client disconnected while sending the body", code="client_disconnected") from error
    return b"".join(chunks)


def _directory_signature(directory: Path | None) -> tuple:
    if directory is None or not directory.is_dir():
        return ()
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in directory.glob("*.y*ml")))


class ConfigError(ValueError):
    """The sidecar's configuration cannot be served; the message names the setting and what it needs."""


def _check_tokens(config: ServerConfig) -> None:
    for variable, token in ((ADMIN_TOKEN_ENV, config.admin_token), (INGEST_TOKEN_ENV, config.ingest_token)):
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"{variable} has {len(token)} characters: expected at least {MIN_TOKEN_LENGTH}, "
                              "random (python -c 'import secrets; print(secrets.token_urlsafe())')")


def build_sidecar(config: ServerConfig, **kwargs: Any) -> Sidecar:
    """A :class:`Sidecar`, with a configuration error at start-up reported as one readable message."""
    from mla_watch.alerting.outbox import OutboxError
    from mla_watch.alerting.rules import RuleError

    try:
        return Sidecar(config, **kwargs)
    except PolicyError as error:
        raise SystemExit("mla-watch: the policies do not load:\n  " + "\n  ".join(error.errors)) from error
    except RuleError as error:
        raise SystemExit("mla-watch: the rules do not load:\n  " + "\n  ".join(error.errors)) from error
    except ConfigError as error:
        raise SystemExit(f"mla-watch: {error}") from error
    except (OutboxError, OSError) as error:  # OSError: the state directory cannot even be created
        raise SystemExit(f"mla-watch: the state directory is not usable: {error}") from error
