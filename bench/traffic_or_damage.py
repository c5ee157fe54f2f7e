"""Traffic or damage: four floods of one client and a router damaged in place, and what each makes the sidecar do.

    python -m bench.traffic_or_damage                    # the bundled model: four floods and a damage (~8 min)
    python -m bench.traffic_or_damage --engine vllm      # also beside a real vLLM: the floods, and the reference
                                                         # prompts' cost on the engine's throughput
    python -m bench.traffic_or_damage --json figures.json

The scenarios are harness/floods.py's (the tests assert what this prints): ``serve --capture`` with the shipped
rules (every hold cut to 0 s) and reference prompts, on-call and the line owners on a loopback webhook
receiver; healthy traffic of four lines until their baselines are learned; then one client (``flood-1``)
floods ``code_assistant`` with one of four floods (a healthy request of another line in every four), or
MoE layer 2's correction bias is damaged in place (+10 on six experts) under healthy traffic.

Printed per scenario: code_assistant's entropy per MoE layer before and after, the alerts that fired and
their causes, what on-call's pager received, the re-tune jobs and the router versions on disk; for the
damage, the strategy promoted and its reference gates.

With ``--engine vllm``, the reference prompts' cost on the engine: one round of every shipped set read through
the engine alone (its prompt tokens/s while reading them); four clients generating 32 tokens each for
``--seconds``, alternated alone and while one round of every set is read (at the default pace), as tokens/s of
the clients and the ratio in one run; and what the default schedule (every set every 300 s) sends: prompt
tokens a second, and its share of what the engine scores while reading the sets alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness.floods import FLOODS, Outcome, damage_scenario, engine_flood_scenario, flood_scenario
from harness.support import engine_clients_tokens
from mla_watch.references.prompts import load_reference_dir
from mla_watch.references.readers import EngineReader
from mla_watch.shipped import SHIPPED_REFERENCES


def spread(alerts: list[dict[str, Any]]) -> float | None:
    """Seconds between the first and the last of ``alerts`` to fire."""
    times = [alert["firing_since"] for alert in alerts if alert.get("firing_since")]
    return round(max(times) - min(times), 1) if times else None


def summary(outcome: Outcome) -> dict[str, Any]:
    firing = [alert for alert in outcome.alerts if alert["state"] in ("firing", "resolved")]
    return {
        "scenario": outcome.name,
        "requests": outcome.requests,
        "seconds": outcome.seconds,
        "entropy_before": outcome.entropy_before,
        "entropy_after": outcome.entropy_after,
        "alerts": sorted(
            {
                f"{a['labels']['alertname']} {a['labels'].get('business_line')} "
                f"{a['labels'].get('router', '')} -> {a['labels'].get('cause')}"
                for a in firing
            }
        ),
        "causes": sorted({a["labels"].get("cause", "") for a in firing}),
        "oncall_pages": len([a for a in outcome.oncall if a["status"] == "firing"]),
        "oncall_causes": sorted({a["labels"].get("cause", "") for a in outcome.oncall}),
        "owners_warnings": len([a for a in outcome.owners if a["status"] == "firing"]),
        "oncall_notifications": len(outcome.oncall_notifications),
        # per line: the alerts of each notification the line owners received
        "owners_by_line": {
            line: [
                len(body["alerts"])
                for body in outcome.owner_notifications
                if body["groupLabels"].get("business_line") == line
            ]
            for line in sorted({body["groupLabels"].get("business_line", "") for body in outcome.owner_notifications})
        },
        # how far apart the line's alerts fired: what a group's wait has to collect
        "code_assistant_spread_s": spread([a for a in firing if a["labels"].get("business_line") == "code_assistant"]),
        "jobs": [(job["status"], (job.get("result") or {}).get("strategy")) for job in outcome.jobs],
        "versions": outcome.versions,
        "clients": next(
            (
                a["cause"]["details"].get("clients")
                for a in firing
                if a.get("cause") and a["cause"]["details"].get("clients")
            ),
            None,
        ),
        "code_assistant_clients": ((outcome.reference or {}).get("clients") or {}).get("code_assistant"),
    }


def show(figures: dict[str, Any]) -> None:
    print(f"\n== {figures['scenario']}: {figures['requests']} requests, {figures['seconds']} s")
    print(f"   code_assistant entropy: {figures['entropy_before']} -> {figures['entropy_after']}")
    print(
        f"   causes of the alerts: {figures['causes']}; on-call pages: {figures['oncall_pages']} "
        f"{figures['oncall_causes']} in {figures['oncall_notifications']} notification(s); line owners' "
        f"warnings: {figures['owners_warnings']}"
    )
    by_line = "; ".join(
        f"{line}: {len(sizes)} notification(s) of {sizes} alerts" for line, sizes in figures["owners_by_line"].items()
    )
    print(
        f"   line owners' notifications by line: {by_line or 'none'}; code_assistant's alerts fired within "
        f"{figures['code_assistant_spread_s']} s"
    )
    for alert in figures["alerts"]:
        print(f"     {alert}")
    print(f"   re-tune jobs: {figures['jobs']}; router versions on disk: {figures['versions']}")
    if figures["clients"]:
        print(f"   clients named: {figures['clients']}")
    if figures["code_assistant_clients"]:
        print(f"   code_assistant's clients: {figures['code_assistant_clients']}")


def engine_cost(url: str, geometry: Any, seconds: float, rounds: int) -> dict[str, Any]:
    """Clients' tokens/s alone and while one round of every set is read, alternated ``rounds`` times; the engine's
    prompt tokens/s while it reads the sets alone; what the default schedule asks of it."""
    from mla_watch.engines.vllm_weights import VllmWeights

    sets = load_reference_dir(SHIPPED_REFERENCES).for_line(None)  # the long set: bench/long_references.py
    reader = EngineReader(VllmWeights(url, geometry=geometry), geometry, rate=16.0)
    for reference in sets:  # tokenized once, as the sidecar does
        reader.token_ids(reference)
    set_tokens = sum(len(ids) for reference in sets for ids in reader.token_ids(reference))
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def read_round() -> float:
        started = time.monotonic()
        for reference in sets:
            reader.read(reference)
        return time.monotonic() - started

    def clients(stop: threading.Event) -> int:
        return engine_clients_tokens(url, model, stop, timeout=120)

    alone = [read_round() for _ in range(rounds)]  # the engine reading the sets, nothing else
    results: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(rounds):
        for arm in ("without", "with"):
            stop = threading.Event()
            counted: list[int] = []
            worker = threading.Thread(target=lambda: counted.append(clients(stop)))  # noqa: B023
            started = time.monotonic()
            worker.start()
            if arm == "with":
                read_round()
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
            stop.set()
            worker.join()
            results[arm].append(counted[0] / (time.monotonic() - started))
    without, with_ = (sorted(values)[len(values) // 2] for values in (results["without"], results["with"]))
    median_round = sorted(alone)[len(alone) // 2]
    capacity = set_tokens / median_round  # prompt tokens/s the engine scores while reading them alone
    schedule = set_tokens / 300.0
    return {
        "clients_tokens_per_second_without": round(without, 2),
        "clients_tokens_per_second_with_one_round_read": round(with_, 2),
        "ratio": round(with_ / without, 3),
        "tokens_per_round_of_every_set": set_tokens,
        "seconds_per_round_alone": round(median_round, 1),
        "engine_prompt_tokens_per_second_reading_alone": round(capacity, 1),
        "default_schedule_prompt_tokens_per_second": round(schedule, 1),
        "default_schedule_share_of_reading_capacity": round(schedule / capacity, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("none", "vllm"), default="none")
    parser.add_argument("--seconds", type=float, default=30.0, help="per arm of the engine's cost (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the engine's cost (default 3)")
    parser.add_argument("--skip-embedded", action="store_true", help="only the engine's part")
    parser.add_argument("--skip-floods", action="store_true", help="beside vLLM, only the reference prompts' cost")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    figures: dict[str, Any] = {"bench": "traffic_or_damage", "embedded": [], "vllm": []}
    if not args.skip_embedded:
        for flood in FLOODS:
            figures["embedded"].append(summary(flood_scenario(flood)))
            show(figures["embedded"][-1])
        damaged = damage_scenario("model.layers.2.mlp.gate", (0, 1, 2, 3, 4, 5), 10.0)
        figures["embedded"].append(summary(damaged))
        show(figures["embedded"][-1])
        promoted = [job for job in damaged.jobs if job["status"] == "promoted"]
        if promoted:
            attempt = next(a for a in promoted[0]["result"]["attempts"] if a.get("outcome") == "promoted")
            gates = {
                check["gate"] + (f" {check['router']}" if check.get("router") else ""): check["decision"]
                for check in attempt["gates"]["checks"]
                if check["gate"].startswith("reference")
            }
            print(f"   promoted: {attempt['strategy']} (version {attempt['version']}); reference gates: {gates}")
            print(f"   trigger to promoted: {promoted[0]['result']['timings'].get('trigger_to_promoted_seconds')} s")
    if args.engine == "vllm":
        from harness.real_vllm import build_checkpoint, cache_root, running_vllm
        from mla_watch.engines.geometry import load_geometry

        checkpoint = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
        with (
            tempfile.TemporaryDirectory() as work,
            running_vllm(checkpoint, routing=True, log_path=Path(work) / "vllm.log") as url,
        ):
            for index, flood in enumerate(() if args.skip_floods else FLOODS):
                outcome = engine_flood_scenario(url, checkpoint, Path(work) / f"flood-{index}", flood)
                figures["vllm"].append(summary(outcome))
                show(figures["vllm"][-1])
            cost = engine_cost(url, load_geometry(checkpoint / "config.json"), args.seconds, args.rounds)
            figures["vllm_cost"] = cost
            print(f"\n== the reference prompts' cost on the real vLLM: {json.dumps(cost)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
