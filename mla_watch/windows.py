"""The Python API's ``mla_watch.windows``: the names of :mod:`mla_watch.routing.windows` (and of the router records
they are keyed by, :mod:`mla_watch.routing.routers`), importable here too."""

from mla_watch.routing.routers import CountDelta, RouterInfo, parse_zero_slots
from mla_watch.routing.windows import *  # noqa: F403
from mla_watch.routing.windows import __all__ as _windows

__all__ = [*_windows, "CountDelta", "RouterInfo", "parse_zero_slots"]
