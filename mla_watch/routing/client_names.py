"""The names a client is given where no one name fits (no torch): what :mod:`mla_watch.routing.clients` keeps past
its bound, and what a request that names no client counts as. Routing by position (:mod:`.positions`) reads them
too: neither is one client, so neither's routing is judged as one."""

from __future__ import annotations

__all__ = ["OTHER", "UNKNOWN"]

OTHER = "(other)"  # clients past a bound, together
UNKNOWN = "(unknown)"  # a request none of the sources names
