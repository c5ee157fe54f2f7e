"""Who may call the endpoints that change the sidecar, and how a refused request is answered."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from mla_watch.server.config import ADMIN_TOKEN_ENV, INGEST_TOKEN_ENV, ServerConfig
from mla_watch.server.http import authorise, error_response
from mla_watch.server.metrics import ServerMetrics
from mla_watch.server.requests import ApiError

__all__ = ["Auth"]


class Auth:
    """The bearer-token checks (admin, ingestion) and the one answer to an :class:`ApiError`."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.config = config
        self.metrics = metrics

    def authorise_admin(self, request: Request) -> None:
        authorise(request, self.config.admin_token, what="admin", variables=ADMIN_TOKEN_ENV)

    def authorise_ingest(self, request: Request) -> None:
        """Workers hold the ingestion token, not the admin key (the admin token when none is set)."""
        authorise(
            request,
            self.config.ingest_token or self.config.admin_token,
            what="ingestion",
            variables=f"{INGEST_TOKEN_ENV} or {ADMIN_TOKEN_ENV}",
        )

    def refused(self, request: Request, error: ApiError) -> Response:
        """The answer to a refused request, counted by reason when the client was at fault."""
        if error.status < 500:  # labelled by the route's template: /v1/retune/jobs/{job_id}, not each id asked for
            route = getattr(request.scope.get("route"), "path", "other")
            self.metrics.bad_requests.labels(route, error.code or str(error.status)).inc()
        return error_response(error)

    async def api_error(self, request: Request, error: Exception) -> Response:
        """The app's exception handler of :class:`ApiError`."""
        assert isinstance(error, ApiError)
        return self.refused(request, error)
