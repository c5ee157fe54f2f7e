"""The fleet's endpoints (``serve --fleet``): ``GET /v1/fleet`` and the operator's two moves on a rollout.

* ``GET /v1/fleet``: the members (name, the fleet version and digest each serves, last seen, what its reference
  prompts read), the current or last rollout with its steps, who holds the re-tuning lease, the versions and jobs.
  404 naming ``--fleet`` on a sidecar that is in no fleet; 503 while the store cannot be reached.
* ``POST /admin/fleet/rollout {"version": N}``: roll fleet version N out from this replica (it takes and checks it
  first): a halted rollout resumed, or an earlier version put back.
* ``POST /admin/fleet/abort``: the rollout under way or halted ends; its version is marked bad and every replica
  that took it goes back to the fleet's current version.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mla_watch.common.describe import describe_value
from mla_watch.common.values import is_integer
from mla_watch.server.requests import ApiError

if TYPE_CHECKING:
    from mla_watch.fleet.member import FleetMember
    from mla_watch.server.handler_context import HandlerContext

__all__ = ["FleetApi", "not_in_fleet"]


def not_in_fleet() -> ApiError:
    return ApiError(
        404,
        "this sidecar is in no fleet: start it with --fleet postgresql://... to join one",
        param="--fleet",
        code="not_in_fleet",
    )


class FleetApi:
    def __init__(self, ctx: HandlerContext) -> None:
        self.ctx = ctx

    def _member(self) -> FleetMember:
        member = self.ctx.serving.fleet
        if member is None:
            if self.ctx.config.fleet is not None:
                raise ApiError(
                    503,
                    "this sidecar joins its fleet once its routers are loaded (the model is loading, "
                    "or re-tuning is off here)",
                    code="fleet_unavailable",
                    error_type="server_error",
                )
            raise not_in_fleet()
        return member

    async def get_fleet(self, request: Request) -> Response:
        from mla_watch.fleet.fleet_store import FleetStoreError

        member = self._member()
        try:
            body = await asyncio.to_thread(member.describe)
        except FleetStoreError as error:
            raise ApiError(503, str(error), code="fleet_store_unavailable", error_type="server_error") from None
        return JSONResponse(body)

    async def rollout(self, request: Request) -> Response:
        from mla_watch.fleet.fleet_store import FleetStoreError
        from mla_watch.fleet.member import FleetRefusal

        self.ctx.auth.authorise_admin(request)
        member = self._member()
        body = await self.ctx.read_json(request)
        unknown = sorted(set(body) - {"version"})
        version = body.get("version")
        if unknown or not is_integer(version) or not 0 <= version < 1 << 31:
            raise ApiError(
                400,
                f'version={describe_value(version)} is invalid: expected {{"version": N}}, a fleet '
                "version number (GET /v1/fleet lists them)",
                param="version",
                code="invalid_value",
            )
        try:
            rollout = await asyncio.to_thread(member.start_rollout, version)
        except (FleetRefusal, ValueError) as error:
            raise ApiError(409, str(error), param="version", code="rollout_refused") from None
        except FleetStoreError as error:
            raise ApiError(503, str(error), code="fleet_store_unavailable", error_type="server_error") from None
        return JSONResponse({"ok": True, "rollout": rollout}, status_code=202)

    async def abort(self, request: Request) -> Response:
        from mla_watch.fleet.fleet_store import FleetStoreError

        self.ctx.auth.authorise_admin(request)
        member = self._member()
        try:
            rollout = await asyncio.to_thread(member.abort, f"aborted by an operator through {member.name}")
        except FleetStoreError as error:
            raise ApiError(503, str(error), code="fleet_store_unavailable", error_type="server_error") from None
        if rollout is None:
            raise ApiError(409, "no rollout is under way or halted: nothing to abort", code="nothing_to_abort")
        return JSONResponse({"ok": True, "rollout": rollout})
