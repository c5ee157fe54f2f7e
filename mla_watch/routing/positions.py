"""Routing by context position: where in its prompt a token sat when a router chose for it (no torch).

A checkpoint's context length is not the length its routers were trained on: past the trained length routing
departs from the routing it learned, while every aggregate looks healthy because long requests are a minority of
tokens. Each expert router's selections of *prompt* tokens are therefore also counted per *position bucket*:
power-of-two ranges of the token's index in its sequence (``0-63``, ``64-127``, ``128-255``, ... up to the model's
context length, and one bucket past it).

Position is not content, and the two are easily confused: a document comes early and its summary late, one
client's long texts sit where other clients' short questions never reach. So routing by position is judged so that
content cancels out:

* **Prompt tokens only.** A generated token's routing follows what the model writes (a summary after its
  document); a prompt's tokens are what clients send, at the positions they send them.
* **Each client against itself.** Counts are kept per (router, line, client). A client's bucket is compared with
  the in-range routing of that client's own earlier buckets, never with other clients' traffic: one client's long
  texts are not judged against other clients' short questions.
* **A departure held across clients.** A bucket leaves in-range routing for the line only where at least
  ``min_clients`` (2) clients, each with enough tokens there to judge, leave their own in-range routing. The line's
  divergence at a bucket is the ``min_clients``-th largest of its clients' divergences there: one client's flood
  cannot raise it alone. Prompts within the first bucket, and clients past ``max_clients`` per line, are counted
  apart (:data:`SHORT_PROMPTS`, :data:`OTHER`) and shown, never judged as one client.

A client's *in-range routing* is the pooled routing of its buckets that stay within ``drift_bits`` of the buckets
before them, scanned from the second bucket: the first bucket (a sequence's first 64 positions) routes the opening
of every prompt - system prompts, headers - and differs from the rest by content, not by position, so it is shown
but neither judged nor pooled. The first bucket that leaves in-range routing, across clients, is the line's *edge*.

Memory is bounded and fixed by the geometry: one ``int64`` vector of ``num_slots`` per (router, line, client,
bucket), clients bounded per line; a bucket forgets by halving (``max_bucket_tokens``, and every count each
``half_life_seconds``), and a client whose counts have all decayed away gives its place up.

The buckets and the records a judgement answers (:class:`PositionProfile`, :class:`Recommendation`) live in
:mod:`mla_watch.routing.position_profiles`; this module counts and judges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mla_watch.routing.client_names import OTHER, UNKNOWN
from mla_watch.routing.position_profiles import (
    FIRST_EDGE,
    BucketStats,
    ClientDeparture,
    PositionBuckets,
    PositionProfile,
    Recommendation,
    bucket_start,
)
from mla_watch.routing.stats import entropy_rows, js_divergence_rows

__all__ = [
    "DEFAULT_DRIFT_BITS",
    "DEFAULT_HALF_LIFE_SECONDS",
    "DEFAULT_MAX_BUCKET_TOKENS",
    "DEFAULT_MAX_CLIENTS",
    "DEFAULT_MIN_BUCKET_TOKENS",
    "DEFAULT_MIN_CLIENTS",
    "FIRST_EDGE",
    "SHORT_PROMPTS",
    "BucketStats",
    "ClientDeparture",
    "PositionBuckets",
    "PositionCounts",
    "PositionProfile",
    "Recommendation",
    "bucket_start",
    "line_profiles",
    "profile",
    "profiles",
    "recommend",
]

# Jensen-Shannon divergence, in bits, past which a bucket has left in-range routing. On the bundled model (64
# experts, top-6) in-range buckets of a line differ from each other by 0.003-0.02 bits over a few thousand tokens
# (prompts differ by position too: openings, bodies, closings), and the positions past its trained 256 by 0.03-0.09.
DEFAULT_DRIFT_BITS = 0.025
# Tokens a bucket needs before it is judged: fewer read a divergence of sampling noise (about 0.005 bits for 64
# experts top-6 at 768 tokens against a large reference, several times that when the tokens come from few prompts).
DEFAULT_MIN_BUCKET_TOKENS = 512
DEFAULT_MAX_BUCKET_TOKENS = 1 << 20  # a bucket halves its counts past this many tokens
DEFAULT_HALF_LIFE_SECONDS = 3600.0  # every count halves each hour: a line that stops sending long prompts recovers
# A departure across two clients is not one client's texts; more would leave a line with two long-prompt clients
# (a document pipeline and its retry) unjudged.
DEFAULT_MIN_CLIENTS = 2
DEFAULT_MAX_CLIENTS = 16  # clients per line with counts of their own; past them, together as OTHER (not judged)
MAX_CLIENTS_SHOWN = 16
MAX_SHARES_SHOWN = 8
# Prompts within the first bucket: their tokens are shown, never judged (the first bucket is only openings).
SHORT_PROMPTS = "(short prompts)"
UNJUDGED = frozenset({SHORT_PROMPTS, OTHER})  # counted, shown, never judged as one client


def profile(
    counts: np.ndarray,
    buckets: PositionBuckets,
    top_k: int,
    *,
    drift_bits: float = DEFAULT_DRIFT_BITS,
    min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
) -> PositionProfile:
    """The position profile of ``counts`` ``[buckets, slots]`` (one router, one source of prompts)."""
    return profiles(counts[None], buckets, [top_k], drift_bits=drift_bits, min_tokens=min_tokens)[0]


def profiles(
    counts: np.ndarray,
    buckets: PositionBuckets,
    top_k: Sequence[int],
    *,
    drift_bits: float = DEFAULT_DRIFT_BITS,
    min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
) -> list[PositionProfile]:
    """The position profiles of routers of one size, ``counts`` ``[routers, buckets, slots]`` of one source of
    prompts (one client), computed together.

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
            BucketStats(
                labels[index],
                buckets.starts[index],
                ends[index],
                int(tokens[router, index]),
                float(entropy[router, index]),
                None
                if index == 0 or np.isnan(js[router, index]) or not seeded[router, index]
                else float(js[router, index]),
                bool(judged[router, index]),
                bool(in_range[router, index]),
            )
            for index in range(count)
        )
        found.append(
            PositionProfile(
                records,
                None if edge < 0 else labels[edge],
                None if edge < 0 else buckets.starts[edge],
                drift,
                drift_bits,
            )
        )
    return found


def line_profiles(
    by_client: Mapping[str, np.ndarray],
    buckets: PositionBuckets,
    top_k: Sequence[int],
    *,
    drift_bits: float = DEFAULT_DRIFT_BITS,
    min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
    min_clients: int = DEFAULT_MIN_CLIENTS,
) -> list[PositionProfile]:
    """The position profiles of routers of one size for one line, from ``by_client`` client -> ``[routers, buckets,
    slots]``: each client judged against its own in-range routing (:func:`profiles`), and a bucket left for the line
    only where ``min_clients`` of them leave there (see the module docstring)."""
    judged_clients = {client: counts for client, counts in by_client.items() if client not in UNJUDGED}
    per_client = {
        client: profiles(counts, buckets, top_k, drift_bits=drift_bits, min_tokens=min_tokens)
        for client, counts in judged_clients.items()
    }
    total: np.ndarray | None = sum(by_client.values()) if by_client else None  # type: ignore[assignment]
    routers = len(top_k)
    count = len(buckets)
    labels, ends = buckets.labels, [*buckets.edges, None]
    found = []
    for router in range(routers):
        summed = total[router] if total is not None else np.zeros((count, 1), dtype=np.int64)
        tokens = summed.sum(axis=1) // int(top_k[router])
        entropy = entropy_rows(summed) if summed.shape[1] > 1 else np.zeros(count)
        line_js: list[float | None] = [None] * count
        judged = [False] * count
        for index in range(1, count):
            enough = [
                found_client[router].buckets[index]
                for found_client in per_client.values()
                if found_client[router].buckets[index].judged
            ]
            values = sorted((js for bucket in enough if (js := bucket.js_divergence) is not None), reverse=True)
            judged[index] = len(enough) >= min_clients  # the first judged bucket of its clients: a reference
            if len(values) >= min_clients:
                line_js[index] = float(values[min_clients - 1])
        edge = next((index for index in range(count) if (line_js[index] or 0.0) > drift_bits), -1)
        in_range = [judged[index] and (edge < 0 or index < edge) for index in range(count)]
        compared = [js for index in range(count) if in_range[index] and (js := line_js[index]) is not None]
        drift = line_js[edge] if edge >= 0 else (max(compared) if compared else None)
        read_at = (
            edge if edge >= 0 else max((index for index in range(count) if line_js[index] is not None), default=-1)
        )
        held = tuple(
            client
            for client, found_client in per_client.items()
            if edge >= 0
            and found_client[router].buckets[edge].judged
            and (found_client[router].buckets[edge].js_divergence or 0.0) > drift_bits
        )
        shares: tuple[tuple[str, float], ...] = ()
        if read_at >= 0:
            sent = {client: int(counts[router, read_at].sum()) for client, counts in by_client.items()}
            whole = sum(sent.values())
            if whole:
                shares = tuple(
                    (client, round(tokens_sent / whole, 4))
                    for client, tokens_sent in sorted(sent.items(), key=lambda item: -item[1])
                    if tokens_sent
                )[:MAX_SHARES_SHOWN]
        clients = tuple(
            sorted(
                (
                    ClientDeparture(
                        client,
                        int(judged_clients[client][router, 1:].sum()) // int(top_k[router]),
                        found_client[router].edge,
                        found_client[router].drift,
                    )
                    for client, found_client in per_client.items()
                ),
                key=lambda c: -c.tokens,
            )
        )
        records = tuple(
            BucketStats(
                labels[index],
                buckets.starts[index],
                ends[index],
                int(tokens[index]),
                float(entropy[index]),
                line_js[index],
                judged[index],
                in_range[index],
            )
            for index in range(count)
        )
        found.append(
            PositionProfile(
                records,
                None if edge < 0 else labels[edge],
                None if edge < 0 else buckets.starts[edge],
                drift,
                drift_bits,
                clients[:MAX_CLIENTS_SHOWN],
                held,
                shares,
                min_clients,
            )
        )
    return found


class PositionCounts:
    """Selections of prompt tokens per (router, business line, client, position bucket) of expert routers, and the
    line's prompts by length; thread-safe."""

    def __init__(
        self,
        routers: Sequence[Any],
        context_length: int,
        *,
        drift_bits: float = DEFAULT_DRIFT_BITS,
        min_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
        max_bucket_tokens: int = DEFAULT_MAX_BUCKET_TOKENS,
        half_life_seconds: float | None = DEFAULT_HALF_LIFE_SECONDS,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        min_clients: int = DEFAULT_MIN_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.buckets = PositionBuckets(context_length)
        self._routers = {info.name: info for info in routers if info.kind == "expert"}
        self.drift_bits = drift_bits
        self.min_tokens = min_tokens
        self.max_clients = max_clients
        # Clients a departure needs behind it; 1 where every prompt is the operator's own (`mla-watch context`
        # over a dataset): then one source is all there is.
        self.min_clients = min_clients
        self._max_bucket_tokens = max_bucket_tokens
        # router -> business line -> client -> [buckets, slots]
        self._counts: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        self._prompts: dict[str, np.ndarray] = {}  # business line -> prompts by the bucket of their last token
        self._clients: dict[str, set[str]] = {}  # business line -> the clients holding a place of their own
        self._lock = threading.Lock()
        self._half_life = half_life_seconds
        self._clock = clock
        self._halved_at = clock()

    def _age(self) -> None:
        """Halve every count once per elapsed half-life, and free the places of clients left with nothing (the
        lock held)."""
        if self._half_life is None:
            return
        now = self._clock()
        halvings = int((now - self._halved_at) // self._half_life)
        if halvings <= 0:
            return
        self._halved_at += halvings * self._half_life
        for lines in self._counts.values():
            for clients in lines.values():
                for array in clients.values():
                    array >>= min(halvings, 63)
        for prompts in self._prompts.values():
            prompts >>= min(halvings, 63)
        for line, holders in self._clients.items():
            for client in list(holders):
                if not any(
                    by_client[client].any()
                    for lines in self._counts.values()
                    if client in (by_client := lines.get(line, {}))
                ):
                    holders.discard(client)
                    for lines in self._counts.values():
                        lines.get(line, {}).pop(client, None)

    @property
    def routers(self) -> list[str]:
        return list(self._routers)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(
                array.nbytes
                for lines in self._counts.values()
                for clients in lines.values()
                for array in clients.values()
            )

    def client_key(self, business_line: str, client: str | None, prompt_tokens: int) -> str:
        """Under which name a prompt of ``prompt_tokens`` tokens from ``client`` is counted: the client's own
        (a place of its own, while fewer than ``max_clients`` hold one), :data:`OTHER` past that,
        :data:`SHORT_PROMPTS` for a prompt within the first bucket (nothing there is judged)."""
        first_bucket_end = self.buckets.edges[0] if self.buckets.edges else self.buckets.context_length
        if prompt_tokens <= first_bucket_end:  # its last token at most at the first bucket's last position
            return SHORT_PROMPTS
        name = client or UNKNOWN
        with self._lock:
            holders = self._clients.setdefault(business_line, set())
            if name in holders or name in UNJUDGED:
                return name
            if len(holders) >= self.max_clients:
                return OTHER
            holders.add(name)
            return name

    def holds(self, business_line: str, client: str) -> bool:
        """Whether ``client`` holds a place of its own on ``business_line`` (its counts have not decayed away)."""
        with self._lock:
            self._age()
            return client in self._clients.get(business_line, ())

    def add_prompt(self, business_line: str, prompt_tokens: int) -> None:
        """One prompt of ``prompt_tokens`` tokens served on ``business_line`` (what a cap would refuse)."""
        if prompt_tokens < 1:
            return
        bucket = int(self.buckets.bucket_of(np.asarray([prompt_tokens - 1]))[0])
        with self._lock:
            self._age()
            prompts = self._prompts.get(business_line)
            if prompts is None:
                prompts = self._prompts[business_line] = np.zeros(len(self.buckets), dtype=np.int64)
            prompts[bucket] += 1

    def prompts(self, business_line: str | None = None) -> np.ndarray:
        """Prompts by the bucket of their last token, of one line (every line summed for ``None``)."""
        with self._lock:
            self._age()
            found = [
                prompts for line, prompts in self._prompts.items() if business_line is None or line == business_line
            ]
            return sum(found, np.zeros(len(self.buckets), dtype=np.int64))

    def add(self, router: str, business_line: str, counts: np.ndarray, client: str = UNKNOWN) -> None:
        """Add ``counts`` ``[buckets, num_slots]`` of one router for one line, counted under ``client`` (a name
        :meth:`client_key` gave)."""
        info = self._routers.get(router)
        if info is None:
            raise KeyError(
                f"router {router!r} is not one of the {len(self._routers)} expert routers counted by position"
            )
        shape = (len(self.buckets), info.num_slots)
        if counts.shape != shape:
            raise ValueError(f"position counts of {router!r}: shape {list(counts.shape)}, expected {list(shape)}")
        with self._lock:
            self._age()
            clients = self._counts.setdefault(router, {}).setdefault(business_line, {})
            total = clients.get(client)
            if total is None:
                total = clients[client] = np.zeros(shape, dtype=np.int64)
            total += counts.astype(np.int64, copy=False)
            full = total.sum(axis=1) > self._max_bucket_tokens * info.top_k
            if full.any():
                total[full] //= 2

    def counts(self, router: str, business_line: str | None = None, client: str | None = None) -> np.ndarray:
        """``[buckets, num_slots]`` of one router for one line (every line summed for ``None``), of one client (every
        client summed for ``None``)."""
        info = self._routers[router]
        total = np.zeros((len(self.buckets), info.num_slots), dtype=np.int64)
        with self._lock:
            self._age()
            for line, clients in self._counts.get(router, {}).items():
                if business_line is None or line == business_line:
                    for name, array in clients.items():
                        if client is None or name == client:
                            total += array
        return total

    def _by_client(self, names: Sequence[str], business_line: str | None) -> dict[str, np.ndarray]:
        """client -> ``[routers, buckets, slots]`` of ``names`` (routers of one size) for one line (every line summed
        for ``None``: a client of several lines is one client)."""
        with self._lock:
            self._age()
            clients = {
                client
                for name in names
                for line, by_client in self._counts.get(name, {}).items()
                if business_line is None or line == business_line
                for client in by_client
            }
            out = {}
            for client in clients:
                rows = []
                for name in names:
                    info = self._routers[name]
                    row = np.zeros((len(self.buckets), info.num_slots), dtype=np.int64)
                    for line, by_client in self._counts.get(name, {}).items():
                        if (business_line is None or line == business_line) and client in by_client:
                            row += by_client[client]
                    rows.append(row)
                out[client] = np.stack(rows)
            return out

    @property
    def business_lines(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(line for lines in self._counts.values() for line in lines))

    def profile(self, router: str, business_line: str | None = None) -> PositionProfile:
        return self.profiles(business_line)[router]

    def profiles(self, business_line: str | None = None) -> dict[str, PositionProfile]:
        """Every expert router's profile for one line (all summed for ``None``), routers of one size together."""
        by_size: dict[int, list[str]] = {}
        for name, info in self._routers.items():
            by_size.setdefault(info.num_slots, []).append(name)
        found: dict[str, PositionProfile] = {}
        for names in by_size.values():
            top_k = [self._routers[name].top_k for name in names]
            by_client = self._by_client(names, business_line)
            if not by_client:
                by_client = {
                    UNKNOWN: np.zeros(
                        (len(names), len(self.buckets), self._routers[names[0]].num_slots), dtype=np.int64
                    )
                }
            found.update(
                zip(
                    names,
                    line_profiles(
                        by_client,
                        self.buckets,
                        top_k,
                        drift_bits=self.drift_bits,
                        min_tokens=self.min_tokens,
                        min_clients=self.min_clients,
                    ),
                    strict=True,
                )
            )
        return {name: found[name] for name in self._routers}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._prompts.clear()
            self._clients.clear()

    def as_dict(self, business_line: str | None = None) -> dict[str, Any]:
        """What ``GET /v1/routing`` answers under ``positions``: every expert router's profile for one line (all
        summed), and the line's prompts by length."""
        return {
            "business_line": business_line,
            "context_length": self.buckets.context_length,
            "buckets": self.buckets.labels,
            "drift_bits": self.drift_bits,
            "min_tokens": self.min_tokens,
            "min_clients": self.min_clients,
            "prompts": self.prompts(business_line).tolist(),
            "routers": [
                {"name": name, "layer": self._routers[name].layer, **found.as_dict()}
                for name, found in self.profiles(business_line).items()
            ],
        }


def recommend(profiles: dict[str, PositionProfile], prompts: Sequence[int] | None = None) -> Recommendation:
    """The last healthy position before the earliest edge of any router: prompts up to it route as in range. An edge
    is a departure held across clients (:func:`line_profiles`); ``prompts`` (the line's prompts by the bucket of
    their last token) give the share of them the cap would refuse."""
    edges = [(found.edge_start, name, found.edge) for name, found in profiles.items() if found.edge_start is not None]
    judged = [bucket.end or bucket.start for found in profiles.values() for bucket in found.buckets if bucket.judged]
    reach = max(judged, default=0)
    if not edges:
        return Recommendation(None, None, (), reach, prompts=int(sum(prompts)) if prompts is not None else 0)
    start = min(edge for edge, _, _ in edges)
    names = tuple(name for edge, name, _ in edges if edge == start)
    label = next(label for edge, _, label in edges if edge == start)
    clients = tuple(dict.fromkeys(client for name in names for client in profiles[name].held_by))
    refused, total = None, 0
    if prompts is not None:
        index = next(i for i, bucket in enumerate(next(iter(profiles.values())).buckets) if bucket.bucket == label)
        total = int(sum(prompts))
        refused = round(sum(prompts[index:]) / total, 4) if total else None
    return Recommendation(start, label, names, reach, clients, refused, total)
