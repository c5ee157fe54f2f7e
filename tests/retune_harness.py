"""A re-tune service on a tiny DeepSeek-V3.2 model, with captured traffic, that tests can restart."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from conftest import wait_until
from tiny_models import VOCAB, build

from mla_watch.retune.capture import TrafficCapture
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.retune.registry import RouterVersions
from mla_watch.retune.runner import Retuner
from mla_watch.retune.service import RetuneService

GATE = "model.layers.1.mlp.gate"
BIAS = f"{GATE}.e_score_correction_bias"
OTHER = "model.layers.0.mlp.gate"


def fill_capture(path: Path, line: str = "code", count: int = 160, seed: int = 0) -> TrafficCapture:
    """``count`` random prompts of 12-23 tokens: the default holds out ~680 scored tokens, enough for the gate."""
    capture = TrafficCapture(path)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        length = int(torch.randint(12, 24, (1,), generator=generator))
        capture.add(line, torch.randint(3, VOCAB, (length,), generator=generator).tolist())
    return capture


class Harness:
    """A model, its registry and capture in ``state``, and a service that can be restarted."""

    def __init__(self, state: Path, model: torch.nn.Module | None = None, **settings) -> None:
        self.state = state
        self.model = model if model is not None else build("deepseek_v32")
        self.lock = threading.Lock()
        self.capture = fill_capture(state / "capture.sqlite")
        self.settings = RetuneSettings(**{"min_samples": 8, "cooldown_seconds": 3600, **settings})
        self.outcomes: list[tuple[str, str]] = []
        self.rejected: list[tuple[JobSpec, dict]] = []
        self.changed: list[tuple[str, list[str]]] = []
        self.service: RetuneService | None = None

    def start(self) -> RetuneService:
        registry = RouterVersions(self.state / "routers")
        retuner = Retuner(model=self.model, tokenizer=SimpleNamespace(pad_token_id=0), registry=registry,
                          settings=self.settings, workdir=self.state / "work",
                          promote=lambda version: self.service.promote(version),
                          capture=self.capture, model_lock=self.lock)
        self.service = RetuneService(state_dir=self.state, settings=self.settings, retuner=retuner, registry=registry,
                                     model_lock=self.lock, on_promoted=lambda k, r: self.changed.append((k, r)),
                                     on_rejected=lambda spec, result: self.rejected.append((spec, result)),
                                     on_outcome=lambda s, o: self.outcomes.append((s, o)))
        self.service.start()
        return self.service

    def crash(self) -> None:
        """Stop without finishing anything, as a SIGKILL would leave the files."""
        assert self.service is not None
        self.service.scheduler.remove_jobstore("default")  # no further scheduling round (see stop())
        self.service.scheduler.shutdown(wait=False)
        self.service.store.close()


def collapse(model: torch.nn.Module, router: str = GATE) -> None:
    with torch.no_grad():
        dict(model.named_modules())[router].e_score_correction_bias[:2] += 10.0


def spec(**overrides) -> JobSpec:
    return JobSpec(**{"routers": [GATE], "strategies": ["bias"], "business_line": "code",
                      "band": {"metric": "entropy_bits", "low": 2.3, "high": None},
                      "options": {"bias": {"steps": 200, "gamma": 0.05}}, **overrides})


def final(service: RetuneService, job_id: str, timeout: float = 60) -> dict:
    assert wait_until(lambda: service.store.get(job_id)["status"] not in ("pending", "running", "waiting"),
                      timeout=timeout)
    return service.store.get(job_id)
