"""A hostile engine behind ``mla-watch serve``, and a hostile co-tenant of its recorder volume, with ``/healthz``
and the sidecar's memory watched meanwhile.

    python -m bench.engine_attacks                  # about a minute on 2 CPU cores
    python -m bench.engine_attacks --rounds 5 --json figures.json

One ``mla-watch serve --engine vllm`` process on a loopback port, beside harness/hostile_engine.py
(our own server: it sends what no engine should), with ``--upstream-max-bytes 8M`` and
``--request-timeout 3``. Each answer mode of the hostile engine is requested ``--rounds`` times;
then a second sidecar (``--engine sglang --sglang-recorder-dir``) polls a directory into which
hostile recorder dumps are written: a stride-0 tensor declaring 3,000,000 passes, a sparse
tensor, counts whose sum overflows int64, a file still being written, a thousand junk files.
Per attack the bench prints the statuses against the documented ones, ``/healthz`` p99 during
the attack against its p99 at rest (the goal: within 50 ms), and the sidecar's peak RSS growth.
Requests go to 127.0.0.1 only; every attack is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

from bench.server_overhead import sidecar_process
from harness.attacks import HEALTHZ_GOAL_MS, HealthPoller
from harness.hostile_engine import CONFIG, HostileEngine
from harness.support import memory_kib, serve_app

MAX_BYTES = 8 << 20
TIMEOUT = 3.0
# mode -> the statuses documented for it (docs/security.md)
ENGINE_ATTACKS = {
    "gzip_bomb": {502},
    "huge_json": {502},
    "huge_error": {500},
    "html_error": {503},
    "not_json": {502},
    "json_array": {502},
    "lying_npy": {200},
    "all_zero": {200},
    "no_routing": {200},
    "two_choices": {200},
    "drip": {504},
    "endless_line": {200},
    "odd_stream": {200},
    "stream_drip": {200},
}
STREAMED = {"endless_line", "odd_stream", "stream_drip"}
MIN_SECONDS = 1.0  # each attack goes on at least this long
REST_SECONDS = 5.0


def engine_attacks(url: str, pid: int, hostile: HostileEngine, poller: HealthPoller, rounds: int) -> list[dict]:
    reports = []
    with httpx.Client(base_url=url, timeout=60, headers={"X-Business-Line": "code_assistant"}) as client:
        for mode, documented in ENGINE_ATTACKS.items():
            hostile.mode = mode
            statuses: Counter[int] = Counter()
            rss_before, peak = memory_kib(pid), 0
            start, sent = time.monotonic(), 0
            while sent < rounds or time.monotonic() - start < MIN_SECONDS:  # long enough for /healthz polls
                sent += 1
                body = {"prompt": "x", "max_tokens": 4, "stream": mode in STREAMED}
                if mode in STREAMED:
                    with client.stream("POST", "/v1/completions", json=body) as answer:
                        for _ in answer.iter_bytes():
                            peak = max(peak, memory_kib(pid))
                        statuses[answer.status_code] += 1
                else:
                    statuses[client.post("/v1/completions", json=body).status_code] += 1
                peak = max(peak, memory_kib(pid))
            reports.append(report(mode, statuses, documented, poller, start, peak - rss_before))
    return reports


def volume_attacks(directory: Path, url: str, pid: int, poller: HealthPoller, interval: float) -> list[dict]:
    """Hostile dumps written where the recorder reads; each must be set aside, counted as such, once."""
    cases = {
        "stride-0 tensor of 3,000,000 passes": lambda: {
            "logical_count": torch.zeros(1, 4, 16, dtype=torch.int32).expand(3_000_000, 4, 16)
        },
        "sparse logical_count": lambda: {"logical_count": torch.zeros(4, 4, 16, dtype=torch.int32).to_sparse()},
        "int64 sum that overflows": lambda: {"logical_count": torch.full((2, 4, 16), 2**62, dtype=torch.int64)},
    }
    reports = []
    for index, (name, build) in enumerate(cases.items()):
        before, rss_before, start = rejected(url), memory_kib(pid), time.monotonic()
        torch.save(build(), directory / f"expert_distribution_recorder_{1_700_000_000 + index}.0.pt")
        deadline = time.monotonic() + 30 + 4 * interval
        while rejected(url) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3 * interval)  # later polls: set aside once, never counted again
        statuses = Counter({"rejected once": int(rejected(url) - before)})
        reports.append(
            report(name, statuses, {"rejected once"}, poller, start, memory_kib(pid) - rss_before, expect_count=1)
        )
    start, before = time.monotonic(), rejected(url)
    for number in range(1000):
        (directory / f"expert_distribution_recorder_{1_800_000_000 + number}.0.pt").write_bytes(b"junk")
    deadline = time.monotonic() + 60
    while rejected(url) - before < 1000 and time.monotonic() < deadline:
        time.sleep(0.1)
    statuses = Counter({"rejected once": int(rejected(url) - before)})
    reports.append(report("1,000 junk files", statuses, {"rejected once"}, poller, start, 0, expect_count=1000))
    return reports


def at_rest(url: str, poller: HealthPoller) -> float:
    """/healthz p99 over REST_SECONDS after one warm-up request, before any attack."""
    httpx.get(url + "/v1/routing", timeout=60)
    start = time.monotonic()
    time.sleep(REST_SECONDS)
    return poller.between(start, time.monotonic()).p99_ms


def rejected(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mla_watch_engine_recorder_dumps_total" and sample.labels.get("outcome") == "error"
    )


def report(
    name: str,
    statuses: Counter,
    documented: set,
    poller: HealthPoller,
    start: float,
    rss_growth_kib: int,
    *,
    expect_count: int | None = None,
) -> dict:
    healthz = poller.between(start, time.monotonic())
    ok = set(statuses) <= documented and (expect_count is None or sum(statuses.values()) == expect_count)
    return {
        "attack": name,
        "statuses": dict(statuses),
        "documented": sorted(map(str, documented)),
        "ok": ok,
        "healthz_p99_ms": healthz.p99_ms,
        "rss_growth_mib": rss_growth_kib / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="requests per engine attack")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args()
    hostile = HostileEngine()
    reports: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="mla-watch-engine-attacks-") as scratch,
        serve_app(hostile.app) as engine_url,
    ):
        root = Path(scratch)
        (root / "config.json").write_text(json.dumps(CONFIG))
        common = [
            "--model-config",
            str(root / "config.json"),
            "--upstream-max-bytes",
            str(MAX_BYTES),
            "--request-timeout",
            str(TIMEOUT),
            "--upstream",
            engine_url,
        ]
        with (
            sidecar_process("--state-dir", str(root / "state"), "--engine", "vllm", *common) as (url, process),
            HealthPoller(url) as poller,
        ):
            rest = at_rest(url, poller)
            reports += [
                {**r, "rest_p99_ms": rest} for r in engine_attacks(url, process.pid, hostile, poller, args.rounds)
            ]
        dumps = root / "dumps"
        dumps.mkdir()
        with (
            sidecar_process(
                "--state-dir",
                str(root / "state2"),
                "--engine",
                "sglang",
                "--sglang-recorder-dir",
                str(dumps),
                "--sglang-recorder-interval",
                "0.2",
                *common,
            ) as (url, process),
            HealthPoller(url) as poller,
        ):
            rest = at_rest(url, poller)
            reports += [{**r, "rest_p99_ms": rest} for r in volume_attacks(dumps, url, process.pid, poller, 0.2)]
    width = max(len(r["attack"]) for r in reports)
    print(
        f"hostile engine and recorder volume against mla-watch serve (at least {args.rounds} rounds and "
        f"{MIN_SECONDS:g} s per attack)"
    )
    for r in reports:
        added = r["healthz_p99_ms"] - r["rest_p99_ms"]
        r["healthz_added_ms"] = added
        print(
            f"  {r['attack']:<{width}}  {'ok  ' if r['ok'] else 'FAIL'}  statuses {r['statuses']} (documented "
            f"{', '.join(r['documented'])})  /healthz p99 {r['healthz_p99_ms']:.1f} ms ({added:+.1f} over rest)  "
            f"RSS {r['rss_growth_mib']:+.0f} MiB"
        )
    met = sum(r["ok"] and r["healthz_added_ms"] <= HEALTHZ_GOAL_MS for r in reports)
    print(
        f"{met} of {len(reports)} attacks got their documented answer with /healthz within {HEALTHZ_GOAL_MS:g} ms "
        f"of rest"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "engine_attacks", "attacks": reports}, indent=2) + "\n")


if __name__ == "__main__":
    main()
