"""What the fleet recording rules cost real Prometheus: 10 simulated DeepSeek-V3 replicas scraped and judged.

    python -m bench.fleet_rules                          # 10 replicas, 1 line, ~4 min
    python -m bench.fleet_rules --lines 4 --evaluation-interval 60
    python -m bench.fleet_rules --replicas 5 --json five.json

No model. Each replica is a RouterWindows of DeepSeek-V3's geometry (58 MoE routers x 256 experts, top-8, kind
expert) with the sidecar's own metrics - ServerMetrics on a registry of its own, so the real RoutingCollector and
ExpertCountsCollector (every router and line, a budget that fits them) - served over HTTP on 127.0.0.1,
uncompressed as the sidecar serves /metrics. Each replica routes with shares of its own around a common mix per
router (a Dirichlet draw around it); the last replica routes one router onto a few experts, so the outlier path
(its KL from the fleet) has something to find. A thread adds counts to every replica every second, so the
counters keep growing between scrapes.

Real Prometheus (--prometheus, default the one on PATH) scrapes the replicas as job mla_watch every --interval
seconds (5; raised to twice what one scrape round of them costs in this one process, when that is longer: the
replicas' bodies are rendered one at a time here, where a fleet's replicas each render their own) and loads what
`mla-watch rules export --rules mla_watch/shipped/rules --fleet --fleet-window W --fleet-interval E` writes
(E: --evaluation-interval, 15 s by default, so that a run measures several rounds in minutes). W defaults to 1m, the
shortest the exporter takes, so that after a warm-up of one window the window delta's `offset` side holds
samples, as it does in a fleet that has run for an hour with the default 1h (the offset selects instant samples:
the cost does not grow with W). After the warm-up the bench reads Prometheus' /metrics and query API every
evaluation round: the rule groups' last duration (prometheus_rule_group_last_duration_seconds), missed
iterations, head series, Prometheus' RSS, the series each recording rule produced, and each target's scrape
duration, samples and body size (--enable-feature=extra-scrape-metrics). Printed: series per replica and in the
fleet, bytes per scrape, the fleet group's evaluation time (median of --rounds rounds) and its ratio to the
evaluation interval measured and to the exported default (below 1: Prometheus keeps up), recorded series, head
series, Prometheus RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.server_overhead import wait_answering
from mla_watch import cli
from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.fleet import (
    DEFAULT_INTERVAL_SECONDS,
    FLEET_ENTROPY_BITS,
    FLEET_GROUP_NAME,
    REPLICA_KL_BITS,
)
from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.windows import RouterWindows, RoutingSnapshot, take_snapshot
from mla_watch.server.expert_counts import ExpertSelection, pair_series
from mla_watch.server.metrics import ServerMetrics
from tests.support import end_process, free_port

ROOT = Path(__file__).resolve().parents[1]
FIRST_MOE_LAYER = 3  # DeepSeek-V3: layers 0-2 are dense
REPLICA_GROUP_NAME = "mla_watch_routing"  # the per-replica alerts' group in the exported file
SHIPPED_RULES = ROOT / "mla_watch" / "shipped" / "rules"
COMMON_CONCENTRATION = 2.0  # Dirichlet concentration of the fleet's common mix per router: skewed, as real routers
REPLICA_CONCENTRATION = 2000.0  # how closely a replica follows the common mix (larger: closer)
SKEWED_EXPERTS = 8  # the skewed replica's one router sends most of its picks to this many experts
SKEWED_SHARE = 0.9
FEED_SECONDS = 1.0
MAX_LINES = 8  # 8 lines of DeepSeek-V3 are ~120k series per replica: past that the machine is what is measured


def bounded_int(flag: str, low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer from {low} to {high}")
        return value
    return parse


def bounded_float(flag: str, low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a number from {low:g} to {high:g}")
        return value
    return parse


# -- the simulated replicas ----------------------------------------------------------------------------------------

@dataclass
class Replica:
    """One simulated sidecar: its windows, its routing shares per (router, line), its registry and HTTP server."""

    index: int
    windows: RouterWindows
    shares: dict[tuple[str, str], np.ndarray]
    registry: CollectorRegistry
    server: ThreadingHTTPServer | None = None
    body_bytes: list[int] = field(default_factory=list)
    cut_off: int = 0  # scrapes whose client hung up before the body was written (Prometheus' scrape timeout)
    _snapshot: tuple[int, RoutingSnapshot] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def target(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def snapshot(self) -> RoutingSnapshot:
        # As the sidecar does: the statistics are recomputed only when the counts changed since the last scrape.
        with self._lock:
            version = self.windows.version
            if self._snapshot is None or self._snapshot[0] != version:
                self._snapshot = (version, take_snapshot([self.windows], time.monotonic()))
            return self._snapshot[1]


def router_infos(routers: int, experts: int, top_k: int) -> list[RouterInfo]:
    return [RouterInfo(f"model.layers.{layer}.mlp.gate", layer, "expert", experts, top_k)
            for layer in range(FIRST_MOE_LAYER, FIRST_MOE_LAYER + routers)]


def build_replicas(count: int, infos: list[RouterInfo], lines: int, initial_tokens: int,
                   rng: np.random.Generator) -> list[Replica]:
    line_names = [f"line_{line}" for line in range(lines)]
    common: dict[tuple[str, str], np.ndarray] = {}
    for info in infos:
        for line in line_names:
            weights = rng.dirichlet(np.full(info.num_slots, COMMON_CONCENTRATION))
            weights[rng.choice(info.num_slots, size=3, replace=False)] = 0.0  # a few experts nobody picks
            common[(info.name, line)] = weights / weights.sum()
    replicas = []
    for index in range(count):
        shares: dict[tuple[str, str], np.ndarray] = {}
        for key, mix in common.items():
            alive = mix > 0
            own = np.zeros_like(mix)
            own[alive] = rng.dirichlet(mix[alive] * REPLICA_CONCENTRATION)
            shares[key] = own
        if index == count - 1 and count > 1:
            # The outlier: one router of this replica sends most picks to a few experts.
            key = (infos[0].name, line_names[0])
            favoured = rng.choice(infos[0].num_slots, size=SKEWED_EXPERTS, replace=False)
            skewed = shares[key] * (1.0 - SKEWED_SHARE)
            skewed[favoured] += SKEWED_SHARE / SKEWED_EXPERTS
            shares[key] = skewed / skewed.sum()
        windows = RouterWindows(infos)
        registry = CollectorRegistry()
        replica = Replica(index, windows, shares, registry)
        budget = sum(pair_series(info) for info in infos) * lines  # every pair admitted
        ServerMetrics(registry, replica.snapshot, routing_windows=lambda w=windows: [w],
                      expert_counts=ExpertSelection(), expert_series_budget=budget)
        feed(replica, infos, initial_tokens, rng)
        replicas.append(replica)
    return replicas


def feed(replica: Replica, infos: list[RouterInfo], tokens: int, rng: np.random.Generator) -> None:
    by_name = {info.name: info for info in infos}
    for (router, line), shares in replica.shares.items():
        counts = rng.multinomial(tokens * by_name[router].top_k, shares).astype(np.int64)
        replica.windows.add(router, line, CountDelta(counts, tokens))


class Feeder(threading.Thread):
    """Adds ``tokens`` per router and line to every replica every second, until stopped."""

    def __init__(self, replicas: list[Replica], infos: list[RouterInfo], tokens: int, seed: int) -> None:
        super().__init__(daemon=True, name="feeder")
        self._replicas, self._infos, self._tokens = replicas, infos, tokens
        self._rng = np.random.default_rng(seed)
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(FEED_SECONDS):
            for replica in self._replicas:
                feed(replica, self._infos, self._tokens, self._rng)

    def stop(self) -> None:
        self._stopping.set()
        self.join(10)


def serve(replica: Replica) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = generate_latest(replica.registry)
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


# -- Prometheus ----------------------------------------------------------------------------------------------------

def export_rules(path: Path, fleet_window: str, fleet_interval: str) -> list[str]:
    """Write the shipped rules with --fleet to ``path`` through the CLI; the recording names it holds."""
    code = cli.main(["rules", "export", "--rules", str(SHIPPED_RULES), "--fleet", "--fleet-window", fleet_window,
                     "--fleet-interval", fleet_interval, "--out", str(path)])
    if code != 0:
        raise SystemExit(f"mla-watch rules export --fleet exited {code}")
    groups = yaml.safe_load(path.read_text())["groups"]
    return [rule["record"] for group in groups for rule in group["rules"] if "record" in rule]


@contextlib.contextmanager
def running_prometheus(binary: str, workdir: Path, rules: Path, targets: list[str],
                       interval: float, evaluation_interval: float) -> Iterator[str]:
    port = free_port()
    seconds = f"{interval:g}s"
    config = {
        "global": {"scrape_interval": seconds, "scrape_timeout": seconds,
                   "evaluation_interval": f"{evaluation_interval:g}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "mla_watch", "static_configs": [{"targets": targets}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = workdir / "prometheus.log"
    with log.open("w") as handle:
        process = subprocess.Popen([
            binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=extra-scrape-metrics",
        ], stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url + "/-/ready", process, 60, f"prometheus on port {port}")
        yield url
    except BaseException:
        print(f"prometheus' log, last lines:\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        end_process(process)


class PrometheusClient:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(timeout=60)

    def vector(self, query: str) -> list[dict[str, Any]]:
        answer = self.http.get(self.url + "/api/v1/query", params={"query": query}).json()
        if answer.get("status") != "success":
            raise SystemExit(f"query {query!r} failed: {answer}")
        return answer["data"]["result"]

    def own_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Prometheus' own /metrics: sample name -> (labels, value) of each sample."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(self.http.get(self.url + "/metrics").text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
        return samples

    def rule_groups(self) -> dict[str, dict[str, Any]]:
        answer = self.http.get(self.url + "/api/v1/rules").json()
        return {group["name"]: group for group in answer["data"]["groups"]}

    def targets_up(self) -> int:
        answer = self.http.get(self.url + "/api/v1/targets", params={"state": "active"}).json()
        return sum(1 for target in answer["data"]["activeTargets"]
                   if target["health"] == "up" and target["labels"].get("job") == "mla_watch")


def group_value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, group: str) -> float | None:
    for labels, value in samples.get(name, []):
        if labels.get("rule_group", "").endswith(";" + group):
            return value
    return None


def single(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    [(_, value)] = samples[name]
    return value


# -- the measurement -----------------------------------------------------------------------------------------------

def scrape_interval(replicas: list[Replica], asked: float) -> float:
    """The scrape interval (and timeout) to use: ``asked``, or twice what one scrape round of every replica costs
    here, whichever is longer.

    The simulated replicas share this one Python process: Prometheus scrapes them at once, but their /metrics
    bodies are rendered one at a time. With 4 lines of DeepSeek-V3 a body is 8.5 MB (62,631 lines), about half
    a second to render on an idle core; ten take five, the default interval. Past it every scrape times out,
    the counters go stale and the window deltas (``x - x offset W``) select nothing: the recordings stay empty.
    A fleet's replicas each render their own.
    """
    started = time.monotonic()
    for replica in replicas:
        generate_latest(replica.registry)
    round_s = time.monotonic() - started
    interval = max(asked, float(math.ceil(2 * round_s)))
    if interval > asked:
        print(f"  one scrape round of the {len(replicas)} simulated replicas takes {round_s:.1f} s in this process: "
              f"scraping every {interval:g} s instead of {asked:g} s (a fleet's replicas render their own /metrics)",
              flush=True)
    return interval


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    infos = router_infos(args.routers, args.experts, args.top_k)
    fleet_window = f"{args.fleet_window}m"
    rules_path = workdir / "fleet.rules.yml"
    recordings = export_rules(rules_path, fleet_window, format_duration(args.evaluation_interval))
    replicas = build_replicas(args.replicas, infos, args.lines, args.initial_tokens, rng)
    args.interval = scrape_interval(replicas, args.interval)
    for replica in replicas:
        serve(replica)
    feeder = Feeder(replicas, infos, args.tokens_per_second, args.seed + 1)
    feeder.start()
    started = time.monotonic()
    deadline = started + args.max_seconds
    try:
        with running_prometheus(args.prometheus, workdir, rules_path, [r.target for r in replicas],
                                args.interval, args.evaluation_interval) as url:
            prometheus = PrometheusClient(url)
            while prometheus.targets_up() < args.replicas:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {prometheus.targets_up()} of {args.replicas} targets up "
                                     f"within --max-seconds {args.max_seconds:g}")
                time.sleep(0.5)
            up_at = time.monotonic()
            print(f"  {args.replicas} targets up {up_at - started:.0f} s after start; warming up for the "
                  f"{fleet_window} window and {args.warmup_rounds} round(s)", flush=True)
            # Rounds that start after the warm-up; Prometheus' clock (the evaluation timestamps) is the wall clock.
            measure_from = time.time() + args.fleet_window * 60 + args.warmup_rounds * args.evaluation_interval
            rounds: dict[float, dict[str, Any]] = {}
            rss: list[float] = []
            cpu: list[tuple[float, float, float]] = []  # (wall, Prometheus' CPU seconds, this process' CPU seconds)
            while len(rounds) < args.rounds:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{len(rounds)} of {args.rounds} measured rounds within --max-seconds "
                                     f"{args.max_seconds:g}: raise it, or lower --rounds")
                time.sleep(min(args.interval, args.evaluation_interval) / 4)
                samples = prometheus.own_metrics()
                evaluated = group_value(samples, "prometheus_rule_group_last_evaluation_timestamp_seconds",
                                        FLEET_GROUP_NAME)
                if evaluated is None or evaluated < measure_from or evaluated in rounds:
                    continue
                group = prometheus.rule_groups()[FLEET_GROUP_NAME]
                failed = [rule for rule in group["rules"] if rule.get("lastError")]
                if failed:  # a recording that fails records nothing, and every rule after it reads nothing new
                    raise SystemExit("rules that failed in Prometheus: " + "; ".join(
                        f"{rule['name']}: {rule['lastError']} after {float(rule['evaluationTime']):.1f} s"
                        for rule in failed) + f" (the fleet group took {group.get('evaluationTime', 0):.1f} s; "
                        "Prometheus' --query.timeout, 2m by default, bounds each rule)")
                rounds[evaluated] = {
                    "fleet_s": group_value(samples, "prometheus_rule_group_last_duration_seconds", FLEET_GROUP_NAME),
                    "replica_s": group_value(samples, "prometheus_rule_group_last_duration_seconds",
                                             REPLICA_GROUP_NAME),
                    "rules": {rule.get("name"): float(rule["evaluationTime"]) for rule in group["rules"]
                              if rule.get("type") == "recording"},
                }
                rss.append(single(samples, "process_resident_memory_bytes"))
                cpu.append((time.monotonic(), single(samples, "process_cpu_seconds_total"), time.process_time()))
                print(f"  round {len(rounds)}: fleet group {rounds[evaluated]['fleet_s']:.3f} s", flush=True)
            figures = read_figures(prometheus, args, recordings, rounds, rss, replicas, infos)
            if len(cpu) > 1:
                # The cores each side had while measuring: on shared cores, what Prometheus' times were bought with.
                wall = cpu[-1][0] - cpu[0][0]
                figures["prometheus_cores"] = (cpu[-1][1] - cpu[0][1]) / wall
                figures["replicas_cores"] = (cpu[-1][2] - cpu[0][2]) / wall
    finally:
        feeder.stop()
        for replica in replicas:
            if replica.server is not None:
                replica.server.shutdown()
                replica.server.server_close()
    figures["wall_s"] = time.monotonic() - started
    return figures


def read_figures(prometheus: PrometheusClient, args: argparse.Namespace, recordings: list[str],
                 rounds: dict[float, dict[str, Any]], rss: list[float], replicas: list[Replica],
                 infos: list[RouterInfo]) -> dict[str, Any]:
    samples = prometheus.own_metrics()
    fleet_s = [r["fleet_s"] for r in rounds.values()]
    alerts_s = [r["fleet_s"] - sum(r["rules"].values()) for r in rounds.values()]
    replica_s = [r["replica_s"] for r in rounds.values() if r["replica_s"] is not None]
    per_rule = {name: statistics.median(r["rules"][name] for r in rounds.values()) for name in recordings}
    # Replica-level recordings grow with the replicas; fleet-level ones with routers x lines x experts only.
    replica_rules_s = [sum(t for name, t in r["rules"].items() if name.startswith("replica:")) for r in rounds.values()]
    fleet_rules_s = [sum(t for name, t in r["rules"].items() if name.startswith("fleet:")) for r in rounds.values()]
    span = f"{max(int(len(rounds) * args.evaluation_interval), int(args.interval))}s"
    durations = {s["metric"]["instance"]: float(s["value"][1]) for s in prometheus.vector(
        f'quantile_over_time(0.5, scrape_duration_seconds{{job="mla_watch"}}[{span}])')}
    scraped = {s["metric"]["instance"]: float(s["value"][1])
               for s in prometheus.vector('scrape_samples_scraped{job="mla_watch"}')}
    body = {s["metric"]["instance"]: float(s["value"][1])
            for s in prometheus.vector('scrape_body_size_bytes{job="mla_watch"}')}
    up = [float(s["value"][1]) for s in prometheus.vector(f'avg_over_time(up{{job="mla_watch"}}[{span}])')]
    recorded = {name: 0 for name in recordings}
    for name in recordings:
        for s in prometheus.vector(f"count({name})"):
            recorded[name] = int(float(s["value"][1]))
    missing = [name for name, count in recorded.items() if count == 0]
    if up and statistics.mean(up) < 0.99:  # stale counters: the window deltas select nothing, whatever the rules
        raise SystemExit(f"the targets were up for {100 * statistics.mean(up):.0f}% of the scrapes only (scrape "
                         f"timeout {args.interval:g} s, median scrape {statistics.median(durations.values()):.1f} s): "
                         f"raise --interval; recordings with no series: {', '.join(missing) or 'none'}")
    if missing:
        raise SystemExit(f"recordings with no series after the warm-up: {', '.join(missing)}")
    pairs = args.routers * args.lines
    if recorded[FLEET_ENTROPY_BITS] != pairs:
        raise SystemExit(f"{FLEET_ENTROPY_BITS}: {recorded[FLEET_ENTROPY_BITS]} series, expected {pairs}")
    # The outlier path: the skewed replica's KL from the fleet on its skewed router, against the others'.
    skewed_router = infos[0].name
    kl = {s["metric"]["instance"]: float(s["value"][1]) for s in prometheus.vector(
        f'{REPLICA_KL_BITS}{{router="{skewed_router}",business_line="line_0"}}')}
    skewed_target = replicas[-1].target
    peers = [value for instance, value in kl.items() if instance != skewed_target]
    missed = sum(value for labels, value in samples.get("prometheus_rule_group_iterations_missed_total", [])
                 if labels.get("rule_group", "").endswith(";" + FLEET_GROUP_NAME))
    iterations = sum(value for labels, value in samples.get("prometheus_rule_group_iterations_total", [])
                     if labels.get("rule_group", "").endswith(";" + FLEET_GROUP_NAME))
    failures = sum(value for labels, value in samples.get("prometheus_rule_evaluation_failures_total", [])
                   if labels.get("rule_group", "").endswith(";" + FLEET_GROUP_NAME))
    server_bytes = [statistics.median(r.body_bytes) for r in replicas if r.body_bytes]
    fleet_median = statistics.median(fleet_s)
    return {
        "replicas": args.replicas, "lines": args.lines, "routers": args.routers, "experts": args.experts,
        "top_k": args.top_k, "interval_s": args.interval, "evaluation_interval_s": args.evaluation_interval,
        "default_interval_s": DEFAULT_INTERVAL_SECONDS, "fleet_window_minutes": args.fleet_window,
        "rounds": len(rounds),
        "series_per_replica": statistics.median(scraped.values()),
        "series_fleet": sum(scraped.values()),
        "bytes_per_scrape_per_replica": statistics.median(server_bytes),
        "prometheus_body_bytes_per_replica": statistics.median(body.values()) if body else None,
        "bytes_per_interval_fleet": sum(server_bytes),
        "scrape_s_median": statistics.median(durations.values()), "scrape_s_max": max(durations.values()),
        "fleet_group_s": fleet_median, "fleet_group_s_min": min(fleet_s), "fleet_group_s_max": max(fleet_s),
        "fleet_group_s_rounds": fleet_s,
        "fleet_group_ratio": fleet_median / args.evaluation_interval,
        "fleet_group_ratio_default": fleet_median / DEFAULT_INTERVAL_SECONDS,
        "replica_recordings_s": statistics.median(replica_rules_s),
        "fleet_recordings_s": statistics.median(fleet_rules_s),
        "fleet_alerts_s": statistics.median(alerts_s),
        "up_share": statistics.mean(up) if up else 0.0, "scrapes_cut_off": sum(r.cut_off for r in replicas),
        "replica_group_s": statistics.median(replica_s) if replica_s else None,
        "fleet_iterations": iterations, "fleet_iterations_missed": missed, "fleet_evaluation_failures": failures,
        "slowest_rules_s": dict(sorted(per_rule.items(), key=lambda item: -item[1])[:5]),
        "recorded_series": recorded, "recorded_series_total": sum(recorded.values()),
        "head_series": single(samples, "prometheus_tsdb_head_series"),
        "prometheus_rss_bytes": single(samples, "process_resident_memory_bytes"),
        "prometheus_rss_bytes_max": max([*rss, single(samples, "process_resident_memory_bytes")]),
        "skewed_replica_kl_bits": kl.get(skewed_target),
        "peer_kl_bits_median": statistics.median(peers) if peers else None,
    }


def report(figures: dict[str, Any], command: str) -> None:
    f = figures
    mib = 2**20
    print(f"\n{command}")
    print(f"{f['replicas']} replicas x {f['routers']} routers x {f['experts']} experts (top-{f['top_k']}), "
          f"{f['lines']} line(s); scrape every {f['interval_s']:g} s, fleet group every "
          f"{f['evaluation_interval_s']:g} s; fleet window "
          f"{f['fleet_window_minutes']}m; {f['rounds']} measured rounds")
    print(f"  series per replica: {f['series_per_replica']:,.0f}; in the fleet: {f['series_fleet']:,.0f}")
    print(f"  bytes per scrape per replica: {f['bytes_per_scrape_per_replica']:,.0f} (uncompressed); the fleet per "
          f"interval: {f['bytes_per_interval_fleet'] / mib:.1f} MiB")
    print(f"  scrape duration per target: median {f['scrape_s_median'] * 1e3:.0f} ms, slowest target "
          f"{f['scrape_s_max'] * 1e3:.0f} ms ({f['replicas']} replicas share one Python process here)")
    print(f"  fleet group ({FLEET_GROUP_NAME}) evaluation: median {f['fleet_group_s']:.3f} s "
          f"(min {f['fleet_group_s_min']:.3f}, max {f['fleet_group_s_max']:.3f}) = "
          f"x{f['fleet_group_ratio']:.3f} of the {f['evaluation_interval_s']:g} s interval measured, "
          f"x{f['fleet_group_ratio_default']:.3f} of the exported default {f['default_interval_s']:g} s; "
          "per-replica group "
          + ("n/a" if f["replica_group_s"] is None else f"{f['replica_group_s'] * 1e3:.1f} ms"))
    print(f"    of which replica-level recordings {f['replica_recordings_s']:.3f} s, fleet-level recordings "
          f"{f['fleet_recordings_s']:.3f} s, alerts {f['fleet_alerts_s']:.3f} s (medians)")
    print(f"  fleet group iterations {f['fleet_iterations']:.0f}, missed {f['fleet_iterations_missed']:.0f}, "
          f"evaluation failures {f['fleet_evaluation_failures']:.0f}; targets up {100 * f['up_share']:.1f}% of the "
          f"measured scrapes, {f['scrapes_cut_off']} scrapes cut off by the scrape timeout in the whole run")
    if "prometheus_cores" in f:
        print(f"  CPU while measuring: Prometheus {f['prometheus_cores']:.2f} cores, the simulated replicas "
              f"{f['replicas_cores']:.2f} cores")
    print("  slowest recordings (median s): " + ", ".join(f"{name} {seconds:.3f}"
                                                          for name, seconds in f["slowest_rules_s"].items()))
    print(f"  recorded series: {f['recorded_series_total']:,}; head series: {f['head_series']:,.0f}; "
          f"Prometheus RSS {f['prometheus_rss_bytes'] / mib:,.0f} MiB "
          f"(max seen {f['prometheus_rss_bytes_max'] / mib:,.0f})")
    for name, count in f["recorded_series"].items():
        print(f"    {name}: {count:,}")
    if f["skewed_replica_kl_bits"] is not None and f["peer_kl_bits_median"] is not None:
        print(f"  outlier path: the skewed replica's KL from the fleet {f['skewed_replica_kl_bits']:.3f} bits; "
              f"its peers' median {f['peer_kl_bits_median']:.4f} bits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=bounded_int("--replicas", 1, 100), default=10,
                        help="simulated replicas (default 10)")
    parser.add_argument("--lines", type=bounded_int("--lines", 1, MAX_LINES), default=1,
                        help="business lines per replica (default 1)")
    parser.add_argument("--routers", type=bounded_int("--routers", 1, 256), default=58,
                        help="MoE routers (DeepSeek-V3: 58)")
    parser.add_argument("--experts", type=bounded_int("--experts", 2, 1024), default=256,
                        help="experts per router (DeepSeek-V3: 256)")
    parser.add_argument("--top-k", type=bounded_int("--top-k", 1, 64), default=8, help="experts per token (8)")
    parser.add_argument("--interval", type=bounded_float("--interval", 1, 300), default=5.0,
                        help="Prometheus' scrape interval, seconds (default 5)")
    parser.add_argument("--evaluation-interval", type=bounded_float("--evaluation-interval", 1, 3600), default=15.0,
                        help="the fleet group's evaluation interval, seconds (rules export --fleet-interval; "
                             "default 15)")
    parser.add_argument("--fleet-window", type=bounded_int("--fleet-window", 1, 60), default=1,
                        help="the fleet window in minutes (rules export --fleet-window; default 1)")
    parser.add_argument("--warmup-rounds", type=bounded_int("--warmup-rounds", 0, 100), default=2,
                        help="evaluation rounds after the first window before measuring (default 2)")
    parser.add_argument("--rounds", type=bounded_int("--rounds", 1, 1000), default=5,
                        help="evaluation rounds measured (default 5)")
    parser.add_argument("--initial-tokens", type=bounded_int("--initial-tokens", 1, 10**9), default=1_000_000,
                        help="tokens counted per router and line before the first scrape")
    parser.add_argument("--tokens-per-second", type=bounded_int("--tokens-per-second", 1, 10**7), default=2000,
                        help="tokens added per router, line and replica every second")
    parser.add_argument("--max-seconds", type=bounded_float("--max-seconds", 30, 3600), default=600.0,
                        help="give up after this long (default 600)")
    parser.add_argument("--prometheus", default=shutil.which("prometheus"), help="the Prometheus binary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    if not args.prometheus:
        parser.error("--prometheus: no prometheus binary on PATH; expected the path to one (Prometheus 2.x)")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k}: expected at most --experts ({args.experts})")

    command = " ".join(["python", "bench/fleet_rules.py", *sys.argv[1:]])
    print(command, flush=True)
    with tempfile.TemporaryDirectory(prefix="mla-watch-fleet-bench-") as workdir:
        figures = measure(args, Path(workdir))
    figures["command"] = command
    report(figures, command)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
