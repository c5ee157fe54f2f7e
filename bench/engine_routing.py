"""Engine routing through the proxy: decode+count CPU, the latency the proxy adds, the event loop meanwhile.

    python -m bench.engine_routing                            # about a minute on 2 CPU cores
    python -m bench.engine_routing --repeats 20 --requests 100  # bench/README.md's arguments
    python -m bench.engine_routing --json figures.json        # also write the figures as JSON

Beside vLLM or SGLang (``serve --upstream URL --engine vllm|sglang``), every
response carries the routing of each of its tokens, which the proxy decodes, counts and strips.
For DeepSeek-V3 (61 layers of which 58 MoE, 256 experts, top-8) 2,000 tokens are 928k expert
ids: 1.3 MB of base64 in vLLM's field, 5.2 MB in SGLang's. The goal: decoding and counting
2,000 tokens in at most 5 ms of CPU, off the event loop. Measured, for each format and size
(``--tokens``, 100 and 2,000 by default):

* decode+count CPU, in this process: ``decode_response()`` on the engine's body (parse, base64,
  count, strip, re-serialise), median of ``--repeats`` (thread CPU time), split into
  ``routing_counts()`` alone (the counting) and the rest, plus the window update
  (``EngineRouting.count()``: one array add on the event loop after the worker answers) and the
  reader's cost of moving one response's counts into the windows (``EngineRouting.collect()``, in
  the thread of whoever reads: /metrics, the alert round, /v1/routing), which is not on the loop;
* the proxy's added latency: a fake engine (its own process, canned pre-built bodies, so its cost
  is the same for every request) is asked straight and through ``mla-watch serve --upstream``,
  routing on (``--engine vllm|sglang``, the engine returns the routing) and off (``--engine none``,
  the engine returns the same body without it), ``--requests`` sequential requests per variant,
  the four variants interleaved request by request so that the shared machine's drift hits them
  alike; client-side p50, added = p50(on) - p50(off), and their ratio. The decoding process starts
  with the first answer to count: one is counted before anything is timed;
* the event loop meanwhile: a thread polls the routing proxy's ``/healthz`` every 20 ms; its
  p50/p99 during the routing-on requests against at rest (before them), as bench/attacks.py
  does. Once more with ``--decode-workers 0`` (decoding in a thread, which holds the GIL) at the
  largest size, to show why decoding runs in worker processes.

The proxies run with ``--alert-interval`` and ``--history-interval`` of an hour, so that a rule
evaluation or a history sample does not land in the measured requests. Only ratios and
differences measured within one run mean anything on a shared machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.server_overhead import sidecar_process, wait_answering
from harness.attacks import HealthPoller, Latency
from harness.canned_engine import DEEPSEEK_V3, routing_ids
from harness.support import REPO, end_process, free_port, metric_value
from mla_watch.engines.formats import (
    ENGINES,
    RoutingPlan,
    decode_response,
    encode_sglang,
    encode_vllm,
    every_layer,
    routing_counts,
    strip_response,
)
from mla_watch.engines.geometry import EngineGeometry, parse_geometry

GOAL_CPU_MS = 5.0  # the goal: decoding and counting 2,000 tokens of DeepSeek-V3 routing
GOAL_TOKENS = 2000
GOAL_ADDED_MS = 3.0  # the latency routing adds through the proxy at p50: at or under a plain LiteLLM hop
PROMPT_TOKENS = 16  # of the routing rows: the engines return prompt + generated - 1 rows
EXTRA = {"policy": "default/default", "adjustments": []}  # the proxy's "mla_watch" object (Decision.as_dict)


# --------------------------------------------------------------------------- what the engine answers


def completion(tokens: int) -> dict[str, Any]:
    generated = tokens - PROMPT_TOKENS + 1
    return {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "deepseek-ai/DeepSeek-V3",
        "choices": [
            {"index": 0, "text": " tok" * generated, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": generated,
            "total_tokens": PROMPT_TOKENS + generated,
        },
    }


def key(engine: str, tokens: int, routing: bool) -> str:
    """The prompt that selects a canned body (and the name of its file)."""
    return f"{engine}_{tokens}_{'on' if routing else 'off'}"


def engine_bodies(geometry: EngineGeometry, sizes: list[int], seed: int = 0) -> dict[str, bytes]:
    """Every canned body: per engine format and size, with the routing (current field) and without."""
    rng = np.random.default_rng(seed)
    bodies = {}
    for tokens in sizes:
        ids = every_layer(routing_ids(rng, tokens, geometry), list(geometry.moe_layers), geometry.num_hidden_layers)
        for engine in ENGINES:
            bodies[key(engine, tokens, False)] = json.dumps(completion(tokens)).encode()
            document = completion(tokens)
            if engine == "vllm":  # vLLM >= 0.22: choices[i].routed_experts, base64 of a .npy
                document["choices"][0]["routed_experts"] = encode_vllm(ids, geometry.num_experts)
            else:  # SGLang: sglext.routed_experts, base64 of raw int32
                document["sglext"] = {"routed_experts": encode_sglang(ids)}
            bodies[key(engine, tokens, True)] = json.dumps(document).encode()
    return bodies


def serve_engine(directory: Path, port: int) -> None:
    """The fake engine (``--serve-engine``): canned bodies by prompt, SGLang's only when asked for routing."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    bodies = {path.stem: path.read_bytes() for path in directory.glob("*.json") if path.stem != "config"}

    async def completions(request: Request) -> Response:
        asked = await request.json()
        name = str(asked.get("prompt"))
        if name.startswith("sglang_") and asked.get("return_routed_experts") is not True:
            name = name.replace("_on", "_off")  # SGLang returns routing only to requests that ask
        if name not in bodies:
            return JSONResponse({"error": {"message": f"no canned body {name!r}"}}, status_code=404)
        return Response(bodies[name], media_type="application/json")

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "deepseek-ai/DeepSeek-V3", "object": "model", "owned_by": "vllm"}]}
        )

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def fake_engine(directory: Path) -> Iterator[str]:
    """The fake engine in its own process (its CPU stays out of the proxy's), ready; stopped afterwards."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.engine_routing", "--serve-engine", str(directory), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url + "/v1/models", process, 60, f"the fake engine on port {port}")
        yield url
    finally:
        end_process(process, grace=10)


# --------------------------------------------------------------------------- decode+count CPU, in-process


def decoded_ids(engine: str, body: bytes, geometry: EngineGeometry) -> np.ndarray:
    """The routing array of a canned body, as the decoder reads it (outside the timed part)."""
    document = json.loads(body)
    if engine == "vllm":
        return np.load(io.BytesIO(base64.b64decode(document["choices"][0]["routed_experts"])), allow_pickle=False)
    raw = np.frombuffer(base64.b64decode(document["sglext"]["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, geometry.num_hidden_layers, geometry.top_k)


def cpu_ms(function: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median thread CPU and wall time of ``function``, in ms, after one untimed call."""
    function()
    cpu, wall = [], []
    for _ in range(repeats):
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        function()
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started_wall)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def decode_figures(
    geometry: EngineGeometry, bodies: dict[str, bytes], sizes: list[int], repeats: int
) -> dict[str, float]:
    from prometheus_client import CollectorRegistry

    from mla_watch.engines.watch import EngineMetrics, EngineRouting

    figures: dict[str, float] = {}
    for engine in ENGINES:
        plan = RoutingPlan(engine, geometry, keep=False, extra=EXTRA)
        windows = EngineRouting(engine, geometry, EngineMetrics(CollectorRegistry()))  # serve's default windows
        for tokens in sizes:
            body = bodies[key(engine, tokens, True)]
            decoded = decode_response(plan, body)
            if decoded.counts is None or decoded.tokens != tokens:
                raise RuntimeError(f"{engine} {tokens}: decoded {decoded.tokens} tokens, error {decoded.error}")
            ids = decoded_ids(engine, body, geometry)
            total, wall = cpu_ms(lambda plan=plan, body=body: decode_response(plan, body), repeats)
            # What the event loop spends before the client has its answer: the routing cut out, not decoded.
            if strip_response(plan, body) is None:
                raise RuntimeError(f"{engine} {tokens}: the answer could not be stripped on the event loop")
            strip, _ = cpu_ms(lambda plan=plan, body=body: strip_response(plan, body), repeats)
            counting, _ = cpu_ms(lambda ids=ids: routing_counts(ids, geometry), repeats)
            window, _ = cpu_ms(lambda windows=windows, decoded=decoded: windows.count("default", decoded), repeats)
            # What a reader (/metrics, the alert round, /v1/routing) spends moving one response into the windows.
            both, _ = cpu_ms(
                lambda windows=windows, decoded=decoded: (windows.count("default", decoded), windows.collect()), repeats
            )
            name = f"{engine}_{tokens}"
            figures[f"collect_cpu_ms_{name}"] = max(both - window, 0.0)
            figures.update(
                {
                    f"body_bytes_{name}": len(body),
                    f"decode_cpu_ms_{name}": total,
                    f"strip_cpu_ms_{name}": strip,
                    f"decode_wall_ms_{name}": wall,
                    f"decode_us_per_token_{name}": total * 1e3 / tokens,
                    f"counts_cpu_ms_{name}": counting,
                    f"parse_strip_cpu_ms_{name}": total - counting,
                    f"window_cpu_ms_{name}": window,
                    f"routing_cpu_ms_{name}": total + window,
                }
            )
    return figures


# --------------------------------------------------------------------------- through the proxy


@dataclass
class Run:
    """One routing proxy (a format, a number of decode workers) against the routing-off one."""

    engine: str
    workers: int
    rest: Latency = field(default_factory=Latency)
    figures: dict[str, float] = field(default_factory=dict)


def p50_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def p99_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3


def measure_proxy(
    engine: str,
    workers: int,
    sizes: list[int],
    requests: int,
    rest_seconds: float,
    upstream: str,
    plain: str,
    model_config: Path,
    state: Path,
) -> Run:
    """``requests`` x (straight off, straight on, proxy off, proxy on) per size, interleaved; /healthz meanwhile."""
    run = Run(engine, workers)
    args = [
        "--upstream",
        upstream,
        "--engine",
        engine,
        "--model-config",
        str(model_config),
        "--decode-workers",
        str(workers),
        "--state-dir",
        str(state / f"{engine}-{workers}"),
        "--alert-interval",
        "3600",
        "--history-interval",
        "3600",
    ]
    with sidecar_process(*args) as (proxy, _), HealthPoller(proxy) as poller, httpx.Client(timeout=60) as client:
        # The decoding process starts with the first answer to count: started before anything is timed.
        warm = client.post(proxy + "/v1/completions", json={"prompt": key(engine, min(sizes), True), "max_tokens": 16})
        if warm.status_code != 200:
            raise RuntimeError(f"the {engine} proxy's first answer: {warm.status_code} {warm.text[:300]}")
        wait_counted(client, proxy, engine, 1)
        started = time.monotonic()
        time.sleep(rest_seconds)
        run.rest = poller.between(started, time.monotonic())
        for tokens in sizes:
            variants = {  # name: (base URL, prompt, extra request fields)
                "direct_off": (upstream, key(engine, tokens, False), {}),
                "direct_on": (
                    upstream,
                    key(engine, tokens, True),
                    {"return_routed_experts": True} if engine == "sglang" else {},
                ),
                "proxy_off": (plain, key(engine, tokens, False), {}),
                "proxy_on": (proxy, key(engine, tokens, True), {}),
            }
            names = list(variants)
            times: dict[str, list[float]] = {name: [] for name in names}
            spans: list[tuple[float, float]] = []
            for index in range(requests + 3):  # the first three rounds warm up and are not counted
                for name in names[index % 4 :] + names[: index % 4]:
                    url, prompt, extra = variants[name]
                    sent = time.monotonic()
                    answer = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, **extra})
                    done = time.monotonic()
                    if answer.status_code != 200:
                        raise RuntimeError(f"{name} {prompt}: {answer.status_code} {answer.text[:300]}")
                    if index >= 3:
                        times[name].append(done - sent)
                        if name == "proxy_on":
                            spans.append((sent, done))
                    if index == 0 and name == "proxy_on":
                        check_stripped(answer.json(), engine)
            during = poller.within(spans)
            name = f"{engine}_{tokens}" + ("_thread" if workers == 0 else "")
            p50 = {variant: p50_ms(values) for variant, values in times.items()}
            p99 = {variant: p99_ms(values) for variant, values in times.items()}
            run.figures.update({f"{variant}_p50_ms_{name}": value for variant, value in p50.items()})
            run.figures.update({f"{variant}_p99_ms_{name}": value for variant, value in p99.items()})
            run.figures.update(
                {
                    f"proxy_added_ms_{name}": p50["proxy_on"] - p50["proxy_off"],
                    f"proxy_added_p99_ms_{name}": p99["proxy_on"] - p99["proxy_off"],
                    f"proxy_ratio_{name}": p50["proxy_on"] / p50["proxy_off"],
                    f"healthz_p50_ms_{name}": during.p50_ms,
                    f"healthz_p99_ms_{name}": during.p99_ms,
                    f"healthz_max_ms_{name}": during.max_ms,
                    f"healthz_samples_{name}": during.samples,
                    f"healthz_failures_{name}": during.failures,
                    f"healthz_added_p50_ms_{name}": during.p50_ms - run.rest.p50_ms,
                    f"healthz_added_p99_ms_{name}": during.p99_ms - run.rest.p99_ms,
                }
            )
        expected = len(sizes) * (requests + 3) + 1  # and the first answer
        counted = wait_counted(client, proxy, engine, expected)
        if counted != expected:
            raise RuntimeError(f"the {engine} proxy counted the routing of {counted} responses, expected {expected}")
    suffix = "_thread" if workers == 0 else ""
    run.figures.update(
        {
            f"healthz_rest_p50_ms_{engine}{suffix}": run.rest.p50_ms,
            f"healthz_rest_p99_ms_{engine}{suffix}": run.rest.p99_ms,
        }
    )
    return run


def wait_counted(client: httpx.Client, proxy: str, engine: str, expected: int, timeout: float = 60) -> float:
    """The answers whose routing ``proxy`` counted, once there are ``expected`` (or ``timeout`` has passed): the
    routing is counted after each answer, the last ones may still be in the queue."""
    waited = time.monotonic()
    while True:
        counted = metric_value(
            client.get(proxy + "/metrics").text, "mla_watch_engine_responses_total", engine=engine, outcome="counted"
        )
        if counted >= expected or time.monotonic() - waited > timeout:
            return counted
        time.sleep(0.1)


def check_stripped(document: dict[str, Any], engine: str) -> None:
    """The client did not ask for the routing: the proxy removed it and added its own object."""
    if "mla_watch" not in document or "sglext" in document or "routed_experts" in document["choices"][0]:
        raise RuntimeError(f"{engine}: the proxy's answer still carries routing or lacks mla_watch: {sorted(document)}")


@contextlib.contextmanager
def plain_proxy(upstream: str, state: Path) -> Iterator[str]:
    """The routing-off proxy (``--engine none``): forwards, applies the policy, reads no routing."""
    with sidecar_process(
        "--upstream",
        upstream,
        "--engine",
        "none",
        "--state-dir",
        str(state / "none"),
        "--alert-interval",
        "3600",
        "--history-interval",
        "3600",
    ) as (url, _):
        yield url


# --------------------------------------------------------------------------- report


def render(figures: dict[str, Any], sizes: list[int], formats: list[str]) -> str:
    lines = [
        "decode+count in-process (median thread CPU; worker = decode_response, loop = pending add on the event "
        "loop, total = worker + loop; collect = a reader moving it into the windows, off the loop):",
        f"  {'format':<7} {'tokens':>6} {'body':>9} {'worker ms':>9} {'us/token':>8} {'counts ms':>9} "
        f"{'rest ms':>8} {'loop ms':>8} {'total ms':>8} {'collect':>8}  goal <= {GOAL_CPU_MS:g} ms at "
        f"{GOAL_TOKENS:,}",
    ]
    for engine in formats:
        for tokens in sizes:
            n = f"{engine}_{tokens}"
            goal = ""
            if tokens == GOAL_TOKENS:
                goal = "met" if figures[f"routing_cpu_ms_{n}"] <= GOAL_CPU_MS else "NOT met"
                goal += f" (x{figures[f'routing_cpu_ms_{n}'] / GOAL_CPU_MS:.1f} of the goal)"
            lines.append(
                f"  {engine:<7} {tokens:>6} {figures[f'body_bytes_{n}'] / 1e6:>7.2f}MB "
                f"{figures[f'decode_cpu_ms_{n}']:>9.2f} {figures[f'decode_us_per_token_{n}']:>8.2f} "
                f"{figures[f'counts_cpu_ms_{n}']:>9.2f} {figures[f'parse_strip_cpu_ms_{n}']:>8.2f} "
                f"{figures[f'window_cpu_ms_{n}']:>8.2f} {figures[f'routing_cpu_ms_{n}']:>8.2f} "
                f"{figures[f'collect_cpu_ms_{n}']:>8.2f}  {goal}"
            )
    lines += [
        "",
        "before the client has its answer, on the event loop (strip_response: the routing cut out, not "
        "decoded; median thread CPU ms):",
    ]
    for engine in formats:
        lines.append(
            "  "
            + ", ".join(f"{engine} {tokens}: {figures[f'strip_cpu_ms_{engine}_{tokens}']:.3f} ms" for tokens in sizes)
        )
    lines += [
        "",
        "through the proxy (client p50 ms; added = proxy on - proxy off, at p50 and p99) and /healthz of the "
        f"routing proxy during its requests (ms); goal: added <= +{GOAL_ADDED_MS:g} ms at p50 for "
        f"{GOAL_TOKENS:,} tokens:",
        f"  {'format':<7} {'workers':>7} {'tokens':>6} {'direct off':>10} {'direct on':>9} {'proxy off':>9} "
        f"{'proxy on':>8} {'added':>7} {'p99 add':>7} {'ratio':>6}  {'healthz p50/p99':>15} {'at rest':>11} "
        f"{'added p99':>9}  goal",
    ]
    for engine in formats:
        for suffix, workers in (("", "1"), ("_thread", "0 (thread)")):
            for tokens in sizes:
                n = f"{engine}_{tokens}{suffix}"
                if f"proxy_on_p50_ms_{n}" not in figures:
                    continue
                rest = (
                    f"{figures[f'healthz_rest_p50_ms_{engine}{suffix}']:.1f}/"
                    f"{figures[f'healthz_rest_p99_ms_{engine}{suffix}']:.1f}"
                )
                goal = ""
                if tokens == GOAL_TOKENS and not suffix:
                    goal = "met" if figures[f"proxy_added_ms_{n}"] <= GOAL_ADDED_MS else "NOT met"
                lines.append(
                    f"  {engine:<7} {workers:>7} {tokens:>6} {figures[f'direct_off_p50_ms_{n}']:>10.2f} "
                    f"{figures[f'direct_on_p50_ms_{n}']:>9.2f} {figures[f'proxy_off_p50_ms_{n}']:>9.2f} "
                    f"{figures[f'proxy_on_p50_ms_{n}']:>8.2f} {figures[f'proxy_added_ms_{n}']:>+7.2f} "
                    f"{figures[f'proxy_added_p99_ms_{n}']:>+7.2f} {figures[f'proxy_ratio_{n}']:>6.2f}  "
                    f"{figures[f'healthz_p50_ms_{n}']:>7.1f}/{figures[f'healthz_p99_ms_{n}']:<7.1f} {rest:>11} "
                    f"{figures[f'healthz_added_p99_ms_{n}']:>+9.1f}  {goal}"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[100, GOAL_TOKENS],
        help="routing rows per response (prompt + generated - 1)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="in-process decodes per format and size (median)")
    parser.add_argument("--requests", type=int, default=20, help="requests per variant, format and size")
    parser.add_argument("--rest", type=float, default=2.0, help="seconds of /healthz at rest before each proxy's run")
    parser.add_argument(
        "--format", dest="formats", action="append", choices=ENGINES, help="vllm or sglang (repeatable; default both)"
    )
    parser.add_argument("--no-thread", action="store_true", help="skip the --decode-workers 0 run")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    parser.add_argument("--serve-engine", type=Path, help=argparse.SUPPRESS)  # the fake engine's process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine is not None:
        serve_engine(args.serve_engine, args.port)
        return
    sizes = sorted(set(args.tokens))
    if min(sizes) < PROMPT_TOKENS:
        parser.error(f"--tokens: expected at least {PROMPT_TOKENS} (the prompt's rows)")
    formats = args.formats or list(ENGINES)
    geometry = parse_geometry(DEEPSEEK_V3)
    started = time.monotonic()
    bodies = engine_bodies(geometry, sizes)
    print(f"{geometry.describe()}; bodies built in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    figures: dict[str, Any] = {
        "bench": "engine_routing",
        "args": {k: v for k, v in vars(args).items() if k not in ("serve_engine", "port")},
        "goal_cpu_ms": GOAL_CPU_MS,
        "goal_tokens": GOAL_TOKENS,
    }
    figures.update(decode_figures(geometry, bodies, sizes, args.repeats))
    print("in-process decode timed", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mla-watch-engine-routing-") as directory:
        root = Path(directory)
        engine_dir = root / "engine"
        engine_dir.mkdir()
        for name, body in bodies.items():
            (engine_dir / f"{name}.json").write_bytes(body)
        (engine_dir / "config.json").write_text(json.dumps(DEEPSEEK_V3))
        with fake_engine(engine_dir) as upstream, plain_proxy(upstream, root) as plain:
            runs = [(engine, 1, sizes) for engine in formats]
            if not args.no_thread:
                runs += [(engine, 0, [max(sizes)]) for engine in formats]
            for engine, workers, run_sizes in runs:
                run = measure_proxy(
                    engine,
                    workers,
                    run_sizes,
                    args.requests,
                    args.rest,
                    upstream,
                    plain,
                    engine_dir / "config.json",
                    root,
                )
                figures.update(run.figures)
                print(f"proxy {engine}, --decode-workers {workers}: done", file=sys.stderr, flush=True)
    figures["wall_s"] = time.monotonic() - started

    print(
        f"engine routing through the proxy: {geometry.describe()}; {args.repeats} decodes, {args.requests} "
        f"requests per variant; {figures['wall_s']:.0f} s"
    )
    print(render(figures, sizes, formats))
    if args.json:  # flat keys, milliseconds throughout
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
