"""How fast a router collapse reaches on-call, and how often healthy traffic pages anyone.

    python bench/detection.py                          # about five minutes on 2 CPU cores
    python bench/detection.py --healthy-tokens 40000   # a longer healthy replay
    python bench/detection.py --json figures.json      # also write the figures as JSON
    python bench/detection.py --scenario drift         # only the slow drift (about a minute)

Replays held-out traffic of all four business lines through the bundled model with the probe
attached (rolling windows of 512 tokens per line), evaluates the shipped rules (rules/) after
every request, and delivers notifications through the real outbox to a real webhook receiver
on loopback. First a long healthy replay (every page is a false alarm); then a collapse is
injected into one MoE layer (+10 on the correction bias of six experts) and the replay goes on
until the receiver holds the RoutingEntropyLow page for that layer. Rule `for:` durations are
scaled to the replay (0 s), since the replay runs faster than wall-clock traffic would.

The drift scenario (tests/drift_replay.py, shared with tests/test_trend_drift.py) simulates days
of one line's traffic with an injectable clock: the correction bias of four experts of one router
rises a little every simulated hour until its entropy sinks below RoutingEntropyLow's 5.0 bits.
It reports how many hours ahead the trend rule RoutingEntropyFalling warned, and the trend alerts
of a healthy replay of the same length (false alarms). Rule `for:` durations are kept: time is
simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from drift_replay import DRIFTING_ROUTER  # the tests' simulated days of drift, shared
from drift_replay import replay as drift_replay
from receivers import running_receiver  # the tests' loopback webhook receiver

import mla_watch
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.alerting.service import AlertService
from mla_watch.models import corpus

RULES = Path(__file__).resolve().parents[1] / "rules"
COLLAPSED_ROUTER = "model.layers.2.mlp.gate"


def replay(model, tokenizer, probe, service, samples, receiver, stop_when=None):
    """Run samples through the model; evaluate after each; return (tokens, seconds, stopped)."""
    tokens, started = 0, time.perf_counter()
    for line, text in samples:
        ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]][:256]
        with torch.no_grad(), probe.attribute(line):
            model(input_ids=torch.tensor([ids]))
        tokens += len(ids)
        probe.collect()
        service.evaluate_once()
        service.dispatcher.run_once()
        if stop_when is not None and stop_when(receiver):
            return tokens, time.perf_counter() - started, True
    return tokens, time.perf_counter() - started, False


def pages(receiver, router: str | None = None) -> list[dict]:
    return [alert for request in list(receiver.requests) for alert in request.json().get("alerts", [])
            if alert["status"] == "firing" and (router is None or alert["labels"].get("router") == router)]


TREND_ALERTS = ("RoutingEntropyFalling", "RoutingCollapseForecast")


def drift_scenario(model, days: float, drift_per_hour: float) -> dict:
    """Hours of warning before the threshold rule, and false trend alarms over a healthy replay."""
    started = time.perf_counter()
    drift = drift_replay(model, hours=days * 24, drift_per_hour=drift_per_hour)
    healthy = drift_replay(model, hours=days * 24, drift_per_hour=0.0)
    low, falling = drift.first("RoutingEntropyLow"), drift.first("RoutingEntropyFalling")
    false_trend = [f for f in healthy.firings if f.alertname in TREND_ALERTS]
    figures = {"drift_days": days, "drift_per_hour": drift_per_hour, "drift_router": DRIFTING_ROUTER,
               "falling_at_hours": falling and falling.hours, "low_at_hours": low and low.hours,
               "warning_hours": (low.hours - falling.hours) if low and falling else None,
               "healthy_false_trend_alarms": len(false_trend), "drift_seconds": time.perf_counter() - started}
    start_bits, end_bits = drift.entropy[0][1], drift.entropy[-1][1]
    print(f"slow drift of {DRIFTING_ROUTER} (+{drift_per_hour} correction bias on 4 experts every simulated hour, "
          f"{days:g} simulated days, {start_bits:.2f} -> {end_bits:.2f} bits):")
    if falling is None or low is None:
        print(f"  RoutingEntropyFalling at {falling and round(falling.hours, 1)} h, RoutingEntropyLow at "
              f"{low and round(low.hours, 1)} h: no warning ahead measured")
    else:
        print(f"  RoutingEntropyFalling warned at {falling.hours:.1f} h, RoutingEntropyLow paged at {low.hours:.1f} h: "
              f"{low.hours - falling.hours:.1f} hours of warning ({falling.summary})")
    print(f"  healthy replay of the same length: false trend alarms: {len(false_trend)} (goal: 0)")
    for alarm in false_trend[:5]:
        print(f"    {alarm.alertname} {alarm.router} at {alarm.hours:.1f} h: {alarm.summary}")
    print(f"  ({figures['drift_seconds']:.0f} s for both replays)")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("all", "collapse", "drift"), default="all")
    parser.add_argument("--drift-days", type=float, default=4.0)
    parser.add_argument("--drift-per-hour", type=float, default=0.003)
    parser.add_argument("--healthy-tokens", type=int, default=20000)
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    figures: dict = {"bench": "detection", "args": vars(args), "collapsed_router": COLLAPSED_ROUTER}

    def write_json() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")

    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    if args.scenario in ("all", "drift"):
        figures["drift"] = drift_scenario(model, args.drift_days, args.drift_per_hour)
        if args.scenario == "drift":
            write_json()
            return
    probe = mla_watch.attach(model, window_tokens=512)
    per_domain = args.healthy_tokens // (150 * len(corpus.DOMAINS)) + 1
    # The corpus domains stand for the four business lines: chat, code, SQL, summaries.
    healthy = corpus.generate_mixed(per_domain * len(corpus.DOMAINS), seed=777)
    faulty = corpus.generate_mixed(400, seed=778)

    with running_receiver() as receiver, tempfile.TemporaryDirectory() as state:
        os.environ["MLA_WATCH_ONCALL_URL"] = receiver.url + "/hook"
        rules = load_rules_dir(RULES)
        rules = replace(rules, rules=tuple(replace(rule, for_seconds=0.0) for rule in rules.rules))
        records = lambda: [r for line in [None, *probe.windows.business_lines]  # noqa: E731
                           for r in probe.windows.stats(line)]
        service = AlertService(rules, Path(state), records=records)

        tokens, seconds, _ = replay(model, tokenizer, probe, service, healthy, receiver)
        false_alarms = pages(receiver)
        print(f"healthy replay: {tokens} tokens of 4 business lines in {seconds:.1f} s; "
              f"false alarms: {len(false_alarms)} (goal: 0)")
        for alert in false_alarms[:5]:
            print(f"  {alert['labels']['alertname']} {alert['labels'].get('router')} "
                  f"{alert['labels'].get('business_line')}: {alert['annotations'].get('summary')}")
        figures.update(healthy_tokens=tokens, healthy_seconds=seconds, false_alarms=len(false_alarms),
                       false_alarm_alerts=[{"alertname": a["labels"]["alertname"], "router": a["labels"].get("router"),
                                            "business_line": a["labels"].get("business_line")}
                                           for a in false_alarms])

        gate = dict(model.named_modules())[COLLAPSED_ROUTER]
        with torch.no_grad():
            gate.e_score_correction_bias[:6] += 10.0
        onset_requests = len(receiver.requests)
        tokens, seconds, detected = replay(
            model, tokenizer, probe, service, faulty, receiver,
            stop_when=lambda rx: any(a["labels"]["alertname"] == "RoutingEntropyLow"
                                     for a in pages(rx, COLLAPSED_ROUTER)),
        )
        figures.update(detected=detected, tokens_after_onset=tokens, seconds_after_onset=seconds)
        if not detected:
            print(f"collapse of {COLLAPSED_ROUTER}: NOT detected within {tokens} tokens")
            write_json()
            return
        first = next(a for a in pages(receiver, COLLAPSED_ROUTER) if a["labels"]["alertname"] == "RoutingEntropyLow")
        others = {a["labels"]["alertname"] for a in pages(receiver, COLLAPSED_ROUTER)}
        print(f"collapse of {COLLAPSED_ROUTER}: the webhook received RoutingEntropyLow "
              f"({first['labels']['business_line']}) {tokens} tokens and {seconds:.2f} s after the onset "
              f"(all lines together; rolling windows of 512 tokens per line)")
        print(f"  pages for that router so far: {sorted(others)}; requests to the receiver since onset: "
              f"{len(receiver.requests) - onset_requests}")
        figures.update(first_page_business_line=first["labels"]["business_line"], router_pages=sorted(others),
                       receiver_requests_since_onset=len(receiver.requests) - onset_requests)
        write_json()


if __name__ == "__main__":
    main()
