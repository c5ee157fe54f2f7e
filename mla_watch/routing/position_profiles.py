"""Position buckets and the records of routing by position: what a judgement reads and answers (no torch).

:class:`PositionBuckets` cuts a sequence's positions into power-of-two ranges (``0-63``, ``64-127``, ... up to the
context length, and one past it); :class:`BucketStats`, :class:`ClientDeparture` and :class:`PositionProfile` are a
router's routing by position for one line, and :class:`Recommendation` a line's ``max_prompt_tokens``, each with its
dictionary form (``GET /v1/routing``; :meth:`PositionProfile.from_dict` reads it back). How they are judged, and the
counts they are judged on: :mod:`mla_watch.routing.positions`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "FIRST_EDGE",
    "BucketStats",
    "ClientDeparture",
    "PositionBuckets",
    "PositionProfile",
    "Recommendation",
    "bucket_start",
]

FIRST_EDGE = 64  # the first bucket's end: positions 0-63


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
    # From in-range routing (for a line: the min_clients-th largest of its clients' own); None for the first bucket,
    # or where too few clients had enough tokens here
    js_divergence: float | None
    judged: bool  # enough tokens (for a line: from enough clients), and not the first bucket
    in_range: bool  # judged and within drift_bits of in-range routing (pooled into it)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "start": self.start,
            "end": self.end,
            "tokens": self.tokens,
            "entropy_bits": self.entropy_bits,
            "js_divergence": self.js_divergence,
            "judged": self.judged,
            "in_range": self.in_range,
        }


@dataclass(frozen=True)
class ClientDeparture:
    """One client's routing by position on one router: where it left its own in-range routing."""

    client: str
    tokens: int  # its prompt tokens past the first bucket
    edge: str | None  # the first of its judged buckets that left its own in-range routing
    drift: float | None  # the divergence there (or the largest of its judged buckets)

    def as_dict(self) -> dict[str, Any]:
        return {"client": self.client, "tokens": self.tokens, "edge": self.edge, "drift": self.drift}


@dataclass(frozen=True)
class PositionProfile:
    """A router's routing by position for one line: each bucket, the edge, and the drift past it."""

    buckets: tuple[BucketStats, ...]
    edge: str | None  # the first bucket that leaves in-range routing (across min_clients clients)
    edge_start: int | None  # its first position: the longest prompt routing stayed in range for
    drift: float | None  # the divergence at the edge (or, where none left, the largest of the judged buckets)
    drift_bits: float
    clients: tuple[ClientDeparture, ...] = ()  # each client judged on its own
    held_by: tuple[str, ...] = ()  # the clients whose own routing leaves at the edge
    # who sent the tokens of the bucket the drift was read at (the edge, else the farthest judged): client, share
    shares: tuple[tuple[str, float], ...] = ()
    min_clients: int = 1

    def compared(self) -> str:
        """What the drift compares, in words (the alert's description says it)."""
        if self.drift is None:
            return "no bucket past the first had enough tokens from enough clients to judge"
        index = next((i for i, bucket in enumerate(self.buckets) if bucket.bucket == self.edge), None)
        if index is None:  # no edge: the largest divergence among the judged buckets
            judged = [i for i, bucket in enumerate(self.buckets) if bucket.judged]
            index = max(judged, key=lambda i: self.buckets[i].js_divergence or 0.0) if judged else 1
        before = self.buckets[1:index]
        last = before[-1].end if before else None
        earlier = f"{before[0].start}-{last - 1}" if before and last is not None else "its earlier positions"
        if self.min_clients > 1:
            return f"each client's prompt tokens at {self.buckets[index].bucket} against its own at {earlier}"
        return f"prompt tokens at {self.buckets[index].bucket} against those at {earlier}"

    def senders(self) -> str:
        """Who sent the tokens the drift was read on: ``client-a 61%, client-b 39%``."""
        return ", ".join(f"{client} {share:.0%}" for client, share in self.shares) or "no client"

    def as_dict(self) -> dict[str, Any]:
        return {
            "edge": self.edge,
            "edge_start": self.edge_start,
            "long_context_drift": self.drift,
            "drift_bits": self.drift_bits,
            "buckets": [bucket.as_dict() for bucket in self.buckets],
            "clients": [client.as_dict() for client in self.clients],
            "held_by": list(self.held_by),
            "shares": [{"client": client, "share": share} for client, share in self.shares],
            "min_clients": self.min_clients,
            "compared": self.compared(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionProfile:
        """Read back :meth:`as_dict` (a sidecar's ``/v1/routing`` answer); ``KeyError``/``TypeError`` if not one."""
        buckets = tuple(
            BucketStats(**{key: bucket[key] for key in BucketStats.__dataclass_fields__}) for bucket in data["buckets"]
        )
        clients = tuple(
            ClientDeparture(str(c["client"]), int(c["tokens"]), c["edge"], c["drift"]) for c in data.get("clients", [])
        )
        shares = tuple((str(s["client"]), float(s["share"])) for s in data.get("shares", []))
        return cls(
            buckets,
            data["edge"],
            data["edge_start"],
            data["long_context_drift"],
            float(data["drift_bits"]),
            clients,
            tuple(str(c) for c in data.get("held_by", [])),
            shares,
            int(data.get("min_clients", 1)),
        )


@dataclass(frozen=True)
class Recommendation:
    """A line's ``max_prompt_tokens`` from its routing by position."""

    max_prompt_tokens: int | None  # None: no router left in-range routing where there was traffic to judge
    edge: str | None  # the earliest edge among the routers
    routers: tuple[str, ...]  # the routers whose edge it is
    judged_up_to: int  # the end of the last judged bucket: how far the traffic showed routing in range
    clients: tuple[str, ...] = ()  # the clients whose routing leaves there (the departure holds across them)
    refused_share: float | None = None  # of the line's prompts, the share the cap would refuse (None: not known)
    prompts: int = 0  # the line's prompts that share is of

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_prompt_tokens": self.max_prompt_tokens,
            "edge": self.edge,
            "routers": list(self.routers),
            "judged_up_to": self.judged_up_to,
            "clients": list(self.clients),
            "refused_share": self.refused_share,
            "prompts": self.prompts,
        }
