"""The sidecar's read endpoints: health, readiness, ``/metrics``, models, routing, baselines, policies,
alerts, the status page and the JSON behind it (``/v1/status``), and the durable history (``/v1/history``).

Monitoring reads (``/metrics``, ``/v1/routing``, ``/v1/baseline``) run on their own threads, never behind a
heavy read; the heavy ones (``/v1/status``, ``/v1/history``) are bounded, 429 past it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mla_watch.alerting.alert_service import AlertService
from mla_watch.common.state_writes import StateWrites
from mla_watch.history.store import HistoryStore
from mla_watch.policy.files import PolicyStore
from mla_watch.routing.baselines import Baselines
from mla_watch.routing.clients import ClientShares
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE
from mla_watch.server import status as status_page
from mla_watch.server.config import ServerConfig
from mla_watch.server.exposition import exposition
from mla_watch.server.handler_context import Serving
from mla_watch.server.history_api import MAX_CELLS, HistoryQuery, encode_history, parse_history_query, too_large
from mla_watch.server.metrics import BadMetricsParam, ServerMetrics, metrics_view
from mla_watch.server.reads import BoundedReads
from mla_watch.server.reference_readings import References
from mla_watch.server.requests import ApiError, describe_value
from mla_watch.server.sources import RoutingSources

__all__ = ["BASELINE_VIEW_LIMIT", "ReadViews", "static", "status_page_index"]

BASELINE_VIEW_LIMIT = 5000  # series in one GET /v1/baseline (a fleet's workers may report many more)
REFERENCE_VIEW_LINES = 64  # business lines whose clients one GET /v1/reference shows


class ReadViews:
    """The read endpoints, and the documents they answer with."""

    def __init__(
        self,
        *,
        config: ServerConfig,
        serving: Serving,
        sources: RoutingSources,
        policies: PolicyStore,
        metrics: ServerMetrics,
        registry: CollectorRegistry,
        alerts: AlertService | None,
        history: HistoryStore,
        history_store: HistoryStore | None,
        history_store_error: str | None,
        baselines: Baselines,
        heavy_reads: BoundedReads,
        monitoring: ThreadPoolExecutor,
        references: References,
        clients: ClientShares,
        state_writes: StateWrites | None = None,
    ) -> None:
        self.config = config
        self.serving = serving
        self.sources = sources
        self.policies = policies
        self.metrics = metrics
        self.registry = registry
        self.alerts = alerts
        self.history = history  # the live hour: history_store itself, or a store in memory without it
        self.history_store = history_store
        self.history_store_error = history_store_error
        self.baselines = baselines
        self.heavy_reads = heavy_reads
        self.monitoring = monitoring
        self.references = references
        self.clients = clients
        self.state_writes = state_writes

    # ------------------------------------------------------------------ health and monitoring
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """``GET /readyz``: 200 once the model generates (beside an engine: while the upstream answers), else 503;
        ``status`` says which: ``ready``, ``loading``, ``failed`` (the model did not load: ``problems`` says why)
        or ``upstream_unavailable``. ``state_unwritable`` lists the files of the state directory that cannot be
        written now (a full or read-only disk): the sidecar still serves, alerts and pages, holding what it could
        not write in memory, so they do not make it unready."""
        serving = self.serving
        problems = []
        status = "ready"
        if not serving.ready.is_set():
            status = "failed" if serving.load_error else "loading"
            problems.append(serving.load_error or "the model is loading")
        elif serving.upstream_health is not None and (problem := await serving.upstream_health.current()):
            status = "upstream_unavailable"
            problems.append(problem)
        body: dict[str, Any] = {
            "ready": not problems,
            "status": status,
            "problems": problems,
            "policies_version": self.policies.version,
            "state_unwritable": self.state_writes.failing() if self.state_writes else [],
        }
        if serving.self_test is not None:
            body["attention"] = serving.self_test.as_dict()
        if serving.fleet is not None:  # the store down stops re-tuning, not serving: said, not unready
            fleet = serving.fleet.status()
            body["fleet"] = {
                "name": fleet["name"],
                "store": fleet["store"],
                "store_up": fleet["store_up"],
                "version": fleet["version"],
                "digest": fleet["digest"],
                "detail": "the fleet's store answers"
                if fleet["store_up"]
                else f"re-tuning waits: {fleet['store_error'] or 'the fleet store was not reached yet'}",
            }
        return JSONResponse(body, status_code=200 if not problems else 503)

    async def scrape(self, request: Request) -> Response:
        """``GET /metrics``; ``?shard=K/N`` answers one router shard's series alone, ``?experts=none`` leaves out
        the per-expert window counts (a fleet's Prometheus servers each take a share: docs/fleet.md)."""
        if self.serving.model_worker is not None:
            self.metrics.queue_depth.set(self.serving.model_worker.queue_depth)
        params = dict(request.query_params)
        try:
            source = metrics_view(self.metrics, params) if params else self.registry
        except BadMetricsParam as error:
            raise ApiError(400, str(error), param=error.param, code="invalid_value") from None
        body = await asyncio.get_running_loop().run_in_executor(self.monitoring, exposition, source)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        if self.serving.upstream is not None:
            return await self.serving.upstream.models(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.serving.model_name, "object": "model", "created": 0, "owned_by": "mla_watch"}],
            }
        )

    # ------------------------------------------------------------------ routing and baselines
    async def get_routing(self, request: Request) -> Response:
        line = request.query_params.get("business_line")
        # Encoded on the thread too: every router's record of a wide fleet is no job for the event loop.
        body = await asyncio.get_running_loop().run_in_executor(
            self.monitoring, lambda: JSONResponse(self.routing(line)).body
        )
        return Response(body, media_type="application/json")

    def routing(self, business_line: str | None = None) -> dict[str, Any]:
        """``GET /v1/routing``: every router's statistics for one line (every line summed for ``None``).

        A line nobody has reported is answered with 404 naming the known ones: reading never
        creates a window, so a query string cannot grow memory.
        """
        snapshot = self.sources.routing_snapshot()
        lines = list(snapshot.business_lines)
        if business_line is not None and business_line not in lines:
            shown = describe_value(business_line)
            if not NAME_RE.fullmatch(business_line):
                raise ApiError(
                    400,
                    f"business_line={shown} is invalid: expected {NAME_RULE}",
                    param="business_line",
                    code="invalid_value",
                )
            raise ApiError(
                404,
                f"business_line={shown} has no routing counts here; known lines: {', '.join(lines[:50]) or 'none yet'}",
                param="business_line",
                code="not_found",
            )
        routers = [record.as_dict() for record in snapshot.for_line(business_line)]
        answer: dict[str, Any] = {"business_line": business_line, "business_lines": lines, "routers": routers}
        probe, engine = self.sources.probe, self.sources.engine_routing
        positions = probe.positions if probe is not None else engine.positions if engine is not None else None
        if positions is not None:
            answer["positions"] = positions.as_dict(business_line)
        return answer

    async def get_reference(self, request: Request) -> Response:
        """``GET /v1/reference``: the reference prompt sets, their latest readings against their healthy baselines,
        and each business line's clients (token shares now and over the long run)."""

        def body() -> bytes:
            lines = [None, *self.sources.routing_snapshot().business_lines]
            clients = {line or ALL_LINES: self.clients.shares(line) for line in lines[:REFERENCE_VIEW_LINES]}
            # render() gives bytes; starlette's types allow a memoryview
            return cast(bytes, JSONResponse({**self.references.describe(), "clients": clients}).body)

        return Response(
            await asyncio.get_running_loop().run_in_executor(self.monitoring, body), media_type="application/json"
        )

    async def get_baseline(self, request: Request) -> Response:
        """``GET /v1/baseline``: whether healthy baselines are learned (and why not), and each series' healthy
        values (no counts), at most :data:`BASELINE_VIEW_LIMIT` series."""

        def body() -> bytes:
            document = self.baselines.describe()
            series = document["series"]
            document["series"], document["truncated"] = (
                series[:BASELINE_VIEW_LIMIT],
                max(0, len(series) - BASELINE_VIEW_LIMIT),
            )
            return cast(bytes, JSONResponse(document).body)  # render() gives bytes

        return Response(
            await asyncio.get_running_loop().run_in_executor(self.monitoring, body), media_type="application/json"
        )

    # ------------------------------------------------------------------ policies and alerts
    def reload_errors(self) -> list[str] | None:
        """Why the last policy reload was refused (``None`` if it was not)."""
        error = self.policies.last_error
        return None if error is None else error.errors

    def alert_list(self) -> list[dict[str, Any]]:
        return self.alerts.alert_views() if self.alerts is not None else []

    def policies_view(self) -> list[dict[str, Any]]:
        """Each line's tasks with what was clamped, refused and filled in by default, by parameter."""
        return status_page.policies_view(
            self.policies.current.as_dict(),
            status_page.counter_values(self.metrics.policy_adjustments),
            status_page.counter_values(self.metrics.policy_rejections),
            status_page.counter_values(self.metrics.policy_defaults),
        )

    async def get_policies(self, request: Request) -> Response:
        counts = {
            line["business_line"]: {
                task["task"]: {
                    "clamped": task["adjustments"],
                    "refused": task["rejections"],
                    "defaulted": task["defaults"],
                }
                for task in line["tasks"]
            }
            for line in self.policies_view()
        }
        return JSONResponse(
            {
                "version": self.policies.version,
                **self.policies.current.as_dict(),
                "counts": counts,
                "last_reload_error": self.reload_errors(),
            }
        )

    async def get_alerts(self, request: Request) -> Response:
        if self.alerts is None:
            return JSONResponse({"alerts": [], "rules": 0})
        return JSONResponse(
            {
                "alerts": self.alert_list(),
                "rules": len(self.alerts.rules.rules),
                "notifications_pending": self.alerts.outbox.pending(),
                "notifications_held": self.alerts.outbox.held,
            }
        )

    # ------------------------------------------------------------------ status page
    async def get_status(self, request: Request) -> Response:
        since = request.query_params.get("since")
        try:
            since_value = None if since is None else float(since)
        except ValueError:
            since_value = float("nan")
        if since_value is not None and not np.isfinite(since_value):
            raise ApiError(
                400,
                f"since={describe_value(since)} is invalid: expected a time in seconds since the "
                "epoch (the last `times` entry already shown)",
                param="since",
                code="invalid_value",
            )
        body = await self.heavy_reads.run("GET /v1/status", lambda: JSONResponse(self.status(since_value)).body)
        return Response(body, media_type="application/json")

    def status(self, since: float | None = None) -> dict[str, Any]:
        """What the status page shows (``GET /v1/status``); ``since`` limits the history to newer points."""
        serving = self.serving
        rules = list(self.alerts.rules.rules) if self.alerts is not None else []
        history = self.history.recent(since)
        # Whether each series' window says anything now: the page greys what does not, in every view of it.
        no_signal = {
            (record.router.name, record.line_label): record.stats.no_signal
            for record in self.sources.routing_snapshot().records
        }
        for series in history["series"]:
            series["band"] = status_page.entropy_band(rules, series)
            series["no_signal"] = no_signal.get((series["router"], series["business_line"]))
        policies = self.policies_view()
        upstream_problem = serving.upstream_health.problem if serving.upstream_health is not None else None
        body: dict[str, Any] = {
            "generated_at": time.time(),
            "model": serving.model_name,
            "ready": serving.ready.is_set() and upstream_problem is None,
            "load_error": serving.load_error,
            "upstream": self.config.upstream,
            "upstream_problem": upstream_problem,
            "engine": self.engine_status(),
            "history": history,
            "history_store": None
            if self.history_store is None
            else {
                "retention_days": self.history_store.retention_days,
                "max_series": self.history_store.max_series,
                "series_dropped": self.history_store.dropped_series,
            },
            "alerts": self.alert_list(),
            "rules": len(rules),
            "baselines": self.baselines.summary(brief=True),  # what is not learned and why, what was learned again
            "notifications_pending": self.alerts.outbox.pending() if self.alerts is not None else 0,
            "state_unwritable": self.state_writes.failing() if self.state_writes else [],
            "policies": {
                "version": self.policies.version,
                "lines": policies,
                "last_reload_error": self.reload_errors(),
            },
            "retune": None,
            # each line's clients (token shares of its window now, and over the long run): the page names them
            "clients": {
                line: self.clients.shares(None if line == ALL_LINES else line)
                for line in sorted({ALL_LINES, *(series["business_line"] for series in history["series"])})[
                    :REFERENCE_VIEW_LINES
                ]
            },
        }
        if serving.retune is not None:
            versions = serving.retune.versions
            body["retune"] = {
                "live": versions.live_version(),
                "last_good": versions.last_good(),
                "jobs": serving.retune.store.list(limit=20),
                "promotions": versions.promotions()[-50:],
            }
        return body

    def engine_status(self) -> dict[str, Any] | None:
        """The engine beside (``None`` beside none): its routers, problems, re-tuning and counting."""
        if self.sources.engine_routing is None:
            return None
        status = self.sources.engine_status(
            retune_note=self.serving.engine_retune_note, counting=self.counting_status()
        )
        health = self.serving.upstream_health
        if status is not None and health is not None and health.problem is not None:
            status["problems"] = [health.problem, *status["problems"]]
        return status

    def counting_status(self) -> dict[str, Any] | None:
        """Answers still to count (they are counted after the client has them) and vLLM streams' replays."""
        upstream = self.serving.upstream
        if upstream is None or upstream.counter is None:
            return None
        replayer = upstream.replayer
        budget = None if replayer is None else dataclasses.asdict(replayer.budget)
        return {
            "queued": upstream.counter.queued,
            "queue_bytes": upstream.counter.max_bytes,
            "replays_waiting": 0 if replayer is None else replayer.waiting,
            "replay": budget,
        }

    # ------------------------------------------------------------------ durable history
    async def get_history(self, request: Request) -> Response:
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
            body = self.history_store.query(
                since=query.since,
                until=query.until,
                step=query.step,
                metric=query.metric,
                business_line=query.business_line,
                router=query.router,
                max_cells=MAX_CELLS,
            )
        except ValueError as error:
            raise too_large(query.step, str(error)) from error
        rules = list(self.alerts.rules.rules) if self.alerts is not None and query.metric == "entropy_bits" else []
        for series in body["series"]:
            series["band"] = status_page.entropy_band(rules, series)
        return body


async def status_page_index(request: Request) -> Response:
    """``GET /``: the status page."""
    content, media_type = status_page.static_file("index.html")
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})


async def static(request: Request) -> Response:
    """``GET /static/{name}``: the status page's script and style."""
    try:
        content, media_type = status_page.static_file(request.path_params["name"])
    except KeyError:
        raise ApiError(
            404,
            f"no such file: {describe_value(request.path_params['name'])}: expected one of "
            f"{sorted(status_page.STATIC_FILES)}",
            code="not_found",
        ) from None
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
