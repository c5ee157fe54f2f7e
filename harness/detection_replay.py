"""Replays of the bundled model's traffic judged by the shipped rules: healthy ones must page no one, faults must page.

Shared by tests/test_detection.py and bench/detection.py. Each replay is a fresh start, as after
``mla-watch serve``: the probe's real hooks on the bundled model, rolling windows of 4096 tokens per
line (serve's default), a healthy baseline learned per router and line once a window holds 2048
tokens (serve's default; learning trusted because the model passed the start-up health check, which
runs here too), the shipped rules with every ``for:`` set to 0 s (a replay runs faster than traffic:
any breach pages at once, the harshest setting), judged after every request, and pages delivered by
the real outbox to a real webhook receiver on loopback. A page is a firing alert the receiver got; its
cause is judged from the shipped reference prompts, read through the model at start and whenever an alert
goes pending.

The business lines are the corpus' four domains (chat, code, SQL, summaries). Faults are injected on
the correction bias of one router, DeepSeek's ``e_score_correction_bias`` (what a bad checkpoint or a
runaway balancer changes), after a healthy warm-up long enough for every line's baseline.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import mla_watch
from harness.receivers import running_receiver
from mla_watch.alerting.alert_service import AlertService
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.models import corpus
from mla_watch.references.prober import ReferenceProber
from mla_watch.references.prompts import load_reference_dir
from mla_watch.references.readers import ModelReader
from mla_watch.references.readings import ReferenceBaselines
from mla_watch.routing.baselines import DEFAULT_LEARN_TOKENS, Baselines
from mla_watch.routing.windows import RouterStats
from mla_watch.shipped import SHIPPED_REFERENCES, SHIPPED_RULES

__all__ = [
    "FAULTS",
    "Fault",
    "Page",
    "Replay",
    "Watched",
    "fault_replay",
    "healthy_samples",
    "healthy_trusted",
    "watched",
]

WINDOW_TOKENS = 4096
MAX_TOKENS = 256  # per request
WARM_UP_TOKENS_PER_LINE = 2 * DEFAULT_LEARN_TOKENS  # every line's baselines learned before a fault


@dataclass(frozen=True)
class Page:
    alertname: str
    router: str
    business_line: str
    tokens: int  # replayed before it reached the receiver, from the replay's start
    summary: str
    cause: str = ""  # model, traffic or undetermined: the label the page carries


class ReadAtOnce(ReferenceProber):
    """The reference prompts read as serve reads them, but at once when an alert asks (a replay runs faster
    than traffic, and judges after every request): no thread."""

    def request(self, business_line: str | None, since: float) -> None:
        self.read_now([reference.name for reference in self._sets().for_line(business_line)])

    def read_soon(self, names: set[str]) -> bool:
        self.read_now(sorted(names))
        return True


@dataclass
class Replay:
    name: str
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    pages: list[Page] = field(default_factory=list)
    baselines: int = 0  # series with a learned baseline at the end
    peaks: dict[str, float] = field(default_factory=dict)  # closest approach to each baseline rule

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "requests": self.requests,
            "seconds": round(self.seconds, 2),
            "pages": len(self.pages),
            "baselines": self.baselines,
            "peaks": {key: round(value, 4) for key, value in self.peaks.items()},
            "paged": [
                {"alertname": p.alertname, "router": p.router, "business_line": p.business_line, "tokens": p.tokens}
                for p in self.pages
            ],
        }


_HEALTH: dict[int, str | None] = {}


def healthy_trusted(model: torch.nn.Module, tokenizer: Any, rules: Any) -> str | None:
    """The start-up health check serve runs on router version 0: ``None`` when it passed, else why not."""
    from mla_watch.retune.health import startup_health

    if id(model) not in _HEALTH:
        health = startup_health(model, tokenizer, rules.rules)
        _HEALTH[id(model)] = None if health["passed"] else str(health["reason"])
    return _HEALTH[id(model)]


class Watched:
    """The bundled model watched as ``serve`` watches it; :meth:`send` replays samples through it."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        state: Path,
        receiver: Any,
        learn_tokens: int = DEFAULT_LEARN_TOKENS,
    ) -> None:
        self.model, self.tokenizer, self.receiver = model, tokenizer, receiver
        rules = load_rules_dir(SHIPPED_RULES)
        self.rules = replace(
            rules,
            rules=tuple(replace(rule, for_seconds=0.0, keep_firing_for_seconds=0.0) for rule in rules.rules),
            receivers={
                name: replace(receiver, group_wait_seconds=0.0, group_interval_seconds=0.0)
                for name, receiver in rules.receivers.items()
            },
        )
        self.probe = mla_watch.attach(model, window_tokens=WINDOW_TOKENS)
        self.baselines = Baselines(learn_tokens=learn_tokens)
        self.baselines.trust(healthy_trusted(model, tokenizer, rules))
        self.probe.windows.baselines = self.baselines
        references = load_reference_dir(SHIPPED_REFERENCES)
        self.prober = ReadAtOnce(
            lambda: references,
            ModelReader(model, tokenizer, threading.Lock()),
            ReferenceBaselines(),
            trusted=lambda reading: self.baselines.not_learning,
        )
        self.prober.read_now()  # at start, as serve does: each set's healthy baseline
        self.service = AlertService(self.rules, state, records=self._records, causes=self.prober)
        self.tokens = 0
        self.requests = 0
        self._pages: list[Page] = []
        self._seen = 0
        self.peaks: dict[str, float] = {}  # the highest value each baseline rule's metric reached

    def _records(self) -> list[RouterStats]:
        windows = self.probe.windows
        records = [record for line in [None, *windows.business_lines] for record in windows.router_stats(line)]
        self.baselines.learn(records, excluded=self.service.engine.active_series)  # as serve learns
        for record in records:  # how close healthy traffic came to each baseline rule, for the figures
            stats, baseline = record.stats, record.baseline
            if baseline is None or stats.tokens < 1024 or stats.kind != "expert":
                continue
            healthy, peaks = baseline.values, self.peaks
            if stats.js_divergence is not None:
                peaks["js_divergence"] = max(peaks.get("js_divergence", 0.0), stats.js_divergence)
            ratio = stats.max_violation / max(healthy["max_violation"], 1e-9)
            peaks["max_violation_ratio"] = max(peaks.get("max_violation_ratio", 0.0), ratio)
            peaks["dead_slots_above_healthy"] = max(
                peaks.get("dead_slots_above_healthy", 0), stats.dead_slots - int(healthy["dead_slots"])
            )
        return records

    def send(
        self,
        samples: Sequence[tuple[str, str]],
        stop_when: Callable[[list[Page]], bool] | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> bool:
        """Replay ``samples`` (business line, text), judging after each; True once ``stop_when`` held."""
        for line, text in samples:
            ids = [self.tokenizer.bos_token_id, *self.tokenizer(text, add_special_tokens=False)["input_ids"]]
            ids = ids[:max_tokens]
            with torch.no_grad(), self.probe.attribute(line):
                self.model(input_ids=torch.tensor([ids]))
            self.tokens += len(ids)
            self.requests += 1
            self.probe.collect()
            self.service.evaluate_once()
            self.service.dispatcher.run_once()
            pages = self.pages()
            if stop_when is not None and stop_when(pages):
                return True
        return False

    def pages(self) -> list[Page]:
        """Every firing alert the receiver got so far, with the tokens replayed when it arrived."""
        requests = list(self.receiver.requests)
        for request in requests[self._seen :]:
            for alert in request.json().get("alerts", []):
                if alert["status"] == "firing":
                    labels = alert["labels"]
                    self._pages.append(
                        Page(
                            labels["alertname"],
                            labels.get("router", ""),
                            labels.get("business_line", ""),
                            self.tokens,
                            alert["annotations"].get("summary", ""),
                            labels.get("cause", ""),
                        )
                    )
        self._seen = len(requests)
        return list(self._pages)


@contextmanager
def watched(model: torch.nn.Module, tokenizer: Any) -> Iterator[Watched]:
    """A fresh start: new windows, baselines, alert state and outbox, and a receiver of its own."""
    with tempfile.TemporaryDirectory() as state, running_receiver() as receiver:
        previous = os.environ.get("MLA_WATCH_ONCALL_URL")
        os.environ["MLA_WATCH_ONCALL_URL"] = receiver.url + "/hook"
        try:
            replay = Watched(model, tokenizer, Path(state), receiver)
            try:
                yield replay
            finally:
                replay.probe.detach()
        finally:
            if previous is None:
                os.environ.pop("MLA_WATCH_ONCALL_URL", None)
            else:
                os.environ["MLA_WATCH_ONCALL_URL"] = previous


def healthy_samples(kind: str, tokens: int, seed: int = 777) -> list[tuple[str, str]]:
    """Held-out traffic of about ``tokens`` tokens: ``mixed`` (the four lines interleaved), a line alone (its
    name), ``low_diversity`` (three prompts per line, repeated), or ``short`` (chat-sized requests of the four
    lines: the first minutes after start, when every window is small)."""
    per_request = 150
    if kind == "mixed":
        return corpus.generate_mixed(max(4, tokens // per_request), seed=seed)
    if kind in corpus.DOMAINS:
        return [(kind, text) for text in corpus.generate(kind, max(1, tokens // per_request), seed=seed)]
    if kind == "low_diversity":
        prompts = [(line, text) for line in corpus.DOMAINS for text in corpus.generate(line, 3, seed=seed)]
        return [prompts[index % len(prompts)] for index in range(max(1, tokens // per_request))]
    if kind == "short":
        return [(line, text[:160]) for line, text in corpus.generate_mixed(max(4, tokens // 40), seed=seed)]
    raise ValueError(f"kind {kind!r}: expected mixed, low_diversity, short or one of {', '.join(corpus.DOMAINS)}")


def healthy_replay(model: torch.nn.Module, tokenizer: Any, kind: str, tokens: int) -> Replay:
    """A healthy replay from a fresh start: every page it gets is a false page."""
    started = time.perf_counter()
    with watched(model, tokenizer) as replay:
        replay.send(healthy_samples(kind, tokens))
        result = Replay(
            kind,
            replay.tokens,
            replay.requests,
            time.perf_counter() - started,
            replay.pages(),
            len(replay.baselines),
            dict(replay.peaks),
        )
    return result


@dataclass(frozen=True)
class Fault:
    """A damage to one router's correction bias, the alert that must page for it, and the tokens it may take."""

    name: str
    router: str
    alertname: str
    experts: tuple[int, ...]
    bias: float
    within_tokens: int  # after the onset, all lines together: the page arrives within this many
    note: str

    def inject(self, model: torch.nn.Module) -> None:
        gate = dict(model.named_modules())[self.router]
        with torch.no_grad():
            gate.e_score_correction_bias[list(self.experts)] += self.bias


# The windows hold 4096 tokens per line, so a fault must displace a good part of them before a window reads
# it; with four lines in turn that is four times as many tokens replayed.
FAULTS: tuple[Fault, ...] = (
    Fault(
        "collapse",
        "model.layers.2.mlp.gate",
        "RoutingEntropyLow",
        (0, 1, 2, 3, 4, 5),
        10.0,
        8000,
        "six experts win every token: entropy falls to log2 6 = 2.585 bits",
    ),
    Fault(
        "hotspot",
        "model.layers.3.mlp.gate",
        "ExpertHotspot",
        (7,),
        10.0,
        16000,
        "one expert takes every token; entropy stays above 5.0 bits, so only MaxVio sees it",
    ),
    Fault(
        "dead experts",
        "model.layers.1.mlp.gate",
        "DeadExperts",
        tuple(range(8, 16)),
        -10.0,
        24000,
        "eight experts get no token; entropy stays near 5.8 bits",
    ),
)


def fault_replay(model: torch.nn.Module, tokenizer: Any, fault: Fault, limit_tokens: int = 40000) -> dict[str, Any]:
    """A healthy warm-up, then ``fault``: tokens until its page, and every page before it (false ones)."""
    gate = dict(model.named_modules())[fault.router]
    saved = gate.e_score_correction_bias.detach().clone()
    started = time.perf_counter()
    try:
        with watched(model, tokenizer) as replay:
            replay.send(healthy_samples("mixed", WARM_UP_TOKENS_PER_LINE * len(corpus.DOMAINS) + 2000, seed=901))
            before = replay.pages()
            learned = len(replay.baselines)
            onset = replay.tokens
            fault.inject(model)

            def wanted(pages: Any, fault: Any = fault) -> bool:
                return any(p.alertname == fault.alertname and p.router == fault.router for p in pages)

            faulty = healthy_samples("mixed", limit_tokens, seed=902)
            paged = replay.send(faulty, stop_when=wanted)
            first = next(
                (p for p in replay.pages() if p.alertname == fault.alertname and p.router == fault.router), None
            )
            lowest = min(
                record["entropy_bits"]
                for line in [None, *replay.probe.windows.business_lines]
                for record in replay.probe.stats(line)
                if record["name"] == fault.router
            )
            return {
                "fault": fault.name,
                "router": fault.router,
                "alertname": fault.alertname,
                "note": fault.note,
                "paged": paged,
                "tokens_after_onset": None if first is None else first.tokens - onset,
                "within_tokens": fault.within_tokens,
                "false_pages_before_onset": len(before),
                "baselines_at_onset": learned,
                "summary": None if first is None else first.summary,
                "cause": None if first is None else first.cause,
                "entropy_bits_then": round(lowest, 3),  # the lowest of its lines when it paged
                "other_pages": sorted({p.alertname for p in replay.pages() if p.router == fault.router}),
                "seconds": round(time.perf_counter() - started, 1),
            }
    finally:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(saved)
