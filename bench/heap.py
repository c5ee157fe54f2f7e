"""What the sidecar keeps resident after a burst of large answers: the heap's free pages returned, or kept.

    python -m bench.heap                        # 300 answers and 100 oversized ones (a few minutes)
    python -m bench.heap --answers 1000 --oversized 400

Three ``mla-watch serve --upstream URL --engine vllm`` processes beside one fake vLLM (its own process,
bench/engine_routing.py's canned DeepSeek-V3 answers of ``--tokens`` tokens with their routing): one as
served, which returns the C heap's free pages to the system when its count queue drains
(:mod:`mla_watch.common.heap`), one with that turned off (glibc keeps them, as it did before), and
one with it off and glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``: every large
block an ``mmap`` of its own, returned when freed), the other way to the same end.

* latency: ``--latency-requests`` answers, one at a time, the sidecars interleaved request by
  request so that the shared machine's drift hits them alike: the client-side p50 through each;
* a burst: ``--answers`` answers sent by ``--clients`` concurrent clients to one sidecar after the
  other (they pile up in its count queue), then the queue drained: each server's own resident
  memory (VmRSS) idle, at its peak (VmHWM) and once drained;
* then ``--oversized`` answers of ``--oversized-mb`` MB against ``--upstream-max-bytes 8M`` (each
  answered 502, nothing kept): the resident memory afterwards.

Nothing is asserted: only figures measured in one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.engine_routing import DEEPSEEK_V3, engine_bodies, fake_engine, key
from bench.server_overhead import wait_answering
from harness.support import end_process, free_port, memory_kib, metric_value
from mla_watch.engines.geometry import parse_geometry

# The served code with the release turned off: glibc keeps the heap's free pages, as before.
KEPT = (
    "import sys; from mla_watch.common import heap; heap.release_free_memory = lambda: False; "
    "from mla_watch.cli import main; sys.exit(main())"
)
# (interpreter arguments, environment): the third keeps every large block an mmap of its own instead.
VARIANTS = {
    "free pages returned (served)": (["-m", "mla_watch.cli"], {}),
    "free pages kept": (["-c", KEPT], {}),
    "glibc's mmap threshold fixed": (["-c", KEPT], {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}),
}
CAP = "8M"
HEADER = {"X-Business-Line": "code_assistant"}


def start(
    how: list[str], extra_env: dict[str, str], upstream: str, config: Path, root: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_WATCH_", "MALLOC_", "GLIBC_TUNABLES"))}
    env.update(extra_env)
    process = subprocess.Popen(
        [
            sys.executable,
            *how,
            "serve",
            "--port",
            str(port),
            "--state-dir",
            str(root),
            "--upstream",
            upstream,
            "--engine",
            "vllm",
            "--model-config",
            str(config),
            "--upstream-max-bytes",
            CAP,
            "--alert-interval",
            "3600",
            "--history-interval",
            "3600",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=root,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_drained(client: httpx.Client, url: str, answers: int) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # every answer counted, or dropped at a full count queue
        text = client.get(url + "/metrics").text
        done = metric_value(text, "mla_watch_engine_responses_total", engine="vllm", outcome="counted") + metric_value(
            text, "mla_watch_engine_count_dropped_total", reason="queue_full"
        )
        if done >= answers:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the sidecar at {url} did not count {answers} answers within 600 s")


def burst(url: str, body: dict, answers: int, clients: int) -> None:
    """``answers`` answers through ``url`` from ``clients`` concurrent clients."""

    def send(count: int) -> None:
        with httpx.Client(timeout=120) as client:
            for _ in range(count):
                client.post(url + "/v1/completions", json=body, headers=HEADER).raise_for_status()

    with ThreadPoolExecutor(clients) as pool:
        shares = [answers // clients + (index < answers % clients) for index in range(clients)]
        list(pool.map(send, shares))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=300, help="answers with routing in the burst")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients in the burst")
    parser.add_argument("--latency-requests", type=int, default=100, help="answers timed one at a time")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of routing in each answer")
    parser.add_argument("--oversized", type=int, default=100, help="answers over the 8M --upstream-max-bytes")
    parser.add_argument("--oversized-mb", type=int, default=40, help="the size of each oversized answer")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mla-watch-heap-") as directory:
        root = Path(directory)
        engine_dir = root / "engine"
        engine_dir.mkdir()
        for name, body in engine_bodies(parse_geometry(DEEPSEEK_V3), [args.tokens]).items():
            if name == key("vllm", args.tokens, True):
                (engine_dir / f"{name}.json").write_bytes(body)
        filler = "a" * (args.oversized_mb << 20)
        (engine_dir / "oversized.json").write_text(json.dumps({"choices": [{"text": filler}]}))
        del filler
        (engine_dir / "config.json").write_text(json.dumps(DEEPSEEK_V3))
        body = {"prompt": key("vllm", args.tokens, True), "max_tokens": 16}
        with fake_engine(engine_dir) as upstream, httpx.Client(timeout=120) as client:
            sidecars = {}
            try:
                for name, (how, extra_env) in VARIANTS.items():
                    state = root / f"state-{len(sidecars)}"
                    state.mkdir()
                    sidecars[name] = start(how, extra_env, upstream, engine_dir / "config.json", state)
                for process, url in sidecars.values():
                    wait_answering(url + "/readyz", process, 120, f"the sidecar at {url}")
                time.sleep(2.0)
                figures: dict[str, dict[str, float]] = {name: {} for name in sidecars}
                for name, (process, _) in sidecars.items():
                    figures[name]["idle"] = memory_kib(process.pid) / 1024
                latencies: dict[str, list[float]] = {name: [] for name in sidecars}
                for _ in range(args.latency_requests):
                    for name, (_, url) in sidecars.items():
                        started = time.perf_counter()
                        client.post(url + "/v1/completions", json=body, headers=HEADER).raise_for_status()
                        latencies[name].append(time.perf_counter() - started)
                for name, (process, url) in sidecars.items():
                    wait_drained(client, url, args.latency_requests)
                    burst(url, body, args.answers, args.clients)
                    wait_drained(client, url, args.latency_requests + args.answers)
                    time.sleep(2.0)
                    figures[name]["peak"] = memory_kib(process.pid, "VmHWM") / 1024
                    figures[name]["drained"] = memory_kib(process.pid) / 1024
                for _ in range(args.oversized):
                    for _, url in sidecars.values():
                        answer = client.post(url + "/v1/completions", json={"prompt": "oversized"}, headers=HEADER)
                        if answer.status_code != 502:
                            raise RuntimeError(f"an oversized answer through {url} got {answer.status_code}, not 502")
                time.sleep(2.0)
                for name, (process, _) in sidecars.items():
                    figures[name]["oversized"] = memory_kib(process.pid) / 1024
            finally:
                for process, _ in sidecars.values():
                    end_process(process)
    p50 = {name: statistics.median(values) * 1000 for name, values in latencies.items()}
    served, kept, fixed = VARIANTS
    print(
        f"DeepSeek-V3 answers of {args.tokens} tokens: {args.latency_requests} one at a time, then {args.answers} "
        f"from {args.clients} clients; then {args.oversized} of {args.oversized_mb} MB against "
        f"--upstream-max-bytes {CAP}. The server's own resident memory (MiB):"
    )
    for name, values in figures.items():
        print(
            f"  {name}: idle {values['idle']:.0f}, peak {values['peak']:.0f}, drained {values['drained']:.0f}, "
            f"after the oversized {values['oversized']:.0f}; p50 of an answer one at a time {p50[name]:.2f} ms"
        )
    print(
        f"kept once drained, above idle: {figures[served]['drained'] - figures[served]['idle']:.0f} MiB against "
        f"{figures[kept]['drained'] - figures[kept]['idle']:.0f} kept and "
        f"{figures[fixed]['drained'] - figures[fixed]['idle']:.0f} with the threshold fixed; p50 "
        f"x{p50[served] / p50[kept]:.3f} against kept, x{p50[fixed] / p50[kept]:.3f} with the threshold fixed"
    )


if __name__ == "__main__":
    main()
