"""How long each command of the first hour takes here, as a new user runs them (docs/first-hour.md).

    python -m bench.first_hour                  # about four minutes on 2 CPU cores
    python -m bench.first_hour --skip demo      # without the demo
    python -m bench.first_hour --json hour.json

Each command runs as its own process, piped, from a fresh interpreter: ``mla-watch serve`` (seconds until
uvicorn listens, until the log line that says it generates, and the first completion's answer after it),
``routing`` and ``baseline`` (their 64 default samples), ``check``, ``rules export --fleet``, and ``demo
--no-live`` (its own summary's times for each step). ``routing`` runs a second time with
``OMP_NUM_THREADS=2``, torch's default on 2 cores: the ratio of the two is what one intra-op thread for the
bundled model saves (``cli_startup.one_thread_for_the_bundled_model``). Printed: each command's wall time,
the load average before and after (on a shared machine the other work is part of what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness.support import end_process, free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mla_watch.cli"]
STEPS = ("serve", "routing", "baseline", "check", "rules_export", "demo")


def environment(**extra: str) -> dict[str, str]:
    """This process' environment without mla_watch's settings (a new user has none) nor a thread count."""
    keep = {
        key: value for key, value in os.environ.items() if not key.startswith("MLA_WATCH_") and key != "OMP_NUM_THREADS"
    }
    return {**keep, **extra}


def timed(args: list[str], *, fails: bool = False, **extra: str) -> tuple[float, subprocess.CompletedProcess]:
    """Seconds ``mla-watch ARGS`` took; a command that fails stops the run unless ``fails`` (then it is reported)."""
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=1800, cwd=ROOT, env=environment(**extra), check=False
    )
    if done.returncode != 0 and not fails:
        raise SystemExit(f"mla-watch {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.monotonic() - started, done


def serve(state: Path) -> dict[str, float]:
    """Seconds from the command to uvicorn listening, to the line saying it generates, and to the first answer."""
    port = free_port()
    started = time.monotonic()
    process = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--state-dir", str(state)],
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    figures: dict[str, float] = {}
    try:
        for line in process.stderr:
            if "Uvicorn running on" in line:
                figures["listening_s"] = time.monotonic() - started
            if "ready: the model generates" in line:
                figures["ready_s"] = time.monotonic() - started
                break
        if "ready_s" not in figures:
            raise SystemExit(f"mla-watch serve exited {process.wait(30)} before it said it generates")
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "def f(", "max_tokens": 16}, timeout=120
        )
        answer.raise_for_status()
        figures["first_answer_s"] = time.monotonic() - started
    finally:
        end_process(process, grace=60, kill_wait=30)
    return figures


def measure(skip: set[str], work: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {"cpus": os.cpu_count(), "load_before": os.getloadavg()}
    if "serve" not in skip:
        figures["serve"] = serve(work / "state")
        print(f"  serve: {figures['serve']}", flush=True)
    if "routing" not in skip:
        figures["routing_s"], _ = timed(["routing"])
        print(f"  routing: {figures['routing_s']:.1f} s", flush=True)
        figures["routing_2_threads_s"], _ = timed(["routing"], OMP_NUM_THREADS="2")
        print(f"  routing, OMP_NUM_THREADS=2: {figures['routing_2_threads_s']:.1f} s", flush=True)
    if "baseline" not in skip:
        figures["baseline_s"], _ = timed(["baseline", "--out", str(work / "baseline.json")])
        print(f"  baseline: {figures['baseline_s']:.1f} s", flush=True)
    if "check" not in skip:
        figures["check_s"], _ = timed(["check"])
        print(f"  check: {figures['check_s']:.1f} s", flush=True)
    if "rules_export" not in skip:
        figures["rules_export_s"], _ = timed(["rules", "export", "--fleet", "--out", str(work / "fleet.yml")])
        print(f"  rules export --fleet: {figures['rules_export_s']:.1f} s", flush=True)
    if "demo" not in skip:
        figures["demo_s"], done = timed(["demo", "--no-live", "--out", str(work / "demo")], fails=True)
        summary = json.loads((work / "demo" / "summary.json").read_text())
        figures["demo_ok"], figures["demo_events_s"] = summary["ok"], summary["events_seconds"]
        figures["demo_job"] = summary["job"]
        print(f"  demo: {figures['demo_s']:.1f} s, exit {done.returncode}, {figures['demo_events_s']}", flush=True)
    figures["load_after"] = os.getloadavg()
    return figures


def report(figures: dict[str, Any]) -> None:
    load = lambda key: " / ".join(f"{value:.1f}" for value in figures[key])  # noqa: E731
    print(
        f"\n{figures['cpus']} CPUs; load average (1, 5, 15 min) before {load('load_before')}, "
        f"after {load('load_after')}"
    )
    rows = []
    if "serve" in figures:
        serve_figures = figures["serve"]
        rows.append(("mla-watch serve: listening", serve_figures["listening_s"]))
        rows.append(("mla-watch serve: 'ready: the model generates'", serve_figures["ready_s"]))
        rows.append(("mla-watch serve: first 16-token completion answered", serve_figures["first_answer_s"]))
    for key, label in (
        ("routing_s", "mla-watch routing (64 samples)"),
        ("routing_2_threads_s", "mla-watch routing, OMP_NUM_THREADS=2"),
        ("baseline_s", "mla-watch baseline (64 samples)"),
        ("check_s", "mla-watch check"),
        ("rules_export_s", "mla-watch rules export --fleet"),
        ("demo_s", "mla-watch demo --no-live"),
    ):
        if key in figures:
            rows.append((label, figures[key]))
    width = max(len(label) for label, _ in rows)
    for label, seconds in rows:
        print(f"  {label:<{width}}  {seconds:6.1f} s")
    if "routing_s" in figures:
        print(f"  one intra-op thread / two, routing: x{figures['routing_s'] / figures['routing_2_threads_s']:.3f}")
    if "demo_events_s" in figures:
        print(
            f"  demo {'closed the loop' if figures['demo_ok'] else 'FAILED'}; its steps (s after its start): "
            + ", ".join(f"{step} {seconds:g}" for step, seconds in figures["demo_events_s"].items())
        )
        timings = (figures["demo_job"] or {}).get("timings") or {}
        if timings:
            print("  demo's re-tune job: " + ", ".join(f"{key} {value}" for key, value in timings.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave a command out (repeat)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    skip = set(args.skip)
    with tempfile.TemporaryDirectory(prefix="mla-watch-first-hour-") as directory:
        figures = measure(skip, Path(directory))
    report(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
