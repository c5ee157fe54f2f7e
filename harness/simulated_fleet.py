"""A fleet of simulated sidecars at DeepSeek-V3's scale, for the fleet-size test and ``bench/fleet_rules.py``.

No model. Each replica is a RouterWindows of the model's geometry (58 MoE routers x 256 experts, top-8, kind
expert) with the sidecar's own metrics - ServerMetrics on a registry of its own, so the real RoutingCollector and
the per-expert window counts (every router and line, a budget that fits them) - served over HTTP on 127.0.0.1,
uncompressed, as the sidecar serves ``/metrics``: ``?shard=K/N`` and ``?experts=none`` go through the sidecar's own
:func:`mla_watch.server.metrics.metrics_view`. Each replica routes with shares of its own around a common mix per
router and line (a Dirichlet draw around it, a few experts nobody picks); with ``outlier`` the last replica routes
one router of the first line onto a few experts, so the outlier path has something to find.

:func:`expected` is what the fleet's recordings must read: :func:`mla_watch.routing.compute_stats` of the replicas'
windows summed, each replica's KL from the fleet, the Jensen-Shannon divergence.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.shards import RouterShard
from mla_watch.routing.stats import RoutingStats, compute_stats
from mla_watch.routing.windows import RouterWindows, RoutingSnapshot, take_snapshot
from mla_watch.server.expert_counts import ExpertSelection, pair_series
from mla_watch.server.exposition import exposition
from mla_watch.server.metrics import BadMetricsParam, ServerMetrics, metrics_view

__all__ = [
    "DEEPSEEK_V3",
    "Expected",
    "Feeder",
    "Geometry",
    "Replica",
    "build_replicas",
    "expected",
    "feed",
    "line_names",
    "read_budget",
    "samples_per_evaluation",
    "serving",
]

COMMON_CONCENTRATION = 2.0  # Dirichlet concentration of the fleet's common mix per router: skewed, as real routers
REPLICA_CONCENTRATION = 2000.0  # how closely a replica follows the common mix (larger: closer)
UNCHOSEN_EXPERTS = 3  # experts no replica picks, per router and line: dead slots to count
SKEWED_EXPERTS = 8  # the outlier's one router sends most of its picks to this many experts
SKEWED_SHARE = 0.9


@dataclass(frozen=True)
class Geometry:
    routers: int
    experts: int
    top_k: int
    first_layer: int  # the first MoE layer: the ones before are dense

    def infos(self) -> list[RouterInfo]:
        return [
            RouterInfo(f"model.layers.{layer}.mlp.gate", layer, "expert", self.experts, self.top_k)
            for layer in range(self.first_layer, self.first_layer + self.routers)
        ]


DEEPSEEK_V3 = Geometry(routers=58, experts=256, top_k=8, first_layer=3)  # layers 0-2 are dense


def line_names(lines: int) -> list[str]:
    return [f"line_{line}" for line in range(lines)]


@dataclass
class Replica:
    """One simulated sidecar: its windows, its routing shares per (router, line), its metrics and HTTP server."""

    index: int
    windows: RouterWindows
    shares: dict[tuple[str, str], np.ndarray]
    registry: CollectorRegistry
    metrics: ServerMetrics | None = None
    server: ThreadingHTTPServer | None = None
    body_bytes: list[int] = field(default_factory=list)
    cut_off: int = 0  # scrapes whose client hung up before the body was written (Prometheus' scrape timeout)
    _snapshot: tuple[int, RoutingSnapshot] | None = None
    _bodies: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def target(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"{host!s}:{port}"

    def snapshot(self) -> RoutingSnapshot:
        # As the sidecar does: the statistics are recomputed only when the counts changed since the last scrape.
        with self._lock:
            version = self.windows.version
            if self._snapshot is None or self._snapshot[0] != version:
                self._snapshot = (version, take_snapshot([self.windows], time.monotonic()))
            return self._snapshot[1]

    def render(self, query: str) -> bytes:
        """What ``GET /metrics?<query>`` answers (``BadMetricsParam`` for a bad parameter). Kept until the windows
        change: a fleet's replicas each render their own, where these share one process and its GIL."""
        assert self.metrics is not None
        version = self.windows.version
        cached = self._bodies.get(query)
        if cached is not None and cached[0] == version:
            return cached[1]
        params = dict(parse_qsl(query))
        body = exposition(metrics_view(self.metrics, params) if params else self.registry)
        self._bodies[query] = (version, body)
        return body


def build_replicas(
    count: int,
    geometry: Geometry,
    lines: int,
    tokens: int,
    rng: np.random.Generator,
    outlier: bool = True,
    shard: RouterShard | None = None,
) -> list[Replica]:
    """``count`` replicas, each with ``tokens`` per router and line counted into its windows; with ``shard``, only
    the routers of that shard (what a replica serves one shard's Prometheus is the same, and the rest would cost
    this one process its statistics at every change)."""
    infos = [info for info in geometry.infos() if shard is None or shard.holds(info.layer)]
    names = line_names(lines)
    common: dict[tuple[str, str], np.ndarray] = {}
    for info in infos:
        for line in names:
            weights = rng.dirichlet(np.full(info.num_slots, COMMON_CONCENTRATION))
            weights[rng.choice(info.num_slots, size=UNCHOSEN_EXPERTS, replace=False)] = 0.0
            common[(info.name, line)] = weights / weights.sum()
    replicas = []
    for index in range(count):
        shares: dict[tuple[str, str], np.ndarray] = {}
        for key, mix in common.items():
            alive = mix > 0
            own = np.zeros_like(mix)
            own[alive] = rng.dirichlet(mix[alive] * REPLICA_CONCENTRATION)
            shares[key] = own
        if outlier and index == count - 1 and count > 1:
            key = (infos[0].name, names[0])
            favoured = rng.choice(infos[0].num_slots, size=SKEWED_EXPERTS, replace=False)
            skewed = shares[key] * (1.0 - SKEWED_SHARE)
            skewed[favoured] += SKEWED_SHARE / SKEWED_EXPERTS
            shares[key] = skewed / skewed.sum()
        replica = Replica(index, RouterWindows(infos), shares, CollectorRegistry())
        budget = sum(pair_series(info) for info in infos) * lines  # every pair admitted
        replica.metrics = ServerMetrics(
            replica.registry, replica.snapshot, expert_counts=ExpertSelection(), expert_series_budget=budget
        )
        feed(replica, infos, tokens, rng)
        replicas.append(replica)
    return replicas


def feed(replica: Replica, infos: Sequence[RouterInfo], tokens: int, rng: np.random.Generator) -> None:
    """``tokens`` more per router and line, each token picking ``top_k`` experts by the replica's shares."""
    by_name = {info.name: info for info in infos}
    for (router, line), shares in replica.shares.items():
        counts = rng.multinomial(tokens * by_name[router].top_k, shares).astype(np.int64)
        replica.windows.add(router, line, CountDelta(counts, tokens))


class Feeder(threading.Thread):
    """Adds ``tokens`` per router and line to every replica every ``period`` seconds, until stopped, and renders
    what Prometheus will ask for (``query``) right after: the scrapes that follow are answered at once."""

    def __init__(
        self, replicas: list[Replica], infos: list[RouterInfo], tokens: int, seed: int, period: float, query: str = ""
    ) -> None:
        super().__init__(daemon=True, name="feeder")
        self._replicas, self._infos, self._tokens, self._period = replicas, infos, tokens, period
        self._query = query
        self._rng = np.random.default_rng(seed)
        self._stopping = threading.Event()
        self.rounds: list[float] = []  # seconds each round of feeding and rendering took

    def run(self) -> None:
        while not self._stopping.wait(self._period):
            started = time.monotonic()
            for replica in self._replicas:
                feed(replica, self._infos, self._tokens, self._rng)
                replica.render(self._query)
            self.rounds.append(time.monotonic() - started)

    def stop(self) -> None:
        self._stopping.set()
        self.join(60)


def _serve(replica: Replica) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path != "/metrics":
                self.send_error(404)
                return
            try:
                body = replica.render(url.query)
            except BadMetricsParam as error:
                self.send_error(400, str(error))
                return
            replica.body_bytes.append(len(body))
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                replica.cut_off += 1

        def log_message(self, format: str, *args: Any) -> None:
            pass

    replica.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    replica.server.daemon_threads = True
    threading.Thread(target=replica.server.serve_forever, daemon=True, name=f"replica-{replica.index}").start()


@contextlib.contextmanager
def serving(replicas: list[Replica]) -> Iterator[list[str]]:
    """Every replica's /metrics on a loopback port of its own for the ``with`` block; yields their targets."""
    try:
        for replica in replicas:
            _serve(replica)
        yield [replica.target for replica in replicas]
    finally:
        for replica in replicas:
            if replica.server is not None:
                replica.server.shutdown()
                replica.server.server_close()


@dataclass(frozen=True)
class Expected:
    """What the fleet's recordings of one router and line must read."""

    stats: RoutingStats
    kl_bits: dict[str, float]  # per replica target, replicas with selections only
    jsd_bits: float


def expected(replicas: list[Replica], shard: RouterShard | None = None) -> dict[tuple[str, str], Expected]:
    """compute_stats of the replicas' windows summed, per (router, line) (of ``shard``'s routers), with each
    replica's KL from the fleet and the replicas' generalized Jensen-Shannon divergence."""
    infos = {info.name: info for info in replicas[0].windows.routers}
    keys = {key for replica in replicas for key in replica.shares if shard is None or shard.holds(infos[key[0]].layer)}
    found = {}
    for router, line in sorted(keys):
        info = infos[router]
        per_replica: dict[str, np.ndarray] = {}
        tokens = 0
        for replica in replicas:
            totals = replica.windows.window_totals(router, line)
            if totals is not None:
                per_replica[replica.target] = totals.counts.astype(np.float64)
                tokens += totals.tokens
        summed = np.sum(list(per_replica.values()), axis=0)
        stats = compute_stats(summed, kind="expert", top_k=info.top_k, tokens=tokens)
        fleet_p = summed / summed.sum()
        kl: dict[str, float] = {}
        for target, counts in per_replica.items():
            if counts.sum() > 0:
                p = counts / counts.sum()
                chosen = p > 0
                kl[target] = float(np.sum(p[chosen] * np.log2(p[chosen] / fleet_p[chosen])))
        jsd = float(sum(per_replica[target].sum() / summed.sum() * value for target, value in kl.items()))
        found[(router, line)] = Expected(stats, kl, jsd)
    return found


def samples_per_evaluation(url: str, groups: Sequence[str]) -> dict[str, int]:
    """The samples one evaluation of each of ``groups`` reads in the Prometheus at ``url``: every rule's query run
    once at one instant with the engine's statistics (``totalQueryableSamples``), as the group runs them."""
    http = httpx.Client(timeout=600)
    found = {group["name"]: group for group in http.get(url + "/api/v1/rules").json()["data"]["groups"]}
    at = time.time() - 1
    read = {}
    for name in groups:
        read[name] = 0
        for rule in found[name]["rules"]:
            answer = http.get(url + "/api/v1/query", params={"query": rule["query"], "time": at, "stats": "all"}).json()
            assert answer["status"] == "success", answer
            read[name] += int(answer["data"]["stats"]["samples"]["totalQueryableSamples"])
    return read


def read_budget(replicas: int, pairs: int, experts: int) -> tuple[int, int]:
    """The most samples one evaluation of the fleet group and of the replica group may read (docs/fleet.md, "Series
    cost"), for ``replicas`` exporting ``pairs`` routers and lines of ``experts`` each: each replica's per-expert
    series once (the replica group: twice), the fleet's per-expert sums four times (once), some twenty of each
    replica's per-router gauges (its tokens, selections, slots, entropy, floor, baselines) and some fifty of the
    fleet's per-router recordings."""
    replica_series, fleet_series, replica_pairs = replicas * pairs * experts, pairs * experts, replicas * pairs
    return (
        replica_series + 4 * fleet_series + 20 * replica_pairs + 50 * pairs,
        2 * replica_series + fleet_series + 20 * replica_pairs + 50 * pairs,
    )
