"""The cost of per-expert window counts (serve --export-expert-counts) at DeepSeek-V3 scale, per replica and fleet.

    python -m bench.expert_series                       # 58 routers x 256 experts, top-8; 1 and 4 lines
    python -m bench.expert_series --lines 1 2 8 --rounds 50
    python -m bench.expert_series --json figures.json

No model: RouterWindows with DeepSeek-V3's geometry are fed random counts (``--tokens`` per line: the default
window's 4096 tokens; more carry the digits of a longer window). For each number of business lines, two
registries of the sidecar's metrics over the same windows - per-expert counts off, and on (every router and
line, with a budget that fits them) - are scraped as /metrics writes them (mla_watch.server.exposition) in
alternation, with prometheus_client.generate_latest of the second for comparison; the
routing snapshot is computed once beforehand, as the sidecar caches it between count changes. Printed per
replica: series, bytes per scrape (plain, and gzip as a compressing hop would send them), median scrape time
of each arm and their ratio; then the fleet cost for 10 and 100 replicas derived from those figures, against
Mimir's default limit of 150,000 series per tenant (-ingester.max-global-series-per-user).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mla_watch.routing.routers import CountDelta, RouterInfo
from mla_watch.routing.series import EXPERT_WINDOW_SELECTIONS, EXPERT_WINDOW_TOKENS
from mla_watch.routing.windows import DEFAULT_WINDOW_TOKENS, RouterWindows, take_snapshot
from mla_watch.server.expert_counts import DEFAULT_EXPERT_SERIES_BUDGET, ExpertSelection
from mla_watch.server.exposition import exposition
from mla_watch.server.metrics import ServerMetrics

MIMIR_SERIES_PER_TENANT = 150_000  # Mimir's default -ingester.max-global-series-per-user
FIRST_MOE_LAYER = 3  # DeepSeek-V3: layers 0-2 are dense


def build_windows(
    routers: int, experts: int, top_k: int, lines: int, tokens: int, rng: np.random.Generator
) -> RouterWindows:
    infos = [
        RouterInfo(f"model.layers.{layer}.mlp.gate", layer, "expert", experts, top_k)
        for layer in range(FIRST_MOE_LAYER, FIRST_MOE_LAYER + routers)
    ]
    windows = RouterWindows(infos)
    for line in range(lines):
        for info in infos:
            # Skewed loads, a few experts never chosen: what a real router's counters hold.
            weights = rng.dirichlet(np.full(experts, 2.0))
            weights[rng.choice(experts, size=3, replace=False)] = 0.0
            counts = rng.multinomial(tokens * top_k, weights / weights.sum())
            windows.add(info.name, f"line_{line}", CountDelta(counts.astype(np.int64), tokens))
    return windows


def series_of(body: bytes) -> int:
    return sum(len(family.samples) for family in text_string_to_metric_families(body.decode()))


def expert_series_of(body: bytes) -> int:
    return sum(
        len(family.samples)
        for family in text_string_to_metric_families(body.decode())
        if family.name in (EXPERT_WINDOW_SELECTIONS, EXPERT_WINDOW_TOKENS)
    )


def measure(windows: RouterWindows, rounds: int, budget: int) -> dict[str, float]:
    snapshot = take_snapshot([windows], time.monotonic())
    off = CollectorRegistry()
    ServerMetrics(off, lambda: snapshot)
    on = CollectorRegistry()
    metrics = ServerMetrics(on, lambda: snapshot, expert_counts=ExpertSelection(), expert_series_budget=budget)
    bodies = {"off": exposition(off), "on": exposition(on)}  # also the warm-up: admission happens here
    times: dict[str, list[float]] = {"off": [], "on": [], "client": []}
    for index in range(rounds):
        for arm in ("off", "on", "client") if index % 2 == 0 else ("client", "on", "off"):
            tick = time.perf_counter()
            if arm == "client":
                generate_latest(on)  # prometheus_client writing every family itself, as /metrics once did
            else:
                exposition(off if arm == "off" else on)
            times[arm].append(time.perf_counter() - tick)
    counts = metrics.expert_counts
    assert counts is not None
    tick = time.perf_counter()
    for _ in range(rounds):
        counts.families(snapshot.records)  # the families built; the rest of a scrape is prometheus_client's text
    collect_ms = (time.perf_counter() - tick) / rounds * 1e3
    ratios = [on_s / off_s for on_s, off_s in zip(times["on"], times["off"], strict=True)]
    return {
        "series_off": series_of(bodies["off"]),
        "series_on": series_of(bodies["on"]),
        "expert_series": expert_series_of(bodies["on"]),
        "bytes_off": len(bodies["off"]),
        "bytes_on": len(bodies["on"]),
        "gzip_bytes_off": len(gzip.compress(bodies["off"], 6)),
        "gzip_bytes_on": len(gzip.compress(bodies["on"], 6)),
        "scrape_ms_off": statistics.median(times["off"]) * 1e3,
        "scrape_ms_on": statistics.median(times["on"]) * 1e3,
        "scrape_ratio": statistics.median(ratios),
        "collect_ms": collect_ms,
        "scrape_ms_client": statistics.median(times["client"]) * 1e3,
        "scrape_ratio_q1": float(np.percentile(ratios, 25)),
        "scrape_ratio_q3": float(np.percentile(ratios, 75)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", type=int, default=58, help="MoE routers (DeepSeek-V3: 58)")
    parser.add_argument("--experts", type=int, default=256, help="experts per router (DeepSeek-V3: 256)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (DeepSeek-V3: 8)")
    parser.add_argument("--lines", type=int, nargs="+", default=[1, 4], help="business lines to measure")
    parser.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_WINDOW_TOKENS,
        help="tokens in each router and line's window (default: the sidecar's default window)",
    )
    parser.add_argument("--rounds", type=int, default=30, help="scrapes of each arm, alternating")
    parser.add_argument("--replicas", type=int, nargs="+", default=[10, 100], help="fleet sizes to derive")
    parser.add_argument("--scrape-interval", type=float, default=15.0, help="seconds between scrapes")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    pair = args.experts + 1
    print(
        f"{args.routers} routers x {args.experts} experts (top-{args.top_k}): {pair} series per router and line; "
        f"default budget {DEFAULT_EXPERT_SERIES_BUDGET:,} admits {DEFAULT_EXPERT_SERIES_BUDGET // pair} "
        f"router-lines ({DEFAULT_EXPERT_SERIES_BUDGET // (pair * args.routers)} whole line(s))"
    )
    figures: dict[str, dict[str, float]] = {}
    for lines in args.lines:
        windows = build_windows(args.routers, args.experts, args.top_k, lines, args.tokens, rng)
        budget = max(DEFAULT_EXPERT_SERIES_BUDGET, pair * args.routers * lines)  # every pair admitted
        row = measure(windows, args.rounds, budget)
        row["budget"] = budget
        figures[f"{lines}_lines"] = row
        print(f"\n{lines} line(s), budget {budget:,}:")
        print(
            f"  series per replica: {row['series_off']:,} off, {row['series_on']:,} on "
            f"(+{row['expert_series']:,} per-expert)"
        )
        print(
            f"  bytes per scrape: {row['bytes_off']:,} off, {row['bytes_on']:,} on "
            f"(x{row['bytes_on'] / row['bytes_off']:.1f}); gzip {row['gzip_bytes_off']:,} off, "
            f"{row['gzip_bytes_on']:,} on"
        )
        print(
            f"  scrape time (median of {args.rounds}): {row['scrape_ms_off']:.1f} ms off, "
            f"{row['scrape_ms_on']:.1f} ms on: ratio x{row['scrape_ratio']:.2f} "
            f"(quartiles x{row['scrape_ratio_q1']:.2f}-x{row['scrape_ratio_q3']:.2f}); "
            f"the per-expert families built {row['collect_ms']:.1f} ms; prometheus_client writing them itself "
            f"{row['scrape_ms_client']:.1f} ms"
        )
        for replicas in args.replicas:
            series = row["series_on"] * replicas
            added = row["expert_series"] * replicas
            print(
                f"  fleet of {replicas}: {series:,.0f} series ({added:,.0f} per-expert) = "
                f"{series / MIMIR_SERIES_PER_TENANT:.2f}x Mimir's {MIMIR_SERIES_PER_TENANT:,} per tenant; "
                f"{row['bytes_on'] * replicas / 2**20:.1f} MiB plain / {row['gzip_bytes_on'] * replicas / 2**20:.1f} "
                f"MiB gzip per {args.scrape_interval:g} s scrape interval "
                f"({series / args.scrape_interval:,.0f} samples/s)"
            )
            row[f"fleet_{replicas}_series"] = series
            row[f"fleet_{replicas}_bytes"] = row["bytes_on"] * replicas
            row[f"fleet_{replicas}_gzip_bytes"] = row["gzip_bytes_on"] * replicas
            row[f"fleet_{replicas}_mimir_share"] = series / MIMIR_SERIES_PER_TENANT
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
