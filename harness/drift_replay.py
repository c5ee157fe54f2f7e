"""Days of simulated traffic through the bundled model, with a slow routing drift or none, judged by the rules.

Shared by tests/test_trend_drift.py and bench/detection.py. The model runs with the probe's real
hooks; time is simulated (one batch per ``step_minutes``, an injectable clock for the alert
engine, no sleeping). Every simulated hour the correction bias of one router is set afresh to
its trained value plus ordinary noise (DeepSeek's balancing nudges it all the time) plus, in a
drift, ``drift_per_hour`` x hours on a few experts: those experts win a little more traffic each
hour and the router's entropy sinks, over days, from healthy to below RoutingEntropyLow's 5.0 bits.
The records go to an :class:`~mla_watch.alerting.alert_engine.AlertEngine` with the shipped rules and to
the sidecar's durable routing history (:class:`~mla_watch.history.store.HistoryStore`, in a
temporary directory, on the same simulated clock), which is the engine's trend source as in
``mla-watch serve``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mla_watch
from harness.helpers import FakeClock
from mla_watch.alerting.alert_engine import AlertEngine
from mla_watch.alerting.rules import load_rules_dir
from mla_watch.alerting.vocabulary import RuleSet
from mla_watch.history.store import HISTORY_FILE, HistoryStore
from mla_watch.shipped import SHIPPED_RULES

__all__ = ["DRIFTING_ROUTER", "LINE", "Firing", "Replay", "replay", "shipped_rules"]

DRIFTING_ROUTER = "model.layers.2.mlp.gate"
LINE = "code_assistant"
START = 1_700_000_000.0


@dataclass(frozen=True)
class Firing:
    alertname: str
    router: str
    business_line: str
    hours: float  # simulated hours since the replay started
    summary: str


@dataclass
class Replay:
    hours: float
    steps: int
    firings: list[Firing] = field(default_factory=list)
    entropy: list[tuple[float, float]] = field(default_factory=list)  # (hours, the drifting router's bits)

    def first(self, alertname: str, router: str = DRIFTING_ROUTER) -> Firing | None:
        return next((f for f in self.firings if f.alertname == alertname and f.router == router), None)


def shipped_rules() -> RuleSet:
    return load_rules_dir(SHIPPED_RULES, environ={"MLA_WATCH_ONCALL_URL": "http://127.0.0.1:9/hook"})


@contextmanager
def _one_thread() -> Iterator[None]:
    # A batch this small runs fastest on one thread, and the test shares the CPU with others.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def replay(
    model: torch.nn.Module,
    *,
    hours: float,
    drift_per_hour: float,
    experts: int = 4,
    noise: float = 0.01,
    step_minutes: float = 20.0,
    batch: tuple[int, int] = (16, 16),
    window_tokens: int = 1024,
    seed: int = 0,
    rules: RuleSet | None = None,
) -> Replay:
    """Replay ``hours`` of simulated traffic of one business line; the model's biases are restored after."""
    gate = dict(model.named_modules())[DRIFTING_ROUTER]
    trained = gate.e_score_correction_bias.detach().clone()
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    clock = FakeClock(START)
    out = Replay(hours=hours, steps=int(hours * 60 / step_minutes))
    state = tempfile.TemporaryDirectory(prefix="mla-watch-drift-")
    history = HistoryStore(
        Path(state.name) / HISTORY_FILE,
        interval_seconds=step_minutes * 60.0,
        span_seconds=max(3600.0, step_minutes * 60.0),
        clock=clock,
    )
    engine = AlertEngine(rules if rules is not None else shipped_rules(), clock=clock, trend_source=history)
    probe = mla_watch.attach(model, window_tokens=window_tokens)
    hour_set = -1
    try:
        with _one_thread(), torch.no_grad():
            for step in range(out.steps):
                elapsed = step * step_minutes / 60.0
                if int(elapsed) != hour_set:
                    hour_set = int(elapsed)
                    bias = trained + noise * torch.randn(trained.shape, generator=generator)
                    bias[:experts] += drift_per_hour * hour_set
                    gate.e_score_correction_bias.copy_(bias)
                with probe.attribute(LINE):
                    model(input_ids=torch.randint(3, vocab, batch, generator=generator))
                probe.collect()
                clock.now = START + elapsed * 3600.0
                records = [*probe.router_stats(None), *probe.router_stats(LINE)]
                history.record(records)
                for action in engine.evaluate(records):
                    if action.kind == "notify" and action.alert.status == "firing":
                        labels = action.alert.labels
                        out.firings.append(
                            Firing(
                                labels["alertname"],
                                labels["router"],
                                labels["business_line"],
                                elapsed,
                                action.alert.annotations.get("summary", ""),
                            )
                        )
                out.entropy.extend(
                    (elapsed, float(r.stats.entropy_bits))
                    for r in records
                    if r.router.name == DRIFTING_ROUTER and r.business_line == LINE
                )
    finally:
        gate.e_score_correction_bias.copy_(trained)
        probe.detach()
        history.close()
        state.cleanup()
    return out
