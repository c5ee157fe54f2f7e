"""The proxy hop side by side: straight to the engine, through mla_watch (plain and beside vLLM), through LiteLLM.

    python -m bench.proxy_hop                                   # about 4 minutes on 2 CPU cores
    python -m bench.proxy_hop --rounds 240                      # bench/README.md's arguments
    python -m bench.proxy_hop --litellm /work/venvs/litellm/bin/litellm
    MLA_WATCH_BENCH_LITELLM=/work/venvs/litellm/bin/litellm python -m bench.proxy_hop
    python -m bench.proxy_hop --json figures.json               # also write the figures as JSON

Two fake OpenAI-compatible engines run in processes of their own and answer at once with canned
bodies (a 16-token answer): a plain one, and a vLLM one (``--enable-return-routed-experts``) whose
every answer carries the routing of 2,000 tokens of DeepSeek-V3 (61 layers, 58 MoE, 256 experts,
top-8: 1.3 MB of base64 ``.npy``), whose streams carry token ids when asked for them, and which
answers a stream's replay with the routing of its tokens. The arms, each its own process on loopback:

* ``direct``: the client straight to the plain engine (the baseline of the two arms below);
* ``mla_watch``: ``mla-watch serve --upstream URL`` (no ``--engine``): the shipped policies applied,
  mla_watch's object added to every answer;
* ``litellm``: LiteLLM's proxy (``litellm --config``) in front of the same engine, where its
  command is given (``--litellm PATH`` or ``$MLA_WATCH_BENCH_LITELLM``; the arm is skipped, saying
  so, without it). Install it apart from the project, e.g. ``python -m venv /work/venvs/litellm &&
  /work/venvs/litellm/bin/pip install 'litellm[proxy]'``;
* ``direct_routed``: the client straight to the vLLM engine (the baseline of the next arm);
* ``mla_watch_vllm``: ``mla-watch serve --upstream URL --engine vllm``: the routing cut out of every
  answer and counted after it, each stream replayed to count its routing.

Every round sends one request of each kind - a completion, a chat, a streamed chat - to every arm,
in an order shuffled each time, one request at a time (a sequential client) and ``--gap`` apart, so
the shared machine's drift, and the work one arm leaves behind after its answer, hit the arms alike.
Printed per arm and kind (completion, chat, a stream's end, a stream's first chunk): p50 and p95,
the latency added over the arm's baseline at p50 and p95 (and the interquartile range of the per-
round differences), and mla_watch's added latency as a share of LiteLLM's. Then chat throughput with
``--clients`` concurrent clients per arm, the CPU each proxy's process tree spent per request over the
rounds (the counting after the answers included: the shared machine's load moves it less than latency), and
the resident memory of each proxy's process tree (the process and all its children) after the run.
The proxies run with ``--alert-interval`` and ``--history-interval`` of an hour, so that a rule
evaluation or a history sample does not land in the measured requests. Nothing is asserted: only
figures of one run are compared with each other.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.engine_routing import wait_counted
from bench.server_overhead import sidecar_process, wait_answering
from harness.canned_engine import DEEPSEEK_V3, GENERATED, engine_app
from harness.support import REPO, end_process, free_port, metric_value, process_tree_rss

LITELLM_ENV = "MLA_WATCH_BENCH_LITELLM"
GOAL_ADDED_MS = 2.0  # the plain hop at p50, over direct
GOAL_SHARE_OF_LITELLM = 0.15  # the plain hop's added latency, as a share of LiteLLM's in the same run
HEADERS = {"X-Business-Line": "code_assistant", "X-Task": "code"}
KINDS = ("completion", "chat", "stream_end", "stream_first")
BASELINES = {"mla_watch": "direct", "litellm": "direct", "mla_watch_vllm": "direct_routed"}
CONCURRENT_ARMS = ("direct", "mla_watch", "litellm")  # the throughput phase: the plain hop against LiteLLM


def serve_engine(kind: str, port: int) -> None:
    """The fake engine's process (``--serve-engine plain|vllm``)."""
    import uvicorn

    uvicorn.run(engine_app(kind), host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def process(
    command: list[str],
    ready_url: str,
    what: str,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """``command`` as a process until ``ready_url`` answers 200; stopped afterwards."""
    started = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    try:
        wait_answering(ready_url, started, timeout, what)
        yield started
    finally:
        end_process(started)


@contextlib.contextmanager
def fake_engine(kind: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with process(
        [sys.executable, "-m", "bench.proxy_hop", "--serve-engine", kind, "--port", str(port)],
        url + "/v1/models",
        f"the {kind} fake engine on port {port}",
        120,
        cwd=REPO,
    ):
        yield url


@contextlib.contextmanager
def litellm_proxy(command: str, upstream: str, directory: Path) -> Iterator[tuple[str, int]]:
    """LiteLLM's proxy in front of ``upstream`` (model ``bench``), without a master key: no authentication, as
    the mla_watch arms."""
    config = directory / "litellm.yaml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "model_list": [
                    {
                        "model_name": "bench",
                        "litellm_params": {"model": "openai/bench", "api_base": upstream + "/v1", "api_key": "none"},
                    }
                ],
                "litellm_settings": {"telemetry": False, "drop_params": True},
            }
        )
    )
    port = free_port()
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        "LITELLM_LOG": "ERROR",
        "PYTHONPATH": "",
    }
    url = f"http://127.0.0.1:{port}"
    with process(
        [command, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        url + "/health/liveliness",
        f"LiteLLM's proxy on port {port}",
        300,
        env,
    ) as started:
        yield url, started.pid


# --------------------------------------------------------------------------- measuring


@dataclass
class Arm:
    name: str
    url: str
    pid: int | None = None  # the proxy's process (None: the engine itself)
    samples: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})


def request(kind: str) -> tuple[str, dict[str, Any]]:
    if kind == "completion":
        return "/v1/completions", {
            "model": "bench",
            "prompt": "def parse_invoice(",
            "max_tokens": GENERATED,
            "temperature": 0.9,
        }
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "def parse_invoice("}],
        "max_tokens": GENERATED,
        "temperature": 0.9,
    }
    return "/v1/chat/completions", {**body, "stream": True} if kind == "stream" else body


def send(client: httpx.Client, arm: Arm, kind: str) -> dict[str, float]:
    """One request; its latencies by kind (a stream: to its first chunk and to its end)."""
    path, body = request(kind)
    started = time.perf_counter()
    if kind != "stream":
        answer = client.post(arm.url + path, json=body, headers=HEADERS)
        answer.read()
        done = time.perf_counter()
        if answer.status_code != 200:
            raise RuntimeError(f"{arm.name} {kind}: HTTP {answer.status_code} {answer.text[:300]}")
        return {kind: done - started}
    first = None
    received = bytearray()
    with client.stream("POST", arm.url + path, json=body, headers=HEADERS) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{arm.name} stream: HTTP {answer.status_code} {answer.read()[:300]!r}")
        for piece in answer.iter_raw():
            if first is None and piece.strip():
                first = time.perf_counter()
            received += piece
    done = time.perf_counter()
    if b"[DONE]" not in received:
        raise RuntimeError(f"{arm.name} stream: no [DONE] in {bytes(received[-300:])!r}")
    return {"stream_first": (first or done) - started, "stream_end": done - started}


def check_answers(client: httpx.Client, arms: list[Arm]) -> None:
    """Each arm answers what it should: mla_watch adds its object, the vLLM arm strips the routing."""
    for arm in arms:
        path, body = request("chat")
        document = client.post(arm.url + path, json=body, headers=HEADERS).json()
        if arm.name.startswith("mla_watch") and "mla_watch" not in document:
            raise RuntimeError(f"{arm.name}: the answer carries no mla_watch object: {sorted(document)}")
        if arm.name == "mla_watch_vllm" and "routed_experts" in document["choices"][0]:
            raise RuntimeError("mla_watch_vllm: the answer still carries the routing")
        if arm.name == "direct_routed" and "routed_experts" not in document["choices"][0]:
            raise RuntimeError("direct_routed: the engine's answer carries no routing")


def run_rounds(client: httpx.Client, arms: list[Arm], rounds: int, warmup: int, gap: float) -> None:
    order = random.Random(0)
    for index in range(warmup + rounds):
        for kind in ("completion", "chat", "stream"):
            # Shuffled, not rotated: work an arm leaves behind (LiteLLM's logging after its answer, the
            # counting after the vLLM arm's) lands before every other arm alike, not always before the same one.
            for arm in order.sample(arms, len(arms)):
                time.sleep(gap)  # what the last arm does after its answer, it does before this request
                measured = send(client, arm, kind)
                if index >= warmup:
                    for name, seconds in measured.items():
                        arm.samples[name].append(seconds)


def throughput(arm: Arm, clients: int, requests: int) -> float:
    """Chat requests per second with ``clients`` concurrent clients."""
    path, body = request("chat")
    with (
        httpx.Client(timeout=60, limits=httpx.Limits(max_connections=clients)) as client,
        concurrent.futures.ThreadPoolExecutor(clients) as pool,
    ):
        for _ in range(clients):  # warm the connections
            client.post(arm.url + path, json=body, headers=HEADERS)
        started = time.perf_counter()
        statuses = list(
            pool.map(lambda _: client.post(arm.url + path, json=body, headers=HEADERS).status_code, range(requests))
        )
        elapsed = time.perf_counter() - started
    if set(statuses) != {200}:
        raise RuntimeError(f"{arm.name} under load: statuses {sorted(set(statuses))}")
    return requests / elapsed


def process_tree_cpu(pid: int) -> float:
    """The CPU seconds (user and system, reaped children's included) ``pid`` and its descendants have used so far."""
    ticks = 0
    for member in process_tree_rss(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/PID/stat after "(comm)": utime, stime, cutime, cstime are fields 12 to 15
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> tuple[int, int]:
    """The resident memory (KiB, VmRSS summed) and the number of processes of ``pid`` and all its descendants."""
    rss = process_tree_rss(pid)
    return sum(rss.values()), len(rss)


# --------------------------------------------------------------------------- report


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def figures_of(arms: dict[str, Arm]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for arm in arms.values():
        for kind, samples in arm.samples.items():
            figures[f"{arm.name}_{kind}_p50_ms"] = statistics.median(samples) * 1e3
            figures[f"{arm.name}_{kind}_p95_ms"] = p95(samples) * 1e3
    for name, baseline in BASELINES.items():
        if name not in arms:
            continue
        for kind in KINDS:
            mine, base = arms[name].samples[kind], arms[baseline].samples[kind]
            figures[f"{name}_{kind}_added_p50_ms"] = (statistics.median(mine) - statistics.median(base)) * 1e3
            figures[f"{name}_{kind}_added_p95_ms"] = (p95(mine) - p95(base)) * 1e3
            paired = sorted(a - b for a, b in zip(mine, base, strict=True))  # same round, same kind
            quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
            figures[f"{name}_{kind}_added_iqr_ms"] = [quartiles[0] * 1e3, quartiles[2] * 1e3]
    if "litellm" in arms:
        for kind in KINDS:
            theirs = figures[f"litellm_{kind}_added_p50_ms"]
            figures[f"mla_watch_{kind}_share_of_litellm"] = figures[f"mla_watch_{kind}_added_p50_ms"] / theirs
    return figures


def render(figures: dict[str, Any], arms: dict[str, Arm]) -> str:
    lines = [
        f"{'arm':<15} {'kind':<13} {'p50 ms':>7} {'p95 ms':>7} {'added p50':>9} {'added p95':>9}  per-round added, IQR"
    ]
    for arm in arms:
        for kind in KINDS:
            n = f"{arm}_{kind}"
            row = f"{arm:<15} {kind:<13} {figures[f'{n}_p50_ms']:>7.2f} {figures[f'{n}_p95_ms']:>7.2f}"
            if arm in BASELINES:
                low, high = figures[f"{n}_added_iqr_ms"]
                row += f" {figures[f'{n}_added_p50_ms']:>+9.2f} {figures[f'{n}_added_p95_ms']:>+9.2f}  "
                row += f"{low:+.2f} .. {high:+.2f}"
            lines.append(row)
    lines += [
        "",
        f"the plain hop (goal: at most +{GOAL_ADDED_MS:g} ms at p50 and at most {GOAL_SHARE_OF_LITELLM:g} "
        "of LiteLLM's added latency):",
    ]
    for kind in KINDS:
        added = figures[f"mla_watch_{kind}_added_p50_ms"]
        share = figures.get(f"mla_watch_{kind}_share_of_litellm")
        met = added <= GOAL_ADDED_MS and (share is None or share <= GOAL_SHARE_OF_LITELLM)
        theirs = (
            "" if share is None else f", {share:.3f} of LiteLLM's {figures[f'litellm_{kind}_added_p50_ms']:+.2f} ms"
        )
        lines.append(f"  {kind:<13} mla_watch adds {added:+.2f} ms at p50{theirs}: {'met' if met else 'NOT met'}")
    if "throughput" in figures:
        lines += [
            "",
            f"chat throughput, {figures['clients']} concurrent clients, {figures['load_requests']} requests per arm:",
        ]
        litellm = figures["throughput"].get("litellm")
        for arm, rate in figures["throughput"].items():
            lines.append(
                f"  {arm:<15} {rate:8.1f} requests/s" + (f" (x{rate / litellm:.2f} LiteLLM's)" if litellm else "")
            )
    lines += ["", "CPU of each proxy's process tree per request (user and system, its counting included):"]
    for arm, milliseconds in figures["cpu_ms_per_request"].items():
        lines.append(f"  {arm:<15} {milliseconds:7.2f} ms")
    lines += ["", "resident memory of each proxy's process tree after the run:"]
    for arm, (kib, count) in figures["rss"].items():
        lines.append(f"  {arm:<15} {kib / 1024:7.1f} MiB in {count} process{'es' if count != 1 else ''}")
    if "litellm" in figures["rss"]:
        lines.append(f"  mla_watch / LiteLLM: x{figures['rss']['mla_watch'][0] / figures['rss']['litellm'][0]:.2f}")
    if "counted" in figures:
        lines.append(
            f"\nthe vLLM arm counted the routing of {figures['counted']:.0f} answers (expected "
            f"{figures['expected_counted']}), {figures['replayed']:.0f} of them replayed streams"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=120, help="requests per arm and kind")
    parser.add_argument("--warmup", type=int, default=5, help="rounds sent first and not counted")
    parser.add_argument(
        "--gap",
        type=float,
        default=0.005,
        help="seconds between two requests (default 0.005): "
        "LiteLLM logs, and the vLLM arm counts, after the client has its answer",
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients of the throughput phase")
    parser.add_argument("--load-requests", type=int, default=400, help="chat requests per arm under load; 0: none")
    parser.add_argument(
        "--litellm",
        default=os.environ.get(LITELLM_ENV),
        help=f"LiteLLM's `litellm` command (default ${LITELLM_ENV}); without it, no LiteLLM arm",
    )
    parser.add_argument("--no-engine", action="store_true", help="leave out the vLLM arms")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    parser.add_argument("--serve-engine", choices=("plain", "vllm"), help=argparse.SUPPRESS)  # a fake engine
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine is not None:
        serve_engine(args.serve_engine, args.port)
        return
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    litellm = args.litellm and shutil.which(args.litellm)
    if not litellm:
        print(
            f"LiteLLM's arm is skipped: no `litellm` command at {args.litellm!r}"
            if args.litellm
            else f"LiteLLM's arm is skipped: give its command with --litellm PATH or ${LITELLM_ENV}",
            flush=True,
        )
    started = time.monotonic()
    load_before = f"{os.getloadavg()[0]:.2f}"  # the machine's own load: other work on a shared machine shows here
    quiet = ("--alert-interval", "3600", "--history-interval", "3600")
    with tempfile.TemporaryDirectory(prefix="mla-watch-proxy-hop-") as directory, contextlib.ExitStack() as stack:
        root = Path(directory)
        (root / "config.json").write_text(json.dumps(DEEPSEEK_V3))
        plain_engine = stack.enter_context(fake_engine("plain"))
        arms = {"direct": Arm("direct", plain_engine)}
        url, proxy = stack.enter_context(
            sidecar_process("--upstream", plain_engine, "--state-dir", str(root / "plain"), *quiet)
        )
        arms["mla_watch"] = Arm("mla_watch", url, proxy.pid)
        if litellm:
            url, pid = stack.enter_context(litellm_proxy(litellm, plain_engine, root))
            arms["litellm"] = Arm("litellm", url, pid)
        if not args.no_engine:
            routed_engine = stack.enter_context(fake_engine("vllm"))
            arms["direct_routed"] = Arm("direct_routed", routed_engine)
            url, proxy = stack.enter_context(
                sidecar_process(
                    "--upstream",
                    routed_engine,
                    "--engine",
                    "vllm",
                    "--model-config",
                    str(root / "config.json"),
                    "--state-dir",
                    str(root / "vllm"),
                    *quiet,
                )
            )
            arms["mla_watch_vllm"] = Arm("mla_watch_vllm", url, proxy.pid)
        print(f"arms ready in {time.monotonic() - started:.0f} s: {', '.join(arms)}", file=sys.stderr, flush=True)
        with httpx.Client(timeout=60) as client:
            check_answers(client, list(arms.values()))
            if "mla_watch_vllm" in arms:  # its decoding process starts with the first answer to count
                wait_counted(client, arms["mla_watch_vllm"].url, "vllm", 1)
            cpu_before = {arm.name: process_tree_cpu(arm.pid) for arm in arms.values() if arm.pid is not None}
            run_rounds(client, list(arms.values()), args.rounds, args.warmup, args.gap)
            if "mla_watch_vllm" in arms:
                url = arms["mla_watch_vllm"].url
                expected = (args.warmup + args.rounds) * 3 + 1  # every request, and check_answers' chat
                figures_counted = wait_counted(client, url, "vllm", expected)
                replayed = metric_value(
                    client.get(url + "/metrics").text, "mla_watch_engine_stream_replays_total", outcome="replayed"
                )
            # The proxies' CPU per request, their counting after the answers included: unlike latency, it does not
            # grow with what else the shared machine runs.
            sent = (args.warmup + args.rounds) * 3
            cpu_ms = {
                arm.name: (process_tree_cpu(arm.pid) - cpu_before[arm.name]) / sent * 1e3
                for arm in arms.values()
                if arm.pid is not None
            }
        figures = figures_of(arms)
        figures["cpu_ms_per_request"] = cpu_ms
        figures.update(
            {"bench": "proxy_hop", "args": {k: v for k, v in vars(args).items() if k not in ("serve_engine", "port")}}
        )
        if "mla_watch_vllm" in arms:
            figures.update(counted=figures_counted, replayed=replayed, expected_counted=expected)
        if args.load_requests:
            figures.update(
                clients=args.clients,
                load_requests=args.load_requests,
                throughput={
                    name: throughput(arms[name], args.clients, args.load_requests)
                    for name in CONCURRENT_ARMS
                    if name in arms
                },
            )
        figures["rss"] = {arm.name: process_tree(arm.pid) for arm in arms.values() if arm.pid is not None}
    figures["wall_s"] = time.monotonic() - started
    figures["load_before"] = load_before
    print(
        f"the proxy hop: {args.rounds} requests per arm and kind, arms in a shuffled order, {args.gap * 1e3:g} ms "
        f"apart; load average before and after {figures['load_before']} / {os.getloadavg()[0]:.2f}; "
        f"{figures['wall_s']:.0f} s"
    )
    print(render(figures, arms))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
