"""How fast a router collapse reaches on-call, and how often healthy traffic pages anyone.

    python bench/detection.py                          # about five minutes on 2 CPU cores
    python bench/detection.py --healthy-tokens 40000   # a longer healthy replay
    python bench/detection.py --json figures.json      # also write the figures as JSON

Replays held-out traffic of all four business lines through the bundled model with the probe
attached (rolling windows of 512 tokens per line), evaluates the shipped rules (rules/) after
every request, and delivers notifications through the real outbox to a real webhook receiver
on loopback. First a long healthy replay (every page is a false alarm); then a collapse is
injected into one MoE layer (+10 on the correction bias of six experts) and the replay goes on
until the receiver holds the RoutingEntropyLow page for that layer. Rule `for:` durations are
scaled to the replay (0 s), since the replay runs faster than wall-clock traffic would.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy-tokens", type=int, default=20000)
    parser.add_argument("--json", metavar="PATH", help="also write the measured figures to PATH as a JSON object")
    args = parser.parse_args()
    figures: dict = {"bench": "detection", "args": vars(args), "collapsed_router": COLLAPSED_ROUTER}

    def write_json() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")

    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
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
