"""Router discovery and on-device selection counting."""

from mla_watch.probe.discovery import (
    DEFAULT_REGISTRY,
    NoRoutersFoundError,
    RouterRegistry,
    RouterSpec,
    UnknownRouterError,
    discover_routers,
    register_router,
)
from mla_watch.probe.probe import DEFAULT_LINE, OVERFLOW_LINE, Probe, attach
from mla_watch.routing.routers import RouterInfo

__all__ = [
    "DEFAULT_LINE",
    "DEFAULT_REGISTRY",
    "OVERFLOW_LINE",
    "NoRoutersFoundError",
    "Probe",
    "RouterInfo",
    "RouterRegistry",
    "RouterSpec",
    "UnknownRouterError",
    "attach",
    "discover_routers",
    "register_router",
]
