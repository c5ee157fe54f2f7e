"""What one alert evaluation costs: 60 layers x 2 routers x 4 business lines x 6 rules.

    python -m bench.rule_eval                 # 200 evaluations
    python -m bench.rule_eval --evaluations 1000
    python -m bench.rule_eval --json figures.json   # also write the figures as JSON

Builds a RuleSet of six rules that all select every router (2,880 instance checks per
evaluation) and 480 statistics records, then times ``AlertEngine.evaluate`` with
``time.process_time`` (CPU time, so a busy shared machine disturbs it less than wall time).
Two scenarios: ``steady`` (normal operation: a tenth of the routers persistently firing, the
rest healthy, no transitions) and ``churn`` (a worst case: hundreds of instances fire and
resolve in every evaluation, each rendering annotations and building actions). Prints the
median CPU time per evaluation (and the spread) against the goal of 5 ms. No state file by
default; ``--state`` adds runs that persist to a temporary file as the server does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mla_watch.alerting.alert_engine import AlertEngine
from mla_watch.alerting.vocabulary import Rule, RuleSet, Selector
from mla_watch.routing.routers import RouterInfo
from mla_watch.routing.stats import RoutingStats
from mla_watch.routing.windows import RouterStats

GOAL_MS = 5.0
LINES = ("customer_service", "code_assistant", "doc_summary", "default")


def rules() -> RuleSet:
    every = Selector()
    return RuleSet(
        rules=(
            Rule(
                "RoutingEntropyLow",
                "entropy_bits",
                every,
                below=5.0,
                resolve_above=5.5,
                for_seconds=60,
                keep_firing_for_seconds=120,
                severity="critical",
                actions=("notify", "retune"),
                annotations={"summary": "{router} layer {layer}: {value:.2f} bits < {threshold}"},
            ),
            Rule("RoutingEntropyHigh", "entropy_bits", every, above=6.5, resolve_below=6.3),
            Rule("RoutingMaxViolation", "max_violation", every, above=0.5, resolve_below=0.3, for_seconds=30),
            Rule("RoutingDeadExperts", "dead_slots", every, above=2, resolve_below=0),
            Rule("RoutingDrift", "js_divergence", every, above=0.1, resolve_below=0.05, for_seconds=30),
            Rule("RoutingNormalizedLow", "normalized_entropy", every, below=0.8, resolve_above=0.85),
        ),
        receivers={},
    )


def records(step: int, scenario: str) -> list[RouterStats]:
    """480 records. ``steady``: one (router, line) in ten is persistently sick (firing on three
    rules), the rest healthy, values jittering without crossing a threshold: no transitions.
    ``churn``: every record cycles breached (3 steps) / band (2) / healthy (5) with a per-record
    phase, so that most evaluations fire and resolve hundreds of instances (a worst case)."""
    out = []
    for layer in range(60):
        for name, kind in (
            (f"model.layers.{layer}.mlp.gate", "expert"),
            (f"model.layers.{layer}.self_attn.indexer", "indexer"),
        ):
            for i, line in enumerate(LINES):
                jitter = 0.01 * (step % 3)
                if scenario == "steady":
                    sick = (layer + i) % 10 == 0
                    entropy = (4.6 if sick else 5.9) + jitter
                    maxvio, dead, drift = (0.9 if sick else 0.1) + jitter, 0, 0.02 + jitter
                else:
                    phase = (step + layer + i) % 10  # 0-2 breached, 3-4 band, 5-9 healthy
                    entropy = 4.6 if phase < 3 else 5.2 if phase < 5 else 5.9
                    maxvio, dead, drift = 0.1 + phase / 10, 3 if phase == 0 else 0, 0.02 * phase
                stats = RoutingStats(
                    kind=kind,
                    num_slots=64,
                    top_k=6,
                    tokens=4096,
                    selections=6 * 4096,
                    entropy_bits=entropy,
                    floor_bits=2.585,
                    ceiling_bits=6.0,
                    normalized_entropy=(entropy - 2.585) / 3.415,
                    max_violation=maxvio,
                    dead_slots=dead,
                    js_divergence=drift,
                    locality=0.5 if kind == "indexer" else None,
                    min_tokens=256,
                    too_small=False,
                )
                out.append(RouterStats(RouterInfo(name, layer, kind, 64, 6), line, stats))
    return out


def run(scenario: str, evaluations: int, state: bool) -> dict[str, Any]:
    now = [1_700_000_000.0]
    with tempfile.TemporaryDirectory() as tmp:
        engine = AlertEngine(rules(), clock=lambda: now[0], state_path=Path(tmp) / "alerts.json" if state else None)
        batches = [records(step, scenario) for step in range(10)]
        for batch in batches * 2:  # warm the selector cache; let `for` periods elapse in the steady scenario
            now[0] += 60.0
            engine.evaluate(batch)
        times, actions = [], 0
        for n in range(evaluations):
            now[0] += 15.0
            batch = batches[n % len(batches)]
            start = time.process_time()
            actions += len(engine.evaluate(batch))
            times.append(time.process_time() - start)
        firing = sum(engine.firing_counts().values())
    ms = sorted(t * 1000 for t in times)
    median = statistics.median(ms)
    checks = len(batches[0]) * len(rules().rules)
    print(
        f"[{scenario}, state file: {'yes' if state else 'no'}] {checks} instance checks per evaluation, "
        f"{evaluations} evaluations, {actions / evaluations:.0f} actions per evaluation, {firing} firing at the end"
    )
    print(
        f"  median CPU time per evaluation: {median:.2f} ms (min {ms[0]:.2f}, p90 {ms[int(0.9 * len(ms))]:.2f}, "
        f"max {ms[-1]:.2f}); goal < {GOAL_MS:.0f} ms: {'met' if median < GOAL_MS else 'NOT met'}"
    )
    return {
        "scenario": scenario,
        "state_file": state,
        "checks": checks,
        "evaluations": evaluations,
        "actions_per_evaluation": actions / evaluations,
        "firing_at_end": firing,
        "median_ms": median,
        "min_ms": ms[0],
        "p90_ms": ms[int(0.9 * len(ms))],
        "max_ms": ms[-1],
        "goal_ms": GOAL_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluations", type=int, default=200)
    parser.add_argument("--scenario", choices=("steady", "churn", "both"), default="both")
    parser.add_argument("--state", action="store_true", help="also persist state to a temporary file, as served")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    runs = []
    for scenario in ("steady", "churn") if args.scenario == "both" else (args.scenario,):
        runs.append(run(scenario, args.evaluations, state=False))
        if args.state:
            runs.append(run(scenario, args.evaluations, state=True))
    if args.json:
        figures = {"bench": "rule_eval", "args": vars(args), "runs": runs}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
