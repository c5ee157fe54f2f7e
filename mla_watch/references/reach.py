"""Which positions an alert concerns, and whether a reading of reference prompts reached them (no torch).

A reading judges what its prompts routed: a statistic of positions they never reached says nothing of them.
Two kinds of alert concern positions a short prompt does not reach:

* a rule on ``long_context_drift`` (the shipped ``LongContextDrift``): the positions from the bucket where the
  line's routing leaves its in-range routing (``long_context_edge``) on; the reading is compared with its
  healthy baseline at those positions only, the routing of expert routers being counted by position;
* any alert on a DSA indexer: an indexer picks ``index_topk`` of the keys a query sees, so it chooses only past
  ``index_topk`` positions, and its choices carry a signal (``locality``) only for queries that saw
  ``2 x index_topk`` keys or more (:attr:`mla_watch.routing.stats.RoutingStats.no_signal`): the readings that
  reached that far are judged whole.

A reading *reached* position ``p`` when one of its prompts was read past it (its longest prompt's tokens,
``ReferenceReading.reach``, exceed ``p``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mla_watch.references.readings import ReferenceReading
from mla_watch.routing.positions import FIRST_EDGE, bucket_start
from mla_watch.routing.windows import RouterStats

__all__ = ["LONG_CONTEXT_METRIC", "Need", "needed", "reaches"]

LONG_CONTEXT_METRIC = "long_context_drift"  # the statistic of routing by position (routing/stats.py STATISTICS)


@dataclass(frozen=True)
class Need:
    """The positions an alert concerns: from ``start`` on."""

    start: int
    what: str  # those positions, said for on-call ("positions 256 on (bucket 256-511, ...)")
    by_position: bool  # compared at those positions only (expert routers), else over the whole readings that reached

    def as_dict(self) -> dict[str, Any]:
        return {"from_position": self.start, "what": self.what, "by_position": self.by_position}


def needed(rule: Any, record: RouterStats) -> Need | None:
    """The positions ``rule``'s alert on ``record`` concerns (``None``: any reading of the line speaks for it)."""
    router = record.router
    if router.kind == "indexer":
        keys = 2 * router.top_k
        return Need(
            keys - 1,
            f"positions {keys - 1} on, where a query sees 2 x index_topk = {keys} keys or more "
            f"and {router.name} chooses among them",
            False,
        )
    if getattr(rule, "metric", None) == LONG_CONTEXT_METRIC:
        edge = record.stats.long_context_edge
        start = bucket_start(edge) if edge else None
        if start is None:  # no bucket left in-range routing: the drift is of the judged buckets, from the second on
            return Need(FIRST_EDGE, f"positions {FIRST_EDGE} on (the position buckets judged)", True)
        return Need(start, f"positions {start} on (bucket {edge}, where {router.name} leaves in-range routing)", True)
    return None


def reaches(reading: ReferenceReading, need: Need) -> bool:
    """Whether ``reading`` read a token at the positions ``need`` names (and, where they are compared by position,
    counted its routing by position)."""
    if reading.reach <= need.start:
        return False
    return not need.by_position or bool(reading.score.positions)
