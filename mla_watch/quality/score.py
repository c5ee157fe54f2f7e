"""One model state measured on a set of texts: perplexity, per-text losses, and every router's statistics (no torch).

What the re-tune gates compare (the live routers against a candidate, on held-out samples) and what a reading
of the reference prompts holds (:mod:`mla_watch.references`), whether the model ran here or in an engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from mla_watch.engines.formats import routing_counts
from mla_watch.engines.geometry import EngineGeometry
from mla_watch.engines.routing_ids import routing_position_counts
from mla_watch.engines.swap import SampleScore
from mla_watch.quality.band import Band
from mla_watch.routing.stats import compute_stats
from mla_watch.routing.windows import RouterStats

__all__ = ["ModelScore", "engine_score"]


@dataclass
class ModelScore:
    """One model state measured on the held-out samples."""

    perplexity: float
    tokens: int
    routers: dict[str, RouterStats]  # router name -> its statistics over the held-out pass
    losses: list[float]  # per held-out sample, in order: summed next-token loss (nats) ...
    counts: list[int]  # ... over this many scored tokens
    # Expert routers' selections per position bucket (router name -> [buckets, slots]), where they were counted by
    # position: buckets end at ``position_edges`` (routing/positions.py), the last holding every position past them.
    positions: dict[str, np.ndarray] = field(default_factory=dict)
    position_edges: tuple[int, ...] = ()

    def metric(self, router: str, name: str) -> float | None:
        """``router``'s statistic ``name`` over the pass; ``None`` when not measured (not routed, or undefined)."""
        record = self.routers.get(router)
        value = None if record is None else getattr(record.stats, name)
        return None if value is None else float(value)

    def too_small(self, router: str) -> bool:
        """Whether ``router``'s pass held fewer tokens than its trusted minimum (``False`` when not routed)."""
        record = self.routers.get(router)
        return record is not None and record.stats.too_small

    def outside(self, routers: Sequence[str], band: Band) -> list[str]:
        """The ``routers`` measured, on a trusted window, outside ``band``."""
        outside = []
        for router in routers:
            value = self.metric(router, band.metric)
            if value is not None and value == value and not self.too_small(router) and not band.contains(value):
                outside.append(router)
        return outside

    def as_dict(self, routers: Sequence[str], metric: str) -> dict[str, Any]:
        return {
            "perplexity": round(self.perplexity, 4),
            "tokens": self.tokens,
            metric: {name: _round(self.metric(name, metric)) for name in routers},
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def engine_score(scores: Sequence[SampleScore], geometry: EngineGeometry, *, positions: bool = False) -> ModelScore:
    """The engine's scores of the held-out samples as a :class:`ModelScore`: perplexity, per-sample losses and,
    where the engine routed them, every router's statistics over their tokens (and, with ``positions`` where the
    geometry knows its context length, their selections per position bucket)."""
    losses = [float(score.loss) for score in scores]
    counts = [int(score.tokens) for score in scores]
    tokens = sum(counts)
    perplexity = math.exp(sum(losses) / tokens) if tokens else math.nan
    routed = [score.routing for score in scores if score.routing is not None]
    records: dict[str, RouterStats] = {}
    if routed:
        totals = [routing_counts(np.asarray(ids), geometry) for ids in routed]
        layer_counts = cast(np.ndarray, sum(total for total, _ in totals))  # routed: never the empty 0
        routed_tokens = sum(rows for _, rows in totals)
        for index, info in enumerate(geometry.routers()):
            stats = compute_stats(layer_counts[index], kind="expert", top_k=info.top_k, tokens=routed_tokens)
            # the counts: what the bias rule steps from
            records[info.name] = RouterStats(router=info, business_line=None, stats=stats, counts=layer_counts[index])
    by_position: dict[str, np.ndarray] = {}
    edges: tuple[int, ...] = ()
    if routed and positions and geometry.context_length is not None:
        from mla_watch.routing.positions import PositionBuckets

        edges = PositionBuckets(geometry.context_length).edges
        stacked = cast(np.ndarray, sum(routing_position_counts(np.asarray(ids), geometry, edges) for ids in routed))
        by_position = {info.name: stacked[index] for index, info in enumerate(geometry.routers())}
    return ModelScore(
        perplexity=perplexity,
        tokens=tokens,
        routers=records,
        losses=losses,
        counts=counts,
        positions=by_position,
        position_edges=edges,
    )
