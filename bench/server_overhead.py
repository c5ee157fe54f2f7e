"""What serving through mla_watch costs: policy enforcement, the HTTP layer, the proxy, throughput.

    python -m bench.server_overhead                 # about two minutes on 2 CPU cores
    python -m bench.server_overhead --requests 400
    python -m bench.server_overhead --json figures.json   # also write the figures as JSON

The sidecars run as their own processes (``mla-watch serve``), as in production; the
in-process baseline runs in this one. One run, alternating the variants request by request
so that a shared machine's drift hits them alike:

* policy enforcement: ``enforce()`` on a code request that needs clamping, p50/p99;
* HTTP layer + policy: a 1-token completion through the sidecar on loopback versus the same
  generation called in-process (the difference is what the sidecar adds), p50/p99;
* proxy: the same request through a second sidecar started with ``--upstream`` versus
  straight to the upstream, p50/p99;
* throughput: 8 concurrent clients, a fixed number of 16-token requests; requests/s,
  tokens/s and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import mla_watch
from harness.support import end_process, free_port, memory_kib
from mla_watch.policy.files import PolicyStore
from mla_watch.policy.model import enforce
from mla_watch.policy.sampling import SamplingParams, generate
from mla_watch.shipped import SHIPPED_POLICIES

CODE = {"X-Business-Line": "code_assistant", "X-Task": "code"}
REQUEST = {"prompt": "def parse_invoice(", "max_tokens": 1, "temperature": 0.9, "seed": 1}


@contextlib.contextmanager
def sidecar_process(
    *extra: str, env: dict[str, str] | None = None, ready_timeout: float = 180.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``mla-watch serve`` on a free loopback port, ready; stopped afterwards."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mla_watch.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            *extra,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url + "/readyz", process, ready_timeout, f"the sidecar on port {port}")
        yield url, process
    finally:
        end_process(process)


def wait_answering(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    """Until ``url`` answers 200; ``RuntimeError`` naming ``what`` if it has not within ``timeout`` or exited."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"{what} did not become ready")
        time.sleep(0.1)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def ms(value: float) -> str:
    return f"{value * 1000:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--load-requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()

    with sidecar_process() as (url, upstream), sidecar_process("--upstream", url) as (proxy_url, _):
        policy, task = PolicyStore(SHIPPED_POLICIES).current.resolve("code_assistant", "code")
        requested = {"temperature": 0.9, "max_tokens": 1}
        enforce_times = []
        for _ in range(args.requests * 10):
            start = time.perf_counter()
            enforce(policy, task, requested)
            enforce_times.append(time.perf_counter() - start)
        p50, p99 = percentiles(enforce_times)
        print(f"policy enforcement:      p50 {ms(p50)}  p99 {ms(p99)}   (goal: p99 <= 1 ms)")

        served_with = httpx.get(url + "/readyz").json()["attention"]["used"]  # compare like with like
        model, tokenizer = mla_watch.load_model("bundled", device="cpu", attn_implementation=served_with)
        mla_watch.attach(model)  # the sidecar watches its routers too
        prompt_ids = [tokenizer.bos_token_id, *tokenizer(REQUEST["prompt"], add_special_tokens=False)["input_ids"]]
        applied = enforce(policy, task, requested).applied
        params = SamplingParams(
            temperature=applied["temperature"],
            top_p=applied["top_p"],
            repetition_penalty=applied["repetition_penalty"],
            max_tokens=1,
            seed=1,
        )
        in_process, over_http, via_proxy = [], [], []
        with httpx.Client(timeout=60) as client:
            for _ in range(5):  # warm-up
                client.post(url + "/v1/completions", json=REQUEST, headers=CODE)
                client.post(proxy_url + "/v1/completions", json=REQUEST, headers=CODE)
            for _ in range(args.requests):
                start = time.perf_counter()
                generate(model, tokenizer, prompt_ids, params)
                in_process.append(time.perf_counter() - start)
                start = time.perf_counter()
                client.post(url + "/v1/completions", json=REQUEST, headers=CODE).raise_for_status()
                over_http.append(time.perf_counter() - start)
                start = time.perf_counter()
                client.post(proxy_url + "/v1/completions", json=REQUEST, headers=CODE).raise_for_status()
                via_proxy.append(time.perf_counter() - start)
        (a50, a99), (b50, b99) = percentiles(in_process), percentiles(over_http)
        print(
            f"1-token generation:      in-process p50 {ms(a50)} p99 {ms(a99)}; "
            f"through the sidecar p50 {ms(b50)} p99 {ms(b99)}"
        )
        print(f"  HTTP layer + policy adds p50 {ms(b50 - a50)}, p99 {ms(b99 - a99)} (ratio p50 x{b50 / a50:.3f})")
        (c50, c99) = percentiles(via_proxy)
        print(f"proxy:                   via proxy p50 {ms(c50)} p99 {ms(c99)}; direct p50 {ms(b50)} p99 {ms(b99)}")
        print(
            f"  the proxy adds p50 {ms(c50 - b50)}, p99 {ms(c99 - b99)} (ratio p50 x{c50 / b50:.3f}; "
            f"goal: +2 ms at p50)"
        )

        load = {"prompt": "def parse_invoice(", "max_tokens": 16, "seed": 3}
        statuses: list[int] = []
        tokens = 0
        start = time.perf_counter()
        with httpx.Client(timeout=120) as client, concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            for response in pool.map(
                lambda _: client.post(url + "/v1/completions", json=load, headers=CODE), range(args.load_requests)
            ):
                statuses.append(response.status_code)
                if response.status_code == 200:
                    tokens += response.json()["usage"]["completion_tokens"]
        elapsed = time.perf_counter() - start
        peak = memory_kib(upstream.pid, "VmHWM") / 1024
        print(
            f"throughput:              {args.clients} clients, {args.load_requests} requests of 16 tokens: "
            f"{len(statuses) / elapsed:.2f} requests/s, {tokens / elapsed:.1f} tokens/s, "
            f"statuses {sorted(set(statuses))}; sidecar peak RSS {peak:.0f} MiB"
        )

    if args.json:  # milliseconds throughout
        figures = {
            "bench": "server_overhead",
            "args": vars(args),
            "enforce_ms": {"p50": p50 * 1e3, "p99": p99 * 1e3},
            "in_process_ms": {"p50": a50 * 1e3, "p99": a99 * 1e3},
            "sidecar_ms": {"p50": b50 * 1e3, "p99": b99 * 1e3},
            "proxy_ms": {"p50": c50 * 1e3, "p99": c99 * 1e3},
            "sidecar_added_ms": {"p50": (b50 - a50) * 1e3, "p99": (b99 - a99) * 1e3},
            "sidecar_ratio_p50": b50 / a50,
            "proxy_added_ms": {"p50": (c50 - b50) * 1e3, "p99": (c99 - b99) * 1e3},
            "proxy_ratio_p50": c50 / b50,
            "throughput": {
                "clients": args.clients,
                "requests": args.load_requests,
                "requests_per_s": len(statuses) / elapsed,
                "tokens_per_s": tokens / elapsed,
                "statuses": sorted(set(statuses)),
                "sidecar_peak_rss_mib": peak,
            },
        }
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
