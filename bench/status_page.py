"""What the status page costs: the history's memory and payload, and serving while a page polls.

    python -m bench.status_page                 # about two minutes on 2 CPU cores
    python -m bench.status_page --rounds 6 --json figures.json

* **History at DeepSeek-V3.2 scale**: 58 expert routers and 61 indexers, 4 business lines plus
  their sum, one hour at the default 10 s (360 points): the memory the live hour holds without a
  durable history (``--history-retention 0``: a store in memory; with one, the hour is the durable
  store's ``full`` tier, whose bytes are given too), the time to build ``/v1/status``'s history
  and its JSON size, and the size of an incremental reply (``since`` the last point, what an open
  page fetches every 5 s), as a ratio of the full one.
* **One history sample** on the bundled model's live windows (every router, every line): its
  time, and the share of one core it takes at the default 10 s interval.
* **Serving while a page polls**: one ``mla-watch serve`` process with ``--history-interval 1``;
  16-token completions, sequentially, in alternating rounds with and without a client polling
  ``/v1/status`` every second (five times the page's default); tokens/s with / without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import httpx

from bench.server_overhead import sidecar_process
from mla_watch.history.store import HISTORY_FILE, HistoryStore
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import RoutingStats
from mla_watch.routing.windows import RouterStats

LINES = ("customer_service", "code_assistant", "sql", "doc_summary")


def v3_records(rng: random.Random) -> list[RouterStats]:
    routers = [(RouterInfo(f"model.layers.{i}.mlp.gate", i, "expert", 256, 8), 3.0, 8.0) for i in range(3, 61)]
    routers += [
        (RouterInfo(f"model.layers.{i}.self_attn.indexer", i, "indexer", 131072, 2048), 11.0, 17.0) for i in range(61)
    ]
    records = []
    for line in (*LINES, None):
        for info, floor, ceiling in routers:
            bits = rng.uniform(floor + 1, ceiling)
            stats = RoutingStats(
                kind=info.kind,
                num_slots=2 ** int(ceiling),
                top_k=info.top_k,
                tokens=4096,
                selections=4096 * info.top_k,
                entropy_bits=bits,
                floor_bits=floor,
                ceiling_bits=ceiling,
                normalized_entropy=(bits - floor) / (ceiling - floor),
                max_violation=1.0,
                dead_slots=0,
                js_divergence=None,
                locality=None,
                min_tokens=1024,
                too_small=False,
            )
            records.append(RouterStats(info, line, stats))
    return records


def history_figures() -> dict:
    rng = random.Random(7)
    now = [1_800_000_000.0]
    history = HistoryStore(None, span_seconds=3600, interval_seconds=10, clock=lambda: now[0])
    batches = [v3_records(rng) for _ in range(8)]
    tracemalloc.start()
    for point in range(360):
        now[0] += 10
        history.record(batches[point % len(batches)])
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        full = json.dumps(history.recent())
        times.append(time.perf_counter() - started)
    last = history.recent()["times"][-1]
    now[0] += 10
    history.record(batches[0])
    incremental = json.dumps(history.recent(since=last))
    with tempfile.TemporaryDirectory(prefix="mla-watch-bench-") as state:  # the hour inside the durable store
        durable = HistoryStore(Path(state) / HISTORY_FILE, span_seconds=3600, interval_seconds=10, clock=lambda: now[0])
        durable.record(batches[0])
        full_tier = durable.tiers[0].nbytes()
        durable.close()
    return {
        "series": len(batches[0]),
        "points": len(history.recent()["times"]),
        "memory_mib": memory / 2**20,
        "durable_full_tier_mib": full_tier / 2**20,
        "full_ms": statistics.median(times) * 1000,
        "full_bytes": len(full),
        "incremental_bytes": len(incremental),
        "incremental_ratio": len(incremental) / len(full),
    }


def sample_figures() -> dict:
    from mla_watch.server.app import ServerConfig, Sidecar

    sidecar = Sidecar(
        ServerConfig(
            device="cpu", rules=None, policy_poll_seconds=None, admin_token=None, state_dir=Path(tempfile_dir())
        )
    )
    sidecar.load_model()
    from mla_watch.models import corpus
    from mla_watch.policy.sampling import SamplingParams, generate

    for line, domain in zip(LINES, ("customer_service", "code", "sql", "doc_summary"), strict=True):
        with sidecar.probe.attribute(line):
            for prompt in corpus.prompts(domain, 4, seed=1):
                worker = sidecar.model_worker
                ids = worker.tokenizer(prompt)["input_ids"]
                generate(worker.model, worker.tokenizer, ids, SamplingParams(max_tokens=16, seed=1))
    times = []
    for _ in range(20):
        time.sleep(0.01)  # samples are stamped to the millisecond: a second one in the same millisecond is none
        started = time.perf_counter()
        sidecar.history.record(sidecar.routing_snapshot().records)
        times.append(time.perf_counter() - started)
    sidecar.model_worker.close()
    median = statistics.median(times)
    return {
        "sample_ms": median * 1000,
        "core_share_at_10s": median / 10.0,
        "series": len(sidecar.history.recent()["series"]),
    }


def tempfile_dir() -> str:
    return tempfile.mkdtemp(prefix="mla-watch-bench-")


def serving_figures(rounds: int, requests_per_round: int) -> dict:
    body = {"prompt": "def parse_invoice(", "max_tokens": 16, "temperature": 0.2, "seed": 3}
    headers = {"X-Business-Line": "code_assistant", "X-Task": "code"}
    rates: dict[str, list[float]] = {"polled": [], "alone": []}
    polls = [0]
    polling, done = threading.Event(), threading.Event()
    with sidecar_process("--history-interval", "1", "--state-dir", tempfile_dir()) as (url, _):

        def page() -> None:  # one open page: it keeps asking for the points it has not seen
            since = None
            with httpx.Client(base_url=url, timeout=30) as client:
                while not done.wait(1.0):
                    if not polling.is_set():
                        continue
                    reply = client.get("/v1/status", params={} if since is None else {"since": since}).json()
                    if reply["history"]["times"]:
                        since = reply["history"]["times"][-1]
                    polls[0] += 1

        poller = threading.Thread(target=page, daemon=True)
        poller.start()
        client = httpx.Client(base_url=url, timeout=120)
        for _ in range(3):  # warm-up
            client.post("/v1/completions", json=body, headers=headers)
        for round_index in range(2 * rounds):
            variant = "polled" if round_index % 2 == 0 else "alone"
            (polling.set if variant == "polled" else polling.clear)()
            tokens, started = 0, time.perf_counter()
            for _ in range(requests_per_round):
                reply = client.post("/v1/completions", json=body, headers=headers).json()
                tokens += reply["usage"]["completion_tokens"]
            rates[variant].append(tokens / (time.perf_counter() - started))
        done.set()
        poller.join(10)
        client.close()
    ratios = [p / a for p, a in zip(rates["polled"], rates["alone"], strict=True)]
    return {
        "tokens_per_s_polled": statistics.median(rates["polled"]),
        "tokens_per_s_alone": statistics.median(rates["alone"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
        "polls": polls[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternations of polled / alone (default 4)")
    parser.add_argument("--requests", type=int, default=30, help="16-token requests per round (default 30)")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1:
        parser.error(f"--rounds {args.rounds} and --requests {args.requests}: expected integers >= 1")

    history = history_figures()
    print(
        f"history, DeepSeek-V3.2 scale ({history['series']} series x {history['points']} points): "
        f"{history['memory_mib']:.1f} MiB held without a durable history (with one: its full tier, "
        f"{history['durable_full_tier_mib']:.1f} MiB, nothing more); /v1/status history "
        f"{history['full_bytes'] / 2**20:.2f} MiB "
        f"built in {history['full_ms']:.0f} ms; incremental reply {history['incremental_bytes'] / 1024:.1f} KiB "
        f"= x{history['incremental_ratio']:.4f} of the full one"
    )
    sample = sample_figures()
    print(
        f"one history sample, bundled model ({sample['series']} series): {sample['sample_ms']:.2f} ms "
        f"= {100 * sample['core_share_at_10s']:.3f}% of one core at the default 10 s interval"
    )
    serving = serving_figures(args.rounds, args.requests)
    print(
        f"decode throughput while a page polls /v1/status every 1 s / alone: x{serving['ratio_median']:.3f} median "
        f"(spread {serving['ratio_min']:.3f}-{serving['ratio_max']:.3f}, {serving['rounds']} alternations; "
        f"{serving['tokens_per_s_polled']:.0f} vs {serving['tokens_per_s_alone']:.0f} tokens/s, "
        f"{serving['polls']} polls)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"history": history, "sample": sample, "serving": serving}, indent=2))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
