"""How often healthy traffic pages anyone, and how fast each fault reaches on-call.

    python -m bench.detection                          # about ten minutes on 2 CPU cores
    python -m bench.detection --healthy-tokens 40000   # longer healthy replays
    python -m bench.detection --json figures.json      # also write the figures as JSON
    python -m bench.detection --scenario drift         # only the slow drift (about a minute)

The replays are harness/detection_replay.py's (shared with tests/test_detection.py): each starts afresh
as `mla-watch serve` does, with the bundled model under the probe's real hooks, windows of 4096 tokens
per line, healthy baselines learned per router and line at 2048 tokens (trusted after the start-up
health check), the shipped rules with every `for:` at 0 s (any breach pages), judged after every
request, and pages delivered by the real outbox to a real webhook receiver on loopback.

Healthy replays (every page is a false page): the four lines mixed, each line alone, low-diversity
traffic (three prompts per line, repeated) and chat-sized requests (the first minutes after start,
when every window is small). For each it prints the pages and how close the baseline rules came
(the highest MaxVio over its healthy value, JS divergence, dead experts beyond the healthy count).

Faults, after a healthy warm-up that learns every line's baseline: a collapse (+10 on the correction
bias of six experts: RoutingEntropyLow), a hotspot (one expert takes every token: ExpertHotspot,
which entropy misses), dead experts (eight experts get none: DeadExperts). Each prints the tokens
from the onset to its page, against the budget the tests hold it to.

The drift scenario (harness/drift_replay.py, shared with tests/test_trend_drift.py) simulates days
of one line's traffic with an injectable clock: the correction bias of four experts of one router
rises a little every simulated hour until its entropy sinks below RoutingEntropyLow's 5.0 bits.
It reports how many hours ahead the trend rule RoutingEntropyFalling warned, and the trend alerts
of a healthy replay of the same length (false alarms). Rule `for:` durations are kept: time is
simulated.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mla_watch
from harness.detection_replay import FAULTS, fault_replay, healthy_replay  # the tests' replays, shared
from harness.drift_replay import DRIFTING_ROUTER  # the tests' simulated days of drift, shared
from harness.drift_replay import replay as drift_replay
from mla_watch.models import corpus

TREND_ALERTS = ("RoutingEntropyFalling", "RoutingCollapseForecast")


def drift_scenario(model, days: float, drift_per_hour: float) -> dict:
    """Hours of warning before the threshold rule, and false trend alarms over a healthy replay."""
    started = time.perf_counter()
    drift = drift_replay(model, hours=days * 24, drift_per_hour=drift_per_hour)
    healthy = drift_replay(model, hours=days * 24, drift_per_hour=0.0)
    low, falling = drift.first("RoutingEntropyLow"), drift.first("RoutingEntropyFalling")
    false_trend = [f for f in healthy.firings if f.alertname in TREND_ALERTS]
    figures = {
        "drift_days": days,
        "drift_per_hour": drift_per_hour,
        "drift_router": DRIFTING_ROUTER,
        "falling_at_hours": falling and falling.hours,
        "low_at_hours": low and low.hours,
        "warning_hours": (low.hours - falling.hours) if low and falling else None,
        "healthy_false_trend_alarms": len(false_trend),
        "drift_seconds": time.perf_counter() - started,
    }
    start_bits, end_bits = drift.entropy[0][1], drift.entropy[-1][1]
    print(
        f"slow drift of {DRIFTING_ROUTER} (+{drift_per_hour} correction bias on 4 experts every simulated hour, "
        f"{days:g} simulated days, {start_bits:.2f} -> {end_bits:.2f} bits):"
    )
    if falling is None or low is None:
        print(
            f"  RoutingEntropyFalling at {falling and round(falling.hours, 1)} h, RoutingEntropyLow at "
            f"{low and round(low.hours, 1)} h: no warning ahead measured"
        )
    else:
        print(
            f"  RoutingEntropyFalling warned at {falling.hours:.1f} h, RoutingEntropyLow paged at {low.hours:.1f} h: "
            f"{low.hours - falling.hours:.1f} hours of warning ({falling.summary})"
        )
    print(f"  healthy replay of the same length: false trend alarms: {len(false_trend)} (goal: 0)")
    for alarm in false_trend[:5]:
        print(f"    {alarm.alertname} {alarm.router} at {alarm.hours:.1f} h: {alarm.summary}")
    print(f"  ({figures['drift_seconds']:.0f} s for both replays)")
    return figures


HEALTHY_KINDS = ("mixed", *corpus.DOMAINS, "low_diversity", "short")


def healthy_scenarios(model, tokenizer, tokens: int) -> list[dict]:
    figures = []
    for kind in HEALTHY_KINDS:
        replay = healthy_replay(model, tokenizer, kind, tokens)
        figures.append(replay.as_dict())
        peaks = replay.peaks
        closest = (
            f"closest: MaxVio {peaks['max_violation_ratio']:.2f} x healthy (pages at 2), JS "
            f"{peaks['js_divergence']:.4f} bits (0.05), dead beyond healthy "
            f"{peaks['dead_slots_above_healthy']:g} (4)"
            if peaks
            else "no window judged against a baseline"
        )
        print(
            f"healthy {kind}: {replay.tokens} tokens, {replay.requests} requests, {replay.baselines} baselines "
            f"learned; false pages: {len(replay.pages)} (goal: 0); {closest}"
        )
        for page in replay.pages[:5]:
            print(f"    {page.alertname} {page.router} {page.business_line}: {page.summary}")
    return figures


def fault_scenarios(model, tokenizer) -> list[dict]:
    figures = []
    for fault in FAULTS:
        result = fault_replay(model, tokenizer, fault, limit_tokens=fault.within_tokens * 2)
        figures.append(result)
        if not result["paged"]:
            print(
                f"fault {fault.name} on {fault.router}: {fault.alertname} NOT paged within "
                f"{fault.within_tokens * 2} tokens"
            )
            continue
        print(
            f"fault {fault.name} on {fault.router} ({fault.note}): {fault.alertname} paged "
            f"{result['tokens_after_onset']} tokens after the onset (budget {fault.within_tokens}), cause "
            f"{result['cause']}; lowest "
            f"entropy of its lines then {result['entropy_bits_then']:.3f} bits; its pages: "
            f"{', '.join(result['other_pages'])}; false pages before the onset: "
            f"{result['false_pages_before_onset']}"
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("all", "healthy", "faults", "drift"), default="all")
    parser.add_argument("--drift-days", type=float, default=4.0)
    parser.add_argument("--drift-per-hour", type=float, default=0.003)
    parser.add_argument("--healthy-tokens", type=int, default=24000, help="tokens of each healthy replay")
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    figures: dict = {"bench": "detection", "args": vars(args)}

    def write_json() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")

    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    if args.scenario in ("all", "drift"):
        figures["drift"] = drift_scenario(model, args.drift_days, args.drift_per_hour)
    if args.scenario in ("all", "healthy"):
        figures["healthy"] = healthy_scenarios(model, tokenizer, args.healthy_tokens)
    if args.scenario in ("all", "faults"):
        figures["faults"] = fault_scenarios(model, tokenizer)
    write_json()


if __name__ == "__main__":
    main()
