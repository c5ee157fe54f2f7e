"""A re-tune service on a tiny DeepSeek-V3.2 model, with captured traffic, that tests can restart."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from harness.support import wait_until
from mla_watch.alerting.vocabulary import Rule, Selector
from mla_watch.retune.capture import TrafficCapture
from mla_watch.retune.health import startup_health
from mla_watch.retune.jobs import JobSpec, RetuneSettings
from mla_watch.retune.reference import RouterReference
from mla_watch.retune.runner import Retuner
from mla_watch.retune.service import RetuneService
from mla_watch.retune.versions import RouterVersions
from tests.tiny_models import VOCAB, build

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


# The start-up health check's rule for the tiny model (8 experts, top-2: 1 to 3 bits; collapse() reads 1.0).
HEALTH_RULES = [Rule(name="TinyRouterCollapse", metric="entropy_bits", selector=Selector(kind="expert"), below=1.5)]


class CharTokenizer:
    """Text to the tiny model's ids, one per character: what the start-up health check reads."""

    pad_token_id = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(char) % (VOCAB - 3) for char in text[:64]]}


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
        self.reference: RouterReference | None = None

    def start(self) -> RetuneService:
        registry = RouterVersions(self.state / "routers")
        tokenizer = CharTokenizer()
        retuner = Retuner(
            model=self.model,
            tokenizer=tokenizer,
            versions=registry,
            settings=self.settings,
            workdir=self.state / "work",
            promote=lambda version: self.service.promote(version),
            capture=self.capture,
            model_lock=self.lock,
            reference=self.reference,
            health_rules=lambda: HEALTH_RULES,
        )
        self.service = RetuneService(
            state_dir=self.state,
            settings=self.settings,
            retuner=retuner,
            versions=registry,
            model_lock=self.lock,
            on_promoted=lambda k, r: self.changed.append((k, r)),
            on_rejected=lambda spec, result: self.rejected.append((spec, result)),
            on_outcome=lambda s, o: self.outcomes.append((s, o)),
            health_check=lambda host: startup_health(host.model, tokenizer, HEALTH_RULES),
        )
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
    return JobSpec(
        **{
            "routers": [GATE],
            "strategies": ["bias"],
            "business_line": "code",
            "band": {"metric": "entropy_bits", "low": 2.3, "high": None},
            "options": {"bias": {"steps": 200, "gamma": 0.05}},
            **overrides,
        }
    )


def final(service: RetuneService, job_id: str, timeout: float = 60) -> dict:
    assert wait_until(
        lambda: service.store.get(job_id)["status"] not in ("pending", "running", "waiting"), timeout=timeout
    )
    return service.store.get(job_id)
