"""The endpoints that change the sidecar (bearer tokens) and the re-tuning API.

``/admin/reload``, ``/admin/retune`` (+ ``/promote``, ``/rollback``) need the admin token;
``/v1/routing/ingest`` the ingestion token; ``/v1/retune/jobs`` and ``/v1/retune/versions`` are
read-only and open. Every refusal is an :class:`ApiError`, answered by the app's one handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mla_watch.common.describe import describe_value
from mla_watch.common.state_dir import DATASETS_DIR_NAME
from mla_watch.common.values import is_integer
from mla_watch.engines.swap import SwapError
from mla_watch.retune.jobs import JobSpec
from mla_watch.retune.specs import job_band, request_job_spec
from mla_watch.routing.ingest import IngestError, parse_snapshot
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE
from mla_watch.server.requests import ApiError

if TYPE_CHECKING:  # the re-tuning service (and what it needs) is imported only where a request uses it
    from mla_watch.retune.service import RetuneService
    from mla_watch.server.handler_context import HandlerContext

__all__ = ["Admin"]


class Admin:
    """Policy and rule reload, routing ingestion, and re-tuning jobs, versions and promotion."""

    def __init__(self, ctx: HandlerContext) -> None:
        self.ctx = ctx

    async def reload(self, request: Request) -> Response:
        self.ctx.auth.authorise_admin(request)
        result = await asyncio.to_thread(self.ctx.policies.reload)
        rule_errors = await asyncio.to_thread(self.ctx.reload_rules)
        ok = result.ok and not rule_errors
        return JSONResponse(
            {"ok": ok, "changed": result.changed, "errors": result.errors + rule_errors, "version": result.version},
            status_code=200 if ok else 422,
        )

    async def baseline(self, request: Request) -> Response:
        """``POST /admin/baseline``: the routing now (one ``business_line``, or every line) becomes the
        healthy reference that ``js_divergence`` (drift) is measured from; kept in STATE_DIR."""
        self.ctx.auth.authorise_admin(request)
        line = request.query_params.get("business_line")
        lines = (await asyncio.to_thread(self.ctx.sources.routing_snapshot)).business_lines
        if line is not None and line not in lines:
            raise ApiError(
                404,
                f"business_line={describe_value(line)} has no routing counts here; known lines: "
                f"{', '.join(lines[:50]) or 'none yet'}",
                param="business_line",
                code="not_found",
            )
        document = await asyncio.to_thread(self.ctx.sources.save_baseline, line)
        if document is None:
            raise ApiError(
                409,
                "no routers of this sidecar's own to take a baseline of yet (the model is loading, or "
                "no --engine is read)",
                code="not_ready",
            )
        return JSONResponse(document)

    async def ingest(self, request: Request) -> Response:
        self.ctx.auth.authorise_ingest(request)
        body = await self.ctx.read_json(request)
        try:
            snapshot = await asyncio.to_thread(parse_snapshot, body, self.ctx.config.ingest_limits)
            evicted = self.ctx.sources.remote.ingest(snapshot)
        except IngestError as error:
            raise ApiError(error.status, str(error), param=error.field, code=error.code) from None
        metrics = self.ctx.metrics
        if evicted is not None:
            with contextlib.suppress(KeyError):
                metrics.ingested.remove(evicted)
        metrics.ingested.labels(snapshot.source).inc()
        return JSONResponse({"ok": True})

    # ------------------------------------------------------------------ re-tuning
    def _service(self) -> RetuneService:
        ctx = self.ctx
        if ctx.serving.retune is None:
            serving = ctx.serving
            raise ApiError(
                503,
                serving.load_error
                or (
                    f"no re-tuning beside the engine at {ctx.config.upstream}: {serving.engine_retune_note}"
                    if ctx.config.upstream
                    else "the model is still loading"
                ),
                code="retune_unavailable",
                error_type="server_error",
            )
        return ctx.serving.retune

    async def jobs(self, request: Request) -> Response:
        service = self._service()
        limit = request.query_params.get("limit", "50")
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 4 and 1 <= int(limit) <= 1000):
            raise ApiError(
                400,
                f"limit={describe_value(limit)} is invalid: expected an integer in [1, 1000]",
                param="limit",
                code="invalid_value",
            )
        return JSONResponse({"jobs": service.store.list(limit=int(limit))})

    async def job(self, request: Request) -> Response:
        service = self._service()
        try:
            return JSONResponse(service.store.get(request.path_params["job_id"]))
        except KeyError as error:
            raise ApiError(404, str(error.args[0]), param="job_id", code="not_found") from None

    async def versions(self, request: Request) -> Response:
        router_versions = self._service().versions
        return JSONResponse(
            {
                "live": router_versions.live_version(),
                "last_good": router_versions.last_good(),
                "versions": router_versions.versions(),
                "promotions": router_versions.promotions(),
            }
        )

    async def retune(self, request: Request) -> Response:
        self.ctx.auth.authorise_admin(request)
        service = self._service()
        spec, force = self._retune_spec(await self.ctx.read_json(request))
        from mla_watch.retune.service import Cooldown

        try:
            record = await asyncio.to_thread(self._submit, service, spec, force)
        except Cooldown as error:
            raise ApiError(409, str(error), code="cooldown", param="force") from None
        except ValueError as error:
            raise ApiError(400, str(error), code="invalid_value") from None
        return JSONResponse(record, status_code=202)

    def _submit(self, service: RetuneService, spec: JobSpec, force: bool) -> dict[str, Any]:
        """Schedule ``spec`` here; in a fleet, as the fleet's canary under its lease (409 while it has re-tuning
        under way)."""
        fleet = self.ctx.serving.fleet
        if fleet is None:
            return service.submit(spec, force=force)
        from mla_watch.fleet.fleet_store import FleetStoreError
        from mla_watch.fleet.member import FleetRefusal

        try:
            return fleet.submit(spec, force=force)
        except FleetRefusal as error:
            raise ApiError(409, str(error), code="fleet_busy") from None
        except FleetStoreError as error:
            raise ApiError(
                503,
                f"{error}; in a fleet, re-tuning waits for its store",
                code="fleet_store_unavailable",
                error_type="server_error",
            ) from None

    def _not_in_a_fleet(self, what: str) -> None:
        if self.ctx.serving.fleet is not None:
            raise ApiError(
                409,
                f"this replica is in a fleet: its routers follow the fleet's versions, so {what} is "
                'refused here; POST /admin/fleet/rollout {"version": N} rolls a fleet version out '
                "(GET /v1/fleet lists them)",
                code="in_a_fleet",
            )

    async def promote(self, request: Request) -> Response:
        self.ctx.auth.authorise_admin(request)
        service = self._service()
        self._not_in_a_fleet("promoting a router version on one replica")
        version = await self._version(request)
        try:  # refuses a version that is not saved (naming the versions there are) before any file access
            await asyncio.to_thread(service.promote, version)
        except ValueError as error:
            raise ApiError(400, str(error), param="version", code="invalid_value") from None
        except SwapError as error:
            raise ApiError(
                502,
                f"the engine did not take router version {version}: {error}",
                code="swap_failed",
                error_type="server_error",
            ) from None
        return JSONResponse({"ok": True, "live": service.versions.live_version()})

    async def mark_good(self, request: Request) -> Response:
        self.ctx.auth.authorise_admin(request)
        service = self._service()
        version = await self._version(request)
        try:
            marked = await asyncio.to_thread(service.mark_good, version)
        except ValueError as error:
            raise ApiError(400, str(error), param="version", code="invalid_value") from None
        return JSONResponse({"ok": True, "marked_good": marked, "last_good": service.versions.last_good()})

    async def _version(self, request: Request) -> int:
        version = (await self.ctx.read_json(request)).get("version")
        if not is_integer(version) or version < 0:
            raise ApiError(
                400,
                f"version={describe_value(version)} is invalid: expected a router version number",
                param="version",
                code="invalid_value",
            )
        return version

    async def apply(self, request: Request) -> Response:
        """``mla-watch retune apply N``: gate a proposed version through the engine (a job; 202 with its record)."""
        self.ctx.auth.authorise_admin(request)
        service = self._service()
        version = await self._version(request)
        try:
            spec = service.apply_spec(version)
        except ValueError as error:
            raise ApiError(400, str(error), param="version", code="invalid_value") from None
        record = await asyncio.to_thread(self._submit, service, spec, True)
        return JSONResponse(record, status_code=202)

    async def rollback(self, request: Request) -> Response:
        self.ctx.auth.authorise_admin(request)
        service = self._service()
        self._not_in_a_fleet("rolling one replica's routers back")
        try:
            live = await asyncio.to_thread(service.rollback)
        except ValueError as error:
            raise ApiError(409, str(error), code="nothing_to_roll_back") from None
        except SwapError as error:
            raise ApiError(
                502, f"the engine did not take the rollback: {error}", code="swap_failed", error_type="server_error"
            ) from None
        return JSONResponse({"ok": True, "live": live})

    def _retune_spec(self, body: dict[str, Any]) -> tuple[JobSpec, bool]:
        """A job from an admin request: ``routers`` (default: those out of band), ``business_line``,
        ``strategy`` (a name or a list), ``rule`` (whose band to meet), ``dataset``, ``options``, ``force``."""
        from mla_watch.retune.data import resolve_dataset
        from mla_watch.retune.service import DEFAULT_STRATEGIES
        from mla_watch.retune.strategies import STRATEGIES, get_strategy

        ctx, service = self.ctx, self._service()
        known = {"routers", "business_line", "strategy", "rule", "dataset", "options", "force"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ApiError(
                400,
                f"unknown field(s) [{', '.join(describe_value(name, 40) for name in unknown[:5])}]: "
                f"expected some of {sorted(known)}",
                param=unknown[0][:64],
                code="unknown_field",
            )
        line = body.get("business_line")
        if line is not None and (not isinstance(line, str) or not NAME_RE.fullmatch(line)):
            raise ApiError(
                400,
                f"business_line={describe_value(line)} is invalid: expected a business line name of {NAME_RULE}",
                param="business_line",
                code="invalid_value",
            )
        lines = sorted(ctx.policies.current.lines)
        if line is not None and line not in lines:
            raise ApiError(
                400,
                f"business_line={describe_value(line)} is not a business line of the policies: expected one of {lines}",
                param="business_line",
                code="invalid_value",
            )
        strategies = body.get("strategy", list(DEFAULT_STRATEGIES))
        strategies = [strategies] if isinstance(strategies, str) else strategies
        if (
            not isinstance(strategies, list)
            or not strategies
            or not all(isinstance(name, str) and name in STRATEGIES for name in strategies)
        ):
            raise ApiError(
                400,
                f"strategy={describe_value(body.get('strategy'))} is invalid: expected one of "
                f"{sorted(STRATEGIES)} or a list of them, tried in order",
                param="strategy",
                code="invalid_value",
            )
        rules = ctx.alerts.rules.rules if ctx.alerts is not None else ()
        rule_name = body.get("rule")
        candidates = [r for r in rules if (r.name == rule_name if rule_name else "retune" in r.actions)]
        if rule_name and not candidates:
            raise ApiError(
                400,
                f"rule={describe_value(rule_name)} is not a loaded rule; rules are {[r.name for r in rules]}",
                param="rule",
                code="invalid_value",
            )
        rule = candidates[0] if candidates else None
        band = job_band(rule)
        watched = service.watched_by(rule)
        routers = body.get("routers")
        if routers is None:
            windows = ctx.sources.own_windows()  # the local model's, or the engine's beside one
            records = windows.router_stats(line) if windows is not None else []
            routers = [
                r.router.name
                for r in records
                if r.router.name in watched
                and not r.stats.too_small
                and (value := getattr(r.stats, band.metric)) is not None
                and not band.contains(float(value))
            ]
            if not routers:
                raise ApiError(
                    400,
                    f"no watched router is out of band ({band.describe()}) for business line "
                    f"{line or ALL_LINES} in the current window; name the routers to re-tune",
                    param="routers",
                    code="invalid_value",
                )
        expert_names = service.watched_by(None)
        if (
            not isinstance(routers, list)
            or not routers
            or not all(isinstance(name, str) and name in expert_names for name in routers)
        ):
            raise ApiError(
                400,
                f"routers={describe_value(routers)} is invalid: expected a list of expert routers among {expert_names}",
                param="routers",
                code="invalid_value",
            )
        options = body.get("options", {})
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise ApiError(
                400,
                f"options={describe_value(options)} is invalid: expected {{strategy: {{option: value}}}}",
                param="options",
                code="invalid_value",
            )
        for name, values in options.items():  # checked now, not when the job runs: a typo is a 400, not a failed job
            if name not in STRATEGIES:
                raise ApiError(
                    400,
                    f"options.{name[:40]}: no strategy is named {describe_value(name, 40)}: expected "
                    f"options of the strategies {sorted(STRATEGIES)}",
                    param=f"options.{name[:40]}",
                    code="invalid_value",
                )
            try:
                get_strategy(name).parse_options(
                    {**ctx.config.retune.strategy_options.get(name, {}), **values}, f"options.{name}"
                )
            except ValueError as error:
                raise ApiError(400, str(error), param=f"options.{name}", code="invalid_value") from None
        dataset = body.get("dataset")
        if dataset is not None:
            if not hasattr(service.retuner, "dataset_dir"):  # an engine's routers: fitted and gated on captured traffic
                raise ApiError(
                    400,
                    "dataset: re-tuning an engine's routers reads captured traffic, not a dataset: "
                    "expected no 'dataset'",
                    param="dataset",
                    code="invalid_value",
                )
            try:  # a bare name of a file in the dataset directory; any other value gets the same answer
                dataset_dir: Path | None = getattr(service.retuner, "dataset_dir", None)  # a local Retuner's
                resolve_dataset(dataset, dataset_dir or ctx.config.state_dir / DATASETS_DIR_NAME)
            except ValueError as error:
                raise ApiError(400, str(error), param="dataset", code="invalid_value") from None
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise ApiError(
                400,
                f"force={describe_value(force)} is invalid: expected true or false",
                param="force",
                code="invalid_value",
            )
        spec = request_job_spec(
            rule=rule,
            routers=routers,
            watched=watched,
            strategies=strategies,
            business_line=line,
            dataset=dataset,
            options=options,
            max_perplexity_increase=ctx.config.retune.max_perplexity_increase,
            at=time.time(),
        )
        return spec, force
