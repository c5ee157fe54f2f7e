"""What the fleet rules cost real Prometheus at fleet size, and whether they record exactly there.

    python -m bench.fleet_rules                      # 10x1, 10x4 and one shard of 100x4/10, ~20 min
    python -m bench.fleet_rules --layouts 10x4       # one layout
    python -m bench.fleet_rules --layouts 100x4/10 --rounds 5 --json shard.json

A layout is REPLICAS x LINES, and /SHARDS where the fleet is split by layer across that many Prometheus servers:
the bench runs one of them at its full size (``--shard``, by default the shard of the first MoE layer, whose
router the outlier skews): every replica is scraped as ``/metrics?shard=K/N`` and the rules are
``rules export --fleet --fleet-shards N``, whose other shards' groups find nothing there.

No model: the replicas are harness/simulated_fleet.py's DeepSeek-V3 sidecars (58 MoE routers x 256 experts, top-8),
each a RouterWindows with the sidecar's own metrics and its per-expert window counts, served over HTTP on 127.0.0.1
(for a shard, with that shard's routers only: what they serve its Prometheus is the same).
Every --scrape-interval each replica's windows take --tokens more per router and line (the
default window holds 4096) and its /metrics is rendered for the scrape to come: these replicas share this one
process, where a fleet's replicas each render their own.

Real Prometheus (--prometheus, default the one on PATH; Debian's 2.42 here) scrapes them every --scrape-interval
(15 s) and loads what ``mla-watch rules export --rules mla_watch/shipped/rules --fleet`` writes, with the fleet
group at its exported interval (1m) and the replica group at --outlier-interval (2m here, so that a run measures
several of its rounds; 5m exported). This machine is shared: before each layout the bench waits (--quiet-wait)
until its load average is at most --quiet-load. After a warm-up the bench reads, for --rounds evaluations of the
fleet group and --replica-rounds of the replica group, the evaluation time and every rule's health from
Prometheus' rule API (/api/v1/rules), and Prometheus' RSS and CPU from its /metrics; then the samples one
evaluation reads (each rule's query run with stats=all, the engine's totalQueryableSamples). Last, the replicas
stop routing; once a scrape and an evaluation of each group have seen them still, every router and line's
recordings are compared with compute_stats of the replicas' windows summed (each replica's KL from the fleet, the
Jensen-Shannon divergence included).

Printed per layout: series per replica and in the Prometheus, bytes per scrape, each group's evaluation time
(median of the rounds) against its interval and against the exported one (below 0.5: within half of it, the
goal), missed iterations, rules in error, samples read per evaluation (per replica and line), head series,
Prometheus' RSS, the cores each side used, the load average of this shared machine, the largest difference from
compute_stats, and the outlier replica's KL against its peers'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.server_overhead import wait_answering
from harness.simulated_fleet import (
    DEEPSEEK_V3,
    Feeder,
    Replica,
    build_replicas,
    expected,
    read_budget,
    samples_per_evaluation,
    serving,
)
from harness.support import end_process, free_port
from mla_watch import cli
from mla_watch.alerting.durations import format_duration
from mla_watch.alerting.fleet import (
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_OUTLIER_INTERVAL_SECONDS,
    FLEET_DEAD_SLOTS,
    FLEET_ENTROPY_BITS,
    FLEET_GROUP_NAME,
    FLEET_JS_DIVERGENCE,
    FLEET_MAX_VIOLATION,
    FLEET_MIN_TOKENS,
    FLEET_NORMALIZED_ENTROPY,
    FLEET_REPLICAS,
    FLEET_SLOTS,
    FLEET_TOKENS,
    REPLICA_GROUP_NAME,
    REPLICA_KL_BITS,
)
from mla_watch.routing.series import BUSINESS_LINE, INSTANCE, ROUTER
from mla_watch.routing.shards import SHARD_COUNTS, RouterShard
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS
from mla_watch.server.metrics import SHARD_PARAM

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_RULES = ROOT / "mla_watch" / "shipped" / "rules"
DEFAULT_LAYOUTS = ("10x1", "10x4", "100x4/10")
LAYOUT = re.compile(r"(\d+)x(\d+)(?:/(\d+))?")
MAX_REPLICAS = 200
MAX_LINES = 8
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Layout:
    replicas: int
    lines: int
    shards: int = 1

    @property
    def name(self) -> str:
        return f"{self.replicas}x{self.lines}" + (f"/{self.shards}" if self.shards > 1 else "")


def layout(text: str) -> Layout:
    found = LAYOUT.fullmatch(text)
    shards = int(found.group(3) or 1) if found else 0
    if (
        found is None
        or not 1 <= int(found.group(1)) <= MAX_REPLICAS
        or not 1 <= int(found.group(2)) <= MAX_LINES
        or shards not in SHARD_COUNTS
    ):
        raise argparse.ArgumentTypeError(
            f"--layouts {text!r}: expected REPLICASxLINES[/SHARDS], replicas 1 to "
            f"{MAX_REPLICAS}, lines 1 to {MAX_LINES}, shards a divisor of 100 (e.g. "
            "10x4, or 100x4/10)"
        )
    return Layout(int(found.group(1)), int(found.group(2)), shards)


def bounded(kind: Callable[[str], Any], flag: str, low: float, high: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a number from {low:g} to {high:g}")
        return value

    return parse


# -- Prometheus ----------------------------------------------------------------------------------------------------


def export_rules(path: Path, shards: int, interval: float, outlier_interval: float) -> None:
    """The shipped rules with --fleet, written through the CLI as an operator would."""
    code = cli.main(
        [
            "rules",
            "export",
            "--rules",
            str(SHIPPED_RULES),
            "--fleet",
            "--fleet-shards",
            str(shards),
            "--fleet-interval",
            format_duration(interval),
            "--outlier-interval",
            format_duration(outlier_interval),
            "--out",
            str(path),
        ]
    )
    if code != 0:
        raise SystemExit(f"mla-watch rules export --fleet exited {code}")


@contextlib.contextmanager
def running_prometheus(
    binary: str, workdir: Path, rules: Path, targets: list[str], scrape_seconds: float, shard: RouterShard | None
) -> Iterator[str]:
    port = free_port()
    job: dict[str, Any] = {"job_name": "mla_watch", "static_configs": [{"targets": targets}]}
    if shard is not None:
        job["params"] = {SHARD_PARAM: [str(shard)]}
    config = {
        "global": {"scrape_interval": f"{scrape_seconds:g}s", "scrape_timeout": f"{scrape_seconds:g}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [job],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = workdir / "prometheus.log"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=extra-scrape-metrics",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
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
        self.http = httpx.Client(timeout=300)

    def query(self, query: str, **params: Any) -> dict[str, Any]:
        answer = self.http.get(self.url + "/api/v1/query", params={"query": query, **params}).json()
        if answer.get("status") != "success":
            raise SystemExit(f"query {query[:200]!r} failed: {str(answer)[:500]}")
        return answer["data"]

    def vector(self, query: str) -> list[dict[str, Any]]:
        return self.query(query)["result"]

    def by_pair(self, name: str, *more: str) -> dict[tuple[str, ...], float]:
        return {
            (s["metric"][ROUTER], s["metric"][BUSINESS_LINE], *(s["metric"][k] for k in more)): float(s["value"][1])
            for s in self.vector(name)
        }

    def own_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
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
        return sum(1 for target in answer["data"]["activeTargets"] if target["health"] == "up")


class CpuSampler(threading.Thread):
    """Prometheus' CPU seconds (process_cpu_seconds_total), read every second: what one evaluation cost it is the
    CPU it used between the evaluation's start and end, which on cores of its own would be about its wall time
    (one goroutine evaluates a group; the garbage collector's work counts in too, and so do scrapes meanwhile)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self._http = httpx.Client(timeout=10)
        self._url = url
        self._stopping = threading.Event()
        self.readings: list[tuple[float, float]] = []

    def run(self) -> None:
        while not self._stopping.wait(1.0):
            with contextlib.suppress(httpx.HTTPError):
                text = self._http.get(self._url + "/metrics").text
                found = re.search(r"^process_cpu_seconds_total (\S+)$", text, re.MULTILINE)
                if found:
                    self.readings.append((time.time(), float(found.group(1))))

    def stop(self) -> None:
        self._stopping.set()
        self.join(15)

    def used(self, start: float, end: float) -> float | None:
        """CPU seconds between two instants (wall clock), interpolated between the readings around them."""

        def at(when: float) -> float | None:
            before = [r for r in self.readings if r[0] <= when]
            after = [r for r in self.readings if r[0] >= when]
            if not before or not after:
                return None
            (t0, c0), (t1, c1) = before[-1], after[0]
            return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)

        first, last = at(start), at(end)
        return None if first is None or last is None else last - first


def evaluated_at(group: dict[str, Any]) -> float:
    """When the group's last whole evaluation began, in seconds since the epoch."""
    stamp = re.sub(r"(\.\d{6})\d+", r"\1", group["lastEvaluation"]).replace("Z", "+00:00")  # Go's nanoseconds
    return datetime.fromisoformat(stamp).timestamp()


def single(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    [(_, value)] = samples[name]
    return value


def group_total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, group: str) -> float:
    return sum(value for labels, value in samples.get(name, []) if labels.get("rule_group", "").endswith(";" + group))


# -- the measurement -----------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, chosen: Layout, workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    if args.shard is not None and args.shard >= chosen.shards > 1:
        raise SystemExit(f"--shard {args.shard}: expected 0 to {chosen.shards - 1} for layout {chosen.name}")
    first = DEEPSEEK_V3.first_layer
    shard = (
        None
        if chosen.shards == 1
        else RouterShard(first % chosen.shards if args.shard is None else args.shard, chosen.shards)
    )
    names = [
        name if shard is None else f"{name}_{shard.index}_of_{shard.count}"
        for name in (FLEET_GROUP_NAME, REPLICA_GROUP_NAME)
    ]
    intervals = {names[0]: args.fleet_interval, names[1]: args.outlier_interval}
    exported = {names[0]: DEFAULT_INTERVAL_SECONDS, names[1]: DEFAULT_OUTLIER_INTERVAL_SECONDS}
    rules = workdir / "fleet.rules.yml"
    export_rules(rules, chosen.shards, args.fleet_interval, args.outlier_interval)
    load_before = os.getloadavg()
    built = time.monotonic()
    replicas = build_replicas(chosen.replicas, DEEPSEEK_V3, chosen.lines, args.tokens, rng, shard=shard)
    infos = replicas[0].windows.routers
    query = "" if shard is None else f"{SHARD_PARAM}={shard}"
    rendered = time.monotonic()
    for replica in replicas:
        replica.render(query)
    render_s = time.monotonic() - rendered
    print(f"  {chosen.replicas} replicas built in {rendered - built:.0f} s, rendered in {render_s:.1f} s", flush=True)
    feeder = Feeder(replicas, infos, args.tokens, args.seed + 1, args.scrape_interval, query)
    started = time.monotonic()
    deadline = started + args.max_seconds
    with (
        serving(replicas) as targets,
        running_prometheus(args.prometheus, workdir, rules, targets, args.scrape_interval, shard) as url,
    ):
        prometheus = PrometheusClient(url)
        while prometheus.targets_up() < chosen.replicas:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {prometheus.targets_up()} of {chosen.replicas} targets up")
            time.sleep(1)
        feeder.start()
        sampler = CpuSampler(url)
        sampler.start()
        try:
            up_at = time.time()
            print(
                f"  {chosen.replicas} targets up {time.monotonic() - started:.0f} s after start; "
                f"measuring {args.rounds} round(s) of {', '.join(names)} after {args.warmup_rounds} warm-up "
                f"round(s)",
                flush=True,
            )
            rounds = watch_rounds(prometheus, names, intervals, up_at, args, deadline)
            time.sleep(2)  # a reading after the last evaluation's end
            for found in rounds.values():
                for round_ in found:
                    round_["cpu_s"] = sampler.used(round_["start"], round_["start"] + round_["s"])
            samples = prometheus.own_metrics()
            per_evaluation = samples_per_evaluation(url, names)
        finally:
            feeder.stop()
            sampler.stop()
        figures = read_figures(prometheus, samples, chosen, shard, names, intervals, exported, rounds, replicas)
        figures["samples_per_evaluation"] = per_evaluation
        figures["samples_budget"] = dict(
            zip(
                names, read_budget(chosen.replicas, figures["routers"] * chosen.lines, DEEPSEEK_V3.experts), strict=True
            )
        )
        figures["feed_round_s"] = statistics.median(feeder.rounds) if feeder.rounds else None
        figures["render_s"] = render_s
        figures["exactness"] = check_exactness(prometheus, replicas, shard, names, deadline)
    figures["load_average"] = [load_before[0], os.getloadavg()[0]]
    figures["wall_s"] = time.monotonic() - started
    return figures


def watch_rounds(
    prometheus: PrometheusClient,
    names: list[str],
    intervals: dict[str, float],
    up_at: float,
    args: argparse.Namespace,
    deadline: float,
) -> dict[str, list[dict[str, Any]]]:
    """Each group's evaluations that began after the warm-up, until --rounds of each: its evaluation time and every
    rule's; Prometheus' RSS and CPU seconds when it was read. Stops at a rule in error."""
    measure_from = {name: up_at + args.scrape_interval + args.warmup_rounds * intervals[name] for name in names}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    wanted = dict(zip(names, (args.rounds, args.replica_rounds), strict=True))
    seen: set[tuple[str, str]] = set()
    while any(len(found) < wanted[name] for name, found in rounds.items()):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"{ {name: len(found) for name, found in rounds.items()} } of {wanted} measured "
                f"rounds within --max-seconds {args.max_seconds:g}: raise it, or lower --rounds"
            )
        time.sleep(2)
        groups = prometheus.rule_groups()
        for name in names:
            group = groups[name]
            if (
                evaluated_at(group) < measure_from[name]
                or (name, group["lastEvaluation"]) in seen
                or len(rounds[name]) >= wanted[name]
            ):
                continue
            seen.add((name, group["lastEvaluation"]))
            failed = [rule for rule in group["rules"] if rule.get("health") != "ok" or rule.get("lastError")]
            if failed:  # a recording that fails records nothing, and every rule after it reads nothing new
                raise SystemExit(
                    f"rules of {name} in error: "
                    + "; ".join(
                        f"{rule['name']}: {rule.get('lastError')} after {float(rule['evaluationTime']):.1f} s"
                        for rule in failed
                    )
                )
            own = prometheus.own_metrics()
            rounds[name].append(
                {
                    "s": float(group["evaluationTime"]),
                    "start": evaluated_at(group),
                    "rules": {rule["name"]: float(rule["evaluationTime"]) for rule in group["rules"]},
                    "rss": single(own, "process_resident_memory_bytes"),
                    "cpu": single(own, "process_cpu_seconds_total"),
                    "at": time.monotonic(),
                    "process_cpu": time.process_time(),
                }
            )
            print(
                f"  {name} round {len(rounds[name])}: {group['evaluationTime']:.2f} s of its "
                f"{intervals[name]:g} s interval (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    return rounds


def read_figures(
    prometheus: PrometheusClient,
    samples: dict[str, list[tuple[dict[str, str], float]]],
    chosen: Layout,
    shard: RouterShard | None,
    names: list[str],
    intervals: dict[str, float],
    exported: dict[str, float],
    rounds: dict[str, list[dict[str, Any]]],
    replicas: list[Replica],
) -> dict[str, Any]:
    scraped = [float(s["value"][1]) for s in prometheus.vector('scrape_samples_scraped{job="mla_watch"}')]
    body = [float(s["value"][1]) for s in prometheus.vector('scrape_body_size_bytes{job="mla_watch"}')]
    duration = [float(s["value"][1]) for s in prometheus.vector('scrape_duration_seconds{job="mla_watch"}')]
    every = [round_ for found in rounds.values() for round_ in found]
    first, last = min(every, key=lambda r: r["at"]), max(every, key=lambda r: r["at"])
    wall = last["at"] - first["at"]
    groups: dict[str, Any] = {}
    for name in names:
        times = [r["s"] for r in rounds[name]]
        per_rule = {
            rule: statistics.median(r["rules"][rule] for r in rounds[name]) for rule in rounds[name][0]["rules"]
        }
        cpu = [r["cpu_s"] for r in rounds[name] if r.get("cpu_s") is not None]
        groups[name] = {
            "evaluation_s": statistics.median(times),
            "evaluation_s_rounds": times,
            "cpu_s": statistics.median(cpu) if cpu else None,
            "cpu_s_rounds": cpu,
            "interval_s": intervals[name],
            "exported_interval_s": exported[name],
            "ratio": statistics.median(times) / intervals[name],
            "ratio_exported": statistics.median(times) / exported[name],
            "iterations": group_total(samples, "prometheus_rule_group_iterations_total", name),
            "missed": group_total(samples, "prometheus_rule_group_iterations_missed_total", name),
            "failures": group_total(samples, "prometheus_rule_evaluation_failures_total", name),
            "slowest_rules_s": dict(sorted(per_rule.items(), key=lambda item: -item[1])[:3]),
        }
    routers = DEEPSEEK_V3.routers if shard is None else sum(shard.holds(info.layer) for info in DEEPSEEK_V3.infos())
    return {
        "layout": chosen.name,
        "replicas": chosen.replicas,
        "lines": chosen.lines,
        "shards": chosen.shards,
        "shard": None if shard is None else str(shard),
        "routers": routers,
        "per_expert_series": chosen.replicas * chosen.lines * routers * (DEEPSEEK_V3.experts + 1),
        "series_per_replica": statistics.median(scraped),
        "series_scraped": sum(scraped),
        "bytes_per_scrape_per_replica": statistics.median(body) if body else None,
        "scrape_s_median": statistics.median(duration),
        "scrape_s_max": max(duration),
        "groups": groups,
        "head_series": single(samples, "prometheus_tsdb_head_series"),
        "prometheus_rss_bytes_max": max(r["rss"] for r in every),
        "prometheus_cores": (last["cpu"] - first["cpu"]) / wall if wall > 0 else None,
        "bench_cores": (last["process_cpu"] - first["process_cpu"]) / wall if wall > 0 else None,
        "cut_off_scrapes": sum(replica.cut_off for replica in replicas),
    }


def check_exactness(
    prometheus: PrometheusClient, replicas: list[Replica], shard: RouterShard | None, names: list[str], deadline: float
) -> dict[str, Any]:
    """With the replicas' windows still: once every replica is scraped and each group has evaluated after that, the
    largest difference of every recording from compute_stats of the windows summed."""
    want = expected(replicas, shard)
    # A scrape that began after the windows stopped reads them as they stay (the tokens alone cannot tell: a full
    # window holds as many whatever it holds).
    stopped = time.time()
    while min(float(s["value"][1]) for s in prometheus.vector('timestamp(up{job="mla_watch"})')) <= stopped:
        if time.monotonic() > deadline:
            raise SystemExit("no scrape of every replica after their windows stood still")
        time.sleep(2)
    still = time.time()
    while min(evaluated_at(prometheus.rule_groups()[name]) for name in names) <= still:
        if time.monotonic() > deadline:
            raise SystemExit("no evaluation of the fleet groups after the replicas' windows stood still")
        time.sleep(2)
    got = {
        name: prometheus.by_pair(name)
        for name in (
            FLEET_ENTROPY_BITS,
            FLEET_NORMALIZED_ENTROPY,
            FLEET_MAX_VIOLATION,
            FLEET_JS_DIVERGENCE,
            FLEET_DEAD_SLOTS,
            FLEET_SLOTS,
            FLEET_MIN_TOKENS,
            FLEET_REPLICAS,
            FLEET_TOKENS,
        )
    }
    kl = prometheus.by_pair(REPLICA_KL_BITS, INSTANCE)
    worst = 0.0
    off: list[str] = []
    for key, found in want.items():
        stats = found.stats
        wanted = {
            FLEET_ENTROPY_BITS: stats.entropy_bits,
            FLEET_NORMALIZED_ENTROPY: stats.normalized_entropy,
            FLEET_MAX_VIOLATION: stats.max_violation,
            FLEET_JS_DIVERGENCE: found.jsd_bits,
        }
        for name, value in wanted.items():
            difference = abs(got[name].get(key, math.inf) - value)
            worst = max(worst, difference)
            if difference > TOLERANCE:
                off.append(f"{name}{key}: {got[name].get(key)} against {value}")
        for target, value in found.kl_bits.items():
            difference = abs(kl.get((*key, target), math.inf) - value)
            worst = max(worst, difference)
            if difference > TOLERANCE:
                off.append(f"{REPLICA_KL_BITS}{key} of {target}: {kl.get((*key, target))} against {value}")
        for name, value in (
            (FLEET_DEAD_SLOTS, stats.dead_slots),
            (FLEET_SLOTS, stats.num_slots),
            (FLEET_MIN_TOKENS, stats.min_tokens),
            (FLEET_REPLICAS, len(found.kl_bits)),
            (FLEET_TOKENS, stats.tokens),
        ):
            if got[name].get(key) != value:
                off.append(f"{name}{key}: {got[name].get(key)} against {value}")
    if off:
        raise SystemExit(
            f"{len(off)} recordings differ from compute_stats of the windows summed, by up to "
            f"{worst:.3g}; the first: " + "; ".join(off[:5])
        )
    router, line = replicas[0].windows.routers[0].name, "line_0"
    peers = [kl[(router, line, r.target)] for r in replicas[:-1] if (router, line, r.target) in kl]
    return {
        "pairs": len(want),
        "kl_series": len(kl),
        "max_difference": worst,
        "skewed_kl_bits": kl.get((router, line, replicas[-1].target)),
        "peer_kl_bits_median": statistics.median(peers) if peers else None,
    }


# -- the report ----------------------------------------------------------------------------------------------------


def report(f: dict[str, Any]) -> None:
    mib = 2**20
    where = f"one shard ({f['shard']}, {f['routers']} of {DEEPSEEK_V3.routers} routers) of " if f["shard"] else ""
    print(
        f"\n{where}{f['replicas']} replicas x {f['lines']} line(s) of DeepSeek-V3: {f['per_expert_series']:,} "
        f"per-expert series in this Prometheus"
    )
    print(
        f"  series per replica scraped: {f['series_per_replica']:,.0f}; in all {f['series_scraped']:,.0f}; "
        f"{(f['bytes_per_scrape_per_replica'] or 0) / mib:.2f} MiB per scrape per replica; scrape median "
        f"{f['scrape_s_median'] * 1e3:.0f} ms, slowest {f['scrape_s_max'] * 1e3:.0f} ms"
    )
    for name, g in f["groups"].items():
        per, budget = f["samples_per_evaluation"][name], f["samples_budget"][name]
        each = ", ".join(f"{s:.2f}" for s in g["evaluation_s_rounds"])
        print(
            f"  {name}: median {g['evaluation_s']:.2f} s per evaluation ({each}) "
            f"= x{g['ratio']:.3f} of its {g['interval_s']:g} s interval here, x{g['ratio_exported']:.3f} of the "
            f"exported {g['exported_interval_s']:g} s; {g['missed']:.0f} of {g['iterations']:.0f} iterations "
            f"missed, {g['failures']:.0f} failures; {per:,} samples read per evaluation "
            f"({per / f['per_expert_series']:.2f} per per-expert series; x{per / budget:.3f} of the budget)"
        )
        if g["cpu_s"] is not None:
            cpu_each = ", ".join(f"{s:.2f}" for s in g["cpu_s_rounds"])
            print(
                f"    Prometheus' CPU during an evaluation: median {g['cpu_s']:.2f} s ({cpu_each}) = "
                f"x{g['cpu_s'] / g['exported_interval_s']:.3f} of the exported interval"
            )
        print("    slowest rules: " + ", ".join(f"{rule} {s:.2f} s" for rule, s in g["slowest_rules_s"].items()))
    print(
        f"  Prometheus: {f['head_series']:,.0f} head series, RSS up to {f['prometheus_rss_bytes_max'] / mib:,.0f} "
        f"MiB, {f['prometheus_cores']:.2f} cores while measuring; the simulated replicas {f['bench_cores']:.2f} "
        f"cores (a round of feeding and rendering {f['feed_round_s'] or 0:.1f} s); load average "
        f"{f['load_average'][0]:.1f} before, {f['load_average'][1]:.1f} after; {f['cut_off_scrapes']} scrapes "
        "cut off"
    )
    e = f["exactness"]
    print(
        f"  exact: {e['pairs']} router-lines and {e['kl_series']} replica KLs equal compute_stats of the windows "
        f"summed within {e['max_difference']:.1e}; the skewed replica's KL {e['skewed_kl_bits']:.3f} bits, its "
        f"peers' median {e['peer_kl_bits_median']:.4f}"
    )


def wait_quiet(load: float, longest: float) -> float:
    """Seconds waited until the 1-minute load average is at most ``load`` (at most ``longest``)."""
    started = time.monotonic()
    while os.getloadavg()[0] > load and time.monotonic() - started < longest:
        time.sleep(10)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--layouts",
        type=layout,
        nargs="+",
        default=[layout(text) for text in DEFAULT_LAYOUTS],
        help=f"REPLICASxLINES[/SHARDS] to run, one after the other (default {' '.join(DEFAULT_LAYOUTS)})",
    )
    parser.add_argument(
        "--shard",
        type=bounded(int, "--shard", 0, 99),
        default=None,
        help="which shard of a split layout to run (default: the first MoE layer's)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=bounded(float, "--scrape-interval", 5, 120),
        default=15.0,
        help="Prometheus' scrape interval and the replicas' feeding period, seconds (default 15)",
    )
    parser.add_argument(
        "--fleet-interval",
        type=bounded(float, "--fleet-interval", 5, 3600),
        default=DEFAULT_INTERVAL_SECONDS,
        help="the fleet group's interval, seconds (rules export --fleet-interval; default the exported "
        f"{DEFAULT_INTERVAL_SECONDS:g})",
    )
    parser.add_argument(
        "--outlier-interval",
        type=bounded(float, "--outlier-interval", 5, 3600),
        default=120.0,
        help="the replica group's interval here, seconds (rules export --outlier-interval; default "
        "120: the exported 300 s measured more often, so that it meets the fleet group more)",
    )
    parser.add_argument(
        "--tokens",
        type=bounded(int, "--tokens", 1, 10**6),
        default=DEFAULT_WINDOW_TOKENS // 2,
        help="tokens added per router, line and replica every feeding (default 2048: the window of 4096 holds two)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=bounded(int, "--warmup-rounds", 0, 20),
        default=1,
        help="evaluations of each group after the targets are up, before measuring (default 1)",
    )
    parser.add_argument(
        "--rounds",
        type=bounded(int, "--rounds", 1, 100),
        default=3,
        help="evaluations of the fleet group measured (default 3)",
    )
    parser.add_argument(
        "--replica-rounds",
        type=bounded(int, "--replica-rounds", 1, 100),
        default=2,
        help="evaluations of the replica group measured (default 2)",
    )
    parser.add_argument(
        "--quiet-load",
        type=bounded(float, "--quiet-load", 0.1, 100),
        default=3.0,
        help="before each layout, wait until this machine's 1-minute load average is at most this "
        "(it is shared; default 3.0), up to --quiet-wait seconds",
    )
    parser.add_argument(
        "--quiet-wait",
        type=bounded(float, "--quiet-wait", 0, 7200),
        default=900.0,
        help="the longest wait for --quiet-load, seconds (default 900; then it runs anyway)",
    )
    parser.add_argument(
        "--max-seconds",
        type=bounded(float, "--max-seconds", 60, 7200),
        default=1200.0,
        help="give up on a layout after this long (default 1200)",
    )
    parser.add_argument("--prometheus", default=shutil.which("prometheus"), help="the Prometheus binary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    if not args.prometheus:
        parser.error("--prometheus: no prometheus binary on PATH; expected the path to one (Prometheus 2.x)")

    # Stopped, it stops its Prometheus first (a background job of a shell ignores SIGINT).
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    command = " ".join(["python -m bench.fleet_rules", *sys.argv[1:]])
    print(command, flush=True)
    figures: dict[str, Any] = {"command": command, "layouts": {}}
    for chosen in args.layouts:
        waited = wait_quiet(args.quiet_load, args.quiet_wait)
        print(
            f"\nlayout {chosen.name} (waited {waited:.0f} s for a load average of {os.getloadavg()[0]:.1f})", flush=True
        )
        with tempfile.TemporaryDirectory(prefix="mla-watch-fleet-bench-") as workdir:
            found = measure(args, chosen, Path(workdir))
        figures["layouts"][chosen.name] = found
        report(found)
        if args.json:  # after each layout: a later one that fails keeps the earlier figures
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
