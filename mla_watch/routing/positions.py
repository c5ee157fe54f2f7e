"""Routing by context position: where in its sequence a token sat when a router chose for it (no torch).

A checkpoint's context length is not the length its routers were trained on: past the trained length routing
departs from the routing it learned, while every aggregate looks healthy because long requests are a minority of
tokens. Each expert router's selections are therefore also counted per *position bucket*: power-of-two ranges of
the token's index in its sequence (``0-63``, ``64-127``, ``128-255``, ... up to the model's context length, and one
bucket past it).

Memory is bounded and fixed by the geometry: one ``int64`` vector of ``num_slots`` per (router, business line,
bucket), at most ``routers x lines x buckets x num_slots x 8`` bytes (the bundled model, 3 routers x 17 lines x 5
buckets x 64 experts: 130 KiB). A bucket forgets by halving: once it holds more than ``max_bucket_tokens``
tokens every count is halved, so old traffic weighs less and nothing grows without end.

A line's *in-range routing* is the pooled routing of its buckets that stay within ``drift_bits`` of the buckets
before them, scanned from the second bucket: the first bucket (a sequence's first 64 positions) routes the opening
of every prompt - system prompts, headers - and differs from the rest by content, not by position, so it is shown
but neither judged nor pooled. The first bucket that leaves in-range routing is the line's *edge*.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mla_watch.routing.stats import entropy_rows, js_divergence_rows

__all__ = [
    "DEFAULT_DRIFT_BITS",
    "DEFAULT_HALF_LIFE_SECONDS",
    "DEFAULT_MAX_BUCKET_TOKENS",
    "DEFAULT_MIN_BUCKET_TOKENS",
    "FIRST_EDGE",
    "BucketStats",
    "PositionBuckets",
    "PositionCounts",
    "PositionProfile",
    "Recommendation",
    "bucket_start",
    "profile",
    "profiles",
    "recommend",
]

FIRST_EDGE = 64  # the first bucket's end: positions 0-63
# Jensen-Shannon divergence, in bits, past which a bucket has left in-range routing. On the bundled model (64
# experts, top-6) in-range buckets of a line differ from each other by 0.003-0.02 bits over a few thousand tokens
# (prompts differ by position too: openings, bodies, closings), and the positions past its trained 256 by 0.03-0.09.
DEFAULT_DRIFT_BITS = 0.025
# Tokens a bucket needs before it is judged: fewer read a divergence of sampling noise (about 0.005 bits for 64
# experts top-6 at 768 tokens against a large reference, several times that when the tokens come from few prompts).
DEFAULT_MIN_BUCKET_TOKENS = 512
DEFAULT_MAX_BUCKET_TOKENS = 1 << 20  # a bucket halves its counts past this many tokens
DEFAULT_HALF_LIFE_SECONDS = 3600.0  # every count halves each hour: a line that stops sending long prompts recovers


class PositionBuckets:
    """Power-of-two position buckets up to ``context_length``, and one bucket past it."""

    def __init__(self, context_length: int) -> None:
        if not isinstance(context_length, int) or isinstance(context_length, bool) or context_length < 1:
            raise ValueError(f"context_length = {context_length!r}: expected an integer >= 1")
        self.context_length = context_length
        # bucket i covers [starts[i], edges[i]); the last edge is the context length
        self.edges: tuple[int, ...] = (*_doubling(FIRST_EDGE, context_length), context_length)
        self.starts: tuple[int, ...] = (0, *self.edges)

    def __len__(self) -> int:
        return len(self.edges) + 1

    def label(self, bucket: int) -> str:
        start = self.starts[bucket]
        return f"{start}+" if bucket == len(self.edges) else f"{start}-{self.edges[bucket] - 1}"

    @property
    def labels(self) -> list[str]:
        return [self.label(bucket) for bucket in range(len(self))]

    def bucket_of(self, positions: np.ndarray) -> np.ndarray:
        """The bucket of each position (non-negative integers)."""
        return np.searchsorted(np.asarray(self.edges), np.asarray(positions), side="right")


def bucket_start(label: str) -> int | None:
    """The first position of the bucket :meth:`PositionBuckets.label` named ``label`` (``None``: not such a label)."""
    first, _, _ = label.rstrip("+").partition("-")
    return int(first) if first.isdigit() else None


def _doubling(first: int, limit: int) -> Iterable[int]:
    edge = first
    while edge < limit:
        yield edge
        edge *= 2


@dataclass(frozen=True)
class BucketStats:
    """One position bucket of one router and line."""

    bucket: str
    start: int
    end: int | None  # exclusive; None past the context length
    tokens: int
    entropy_bits: float
    js_divergence: float | None  # from the line's in-range routing; None for the first bucket or without one
    judged: bool  # enough tokens, and not the first bucket
    in_range: bool  # judged and within drift_bits of in-range routing (pooled into it)

    def as_dict(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "start": self.start, "end": self.end, "tokens": self.tokens,
                "entropy_bits": self.entropy_bits, "js_divergence": self.js_divergence, "judged": self.judged,
                "in_range": self.in_range}


@dataclass(frozen=True)
class PositionProfile:
    """A router's routing by position for one line: each bucket, the edge, and the drift past it."""

    buckets: tuple[BucketStats, ...]
    edge: str | None  # the first bucket that leaves in-range routing
    edge_start: int | None  # its first position: the longest prompt routing stayed in range for
    drift: float | None  # JS of the edge bucket (or, where none left, the largest of the judged buckets before it)
    drift_bits: float

    def as_dict(self) -> dict[str, Any]:
        return {"edge": self.edge, "edge_start": self.edge_start, "long_context_drift": self.drift,
                "drift_bits": self.drift_bits, "buckets": [bucket.as_dict() for bucket in self.buckets]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionProfile:
        """Read back :meth:`as_dict` (a sidecar's ``/v1/routing`` answer); ``KeyError``/``TypeError`` if not one."""
        buckets = tuple(BucketStats(**{key: bucket[key] for key in BucketStats.__dataclass_fields__})
                        for bucket in data["buckets"])
        return cls(buckets, data["edge"], data["edge_start"], data["long_context_drift"], float(data["drift_bits"]))


def profile(counts: np.ndarray, buckets: PositionBuckets, top_k: int, *, drift_bits: float = DEFAULT_DRIFT_BITS,
            min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS) -> PositionProfile:
    """The position profile of ``counts`` ``[buckets, slots]`` (one router, one line)."""
    return profiles(counts[None], buckets, [top_k], drift_bits=drift_bits, min_tokens=min_tokens)[0]


def profiles(counts: np.ndarray, buckets: PositionBuckets, top_k: Sequence[int], *,
             drift_bits: float = DEFAULT_DRIFT_BITS, min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS
             ) -> list[PositionProfile]:
    """The position profiles of routers of one size, ``counts`` ``[routers, buckets, slots]``, computed together.

    Before the edge every judged bucket is in range, so the in-range routing a bucket is compared with is the sum
    of the judged buckets before it; past the edge it stays what it was at the edge. So the divergences are two
    vectorised computations, not a scan: a sidecar takes every router and line's profile at each read.
    """
    routers, count, slots = counts.shape
    tokens = counts.sum(axis=2) // np.asarray(top_k, dtype=np.int64)[:, None]
    judged = tokens >= min_tokens
    judged[:, 0] = False  # the prompts' openings
    pooled = np.cumsum(np.where(judged[:, :, None], counts, 0), axis=1)
    before = np.concatenate([np.zeros_like(pooled[:, :1]), pooled[:, :-1]], axis=1)  # judged buckets before each
    js = js_divergence_rows(counts.reshape(-1, slots), before.reshape(-1, slots)).reshape(routers, count)
    # The first judged bucket seeds in-range routing; a later judged one past drift_bits is the edge.
    seeded = np.cumsum(judged, axis=1) >= 2
    leaving = judged & seeded & (js > drift_bits)
    edges = np.where(leaving.any(axis=1), leaving.argmax(axis=1), -1)
    positions = np.arange(count)
    past = (edges[:, None] >= 0) & (positions[None, :] > edges[:, None])
    if past.any():
        frozen = before[np.arange(routers), np.maximum(edges, 0)]  # [routers, slots]
        js[past] = js_divergence_rows(counts[past], np.broadcast_to(frozen[:, None], counts.shape)[past])
    in_range = judged & ((edges[:, None] < 0) | (positions[None, :] < edges[:, None]))
    entropy = entropy_rows(counts.reshape(-1, slots)).reshape(routers, count)
    labels = buckets.labels
    ends = [*buckets.edges, None]
    found = []
    for router in range(routers):
        edge = int(edges[router])
        compared = js[router][judged[router] & seeded[router] & in_range[router]]
        drift = float(js[router, edge]) if edge >= 0 else (float(compared.max()) if compared.size else None)
        records = tuple(
            BucketStats(labels[index], buckets.starts[index], ends[index], int(tokens[router, index]),
                        float(entropy[router, index]),
                        None if index == 0 or np.isnan(js[router, index]) else float(js[router, index]),
                        bool(judged[router, index]), bool(in_range[router, index]))
            for index in range(count))
        found.append(PositionProfile(records, None if edge < 0 else labels[edge],
                                     None if edge < 0 else buckets.starts[edge], drift, drift_bits))
    return found


class PositionCounts:
    """Selections per (router, business line, position bucket) of expert routers; thread-safe."""

    def __init__(self, routers: Sequence[Any], context_length: int, *, drift_bits: float = DEFAULT_DRIFT_BITS,
                 min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
                 max_bucket_tokens: int = DEFAULT_MAX_BUCKET_TOKENS,
                 half_life_seconds: float | None = DEFAULT_HALF_LIFE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buckets = PositionBuckets(context_length)
        self._routers = {info.name: info for info in routers if info.kind == "expert"}
        self.drift_bits = drift_bits
        self.min_tokens = min_tokens
        self._max_bucket_tokens = max_bucket_tokens
        self._counts: dict[str, dict[str, np.ndarray]] = {}  # router -> business line -> [buckets, slots]
        self._lock = threading.Lock()
        self._half_life = half_life_seconds
        self._clock = clock
        self._halved_at = clock()

    def _age(self) -> None:
        """Halve every count once per elapsed half-life (the lock held)."""
        if self._half_life is None:
            return
        now = self._clock()
        halvings = int((now - self._halved_at) // self._half_life)
        if halvings <= 0:
            return
        self._halved_at += halvings * self._half_life
        for lines in self._counts.values():
            for array in lines.values():
                array >>= min(halvings, 63)

    @property
    def routers(self) -> list[str]:
        return list(self._routers)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(array.nbytes for lines in self._counts.values() for array in lines.values())

    def add(self, router: str, business_line: str, counts: np.ndarray) -> None:
        """Add ``counts`` ``[buckets, num_slots]`` of one router for one line."""
        info = self._routers.get(router)
        if info is None:
            raise KeyError(f"router {router!r} is not one of the {len(self._routers)} expert routers counted "
                           "by position")
        shape = (len(self.buckets), info.num_slots)
        if counts.shape != shape:
            raise ValueError(f"position counts of {router!r}: shape {list(counts.shape)}, expected {list(shape)}")
        with self._lock:
            self._age()
            lines = self._counts.setdefault(router, {})
            total = lines.get(business_line)
            if total is None:
                total = lines[business_line] = np.zeros(shape, dtype=np.int64)
            total += counts.astype(np.int64, copy=False)
            full = total.sum(axis=1) > self._max_bucket_tokens * info.top_k
            if full.any():
                total[full] //= 2

    def counts(self, router: str, business_line: str | None = None) -> np.ndarray:
        """``[buckets, num_slots]`` of one router for one line (every line summed for ``None``)."""
        info = self._routers[router]
        total = np.zeros((len(self.buckets), info.num_slots), dtype=np.int64)
        with self._lock:
            self._age()
            lines = self._counts.get(router, {})
            for line, array in lines.items():
                if business_line is None or line == business_line:
                    total += array
        return total

    @property
    def business_lines(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(line for lines in self._counts.values() for line in lines))

    def profile(self, router: str, business_line: str | None = None) -> PositionProfile:
        return profile(self.counts(router, business_line), self.buckets, self._routers[router].top_k,
                       drift_bits=self.drift_bits, min_tokens=self.min_tokens)

    def profiles(self, business_line: str | None = None) -> dict[str, PositionProfile]:
        """Every expert router's profile for one line (all summed for ``None``), routers of one size together."""
        by_size: dict[int, list[str]] = {}
        for name, info in self._routers.items():
            by_size.setdefault(info.num_slots, []).append(name)
        found: dict[str, PositionProfile] = {}
        for names in by_size.values():
            stacked = np.stack([self.counts(name, business_line) for name in names])
            top_k = [self._routers[name].top_k for name in names]
            found.update(zip(names, profiles(stacked, self.buckets, top_k, drift_bits=self.drift_bits,
                                             min_tokens=self.min_tokens), strict=True))
        return {name: found[name] for name in self._routers}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def as_dict(self, business_line: str | None = None) -> dict[str, Any]:
        """What ``GET /v1/routing/positions`` answers: every expert router's profile for one line (all summed)."""
        return {"business_line": business_line, "context_length": self.buckets.context_length,
                "buckets": self.buckets.labels, "drift_bits": self.drift_bits, "min_tokens": self.min_tokens,
                "routers": [{"name": name, "layer": self._routers[name].layer, **found.as_dict()}
                            for name, found in self.profiles(business_line).items()]}


@dataclass(frozen=True)
class Recommendation:
    """A line's ``max_prompt_tokens`` from its routing by position."""

    max_prompt_tokens: int | None  # None: no router left in-range routing where there was traffic to judge
    edge: str | None  # the earliest edge among the routers
    routers: tuple[str, ...]  # the routers whose edge it is
    judged_up_to: int  # the end of the last judged bucket: how far the traffic showed routing in range

    def as_dict(self) -> dict[str, Any]:
        return {"max_prompt_tokens": self.max_prompt_tokens, "edge": self.edge, "routers": list(self.routers),
                "judged_up_to": self.judged_up_to}


def recommend(profiles: dict[str, PositionProfile]) -> Recommendation:
    """The last healthy position before the earliest edge of any router: prompts up to it route as in range."""
    edges = [(found.edge_start, name, found.edge) for name, found in profiles.items() if found.edge_start is not None]
    judged = [bucket.end or bucket.start for found in profiles.values() for bucket in found.buckets if bucket.judged]
    reach = max(judged, default=0)
    if not edges:
        return Recommendation(None, None, (), reach)
    start = min(edge for edge, _, _ in edges)
    names = tuple(name for edge, name, _ in edges if edge == start)
    label = next(label for edge, _, label in edges if edge == start)
    return Recommendation(start, label, names, reach)
