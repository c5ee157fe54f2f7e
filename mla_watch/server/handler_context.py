"""What the request handlers are handed: the parts they use, never the composition root itself.

:class:`Serving` is what start-up fills in as the sidecar comes up (the model and its worker, or the
upstream client; the re-tune service); the composition root (the Sidecar) writes it, the handlers
and the read views read it. :class:`HandlerContext` holds exactly what the generation and admin handlers need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from mla_watch.server.http import read_json

if TYPE_CHECKING:
    from mla_watch.alerting.alert_service import AlertService
    from mla_watch.engines.routing_fields import RoutingLayout
    from mla_watch.fleet.member import FleetMember
    from mla_watch.policy.files import PolicyStore
    from mla_watch.references.client_load import ClientLatency
    from mla_watch.retune.service import RetuneService
    from mla_watch.routing.clients import ClientShares
    from mla_watch.server.auth import Auth
    from mla_watch.server.config import ServerConfig
    from mla_watch.server.metrics import ServerMetrics
    from mla_watch.server.model_worker import ModelWorker
    from mla_watch.server.proxy import Upstream
    from mla_watch.server.selftest import SelfTestResult
    from mla_watch.server.sources import RoutingSources
    from mla_watch.server.upstream_health import UpstreamHealth

__all__ = ["ENGINE_RETUNE_NOTE", "HandlerContext", "Serving"]

ENGINE_RETUNE_NOTE = "re-tuning the engine's routers starts with the sidecar (serve --engine-retune propose|apply)"


@dataclass
class Serving:
    """What this sidecar serves, filled in as it starts: the local model's worker or the upstream client."""

    model_name: str
    ready: threading.Event = field(default_factory=threading.Event)  # the model loaded (or the upstream client made)
    load_error: str | None = None
    model_worker: ModelWorker | None = None
    upstream: Upstream | None = None
    upstream_health: UpstreamHealth | None = None  # whether the upstream answers (readiness), beside one
    retune: RetuneService | None = None  # once a local model is loaded (or beside an engine, --engine-retune)
    routing_layout: RoutingLayout | None = None  # with --return-routed-experts, once the model is in
    self_test: SelfTestResult | None = None
    engine_retune_note: str = ENGINE_RETUNE_NOTE  # what re-tuning the engine's routers can do, once started
    fleet: FleetMember | None = None  # serve --fleet: this replica's part in the fleet, once re-tuning started


@dataclass(frozen=True)
class HandlerContext:
    """The parts the generation and admin endpoints use."""

    config: ServerConfig
    clock: Callable[[], float]
    auth: Auth  # bearer tokens, and the answer to a refused request
    policies: PolicyStore
    metrics: ServerMetrics
    sources: RoutingSources
    alerts: AlertService | None
    serving: Serving
    reload_rules: Callable[[], list[str]]  # the errors of reloading the rules (none kept in force otherwise)
    clients: ClientShares  # who sends each line's tokens
    client_latency: ClientLatency | None = None  # beside an engine: what reference readings yield to

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The request's JSON object: at most ``max_body_bytes``, arrived within ``body_timeout_seconds``."""
        return await read_json(request, self.config.max_body_bytes, self.config.body_timeout_seconds)
