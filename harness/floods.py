"""Traffic or damage, end to end: a healthy sidecar flooded by one client, and a sidecar whose router is damaged.

Shared by tests/test_traffic_or_damage.py and bench/traffic_or_damage.py. Each scenario is a fresh ``serve`` in
this process on the bundled model (``--capture``, the shipped rules and reference prompts, every ``for:`` and
``keep_firing_for:`` cut to 0 s, each receiver's ``group_wait`` cut to :data:`GROUP_WAIT`, alerts judged every
0.5 s), with on-call's and the line owners' webhooks on a real receiver on loopback. Healthy traffic of the four
lines (each from three clients of its own: a baseline is learned from a line's traffic, never one client's) runs
until every line's baseline is learned; then either one client floods ``code_assistant`` (with healthy traffic
going on beside it, one request in four), or a router's correction bias is damaged in place.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from harness.receivers import running_receiver
from harness.support import free_port, running_sidecar, sidecar_process, wait_until
from mla_watch.models import corpus
from mla_watch.shipped import SHIPPED_RULES

__all__ = [
    "FLOODS",
    "GROUP_WAIT",
    "Flood",
    "Outcome",
    "damage_scenario",
    "engine_flood_scenario",
    "flood_scenario",
    "rules_without_waiting",
    "trimmed_references",
]

LINES = {
    "customer_service": ("customer_service", "chat"),
    "code_assistant": ("code", "code"),
    "sql": ("sql", "sql"),
    "doc_summary": ("doc_summary", "summarize"),
}
MAX_TOKENS = 16  # per answer: what moves the windows is the prompts, as in a flood of short completions
FLOOD_CLIENT = "flood-1"
# How long a new group waits for the rest of its incident, in place of the shipped 30 s and 1 m: a flood's alerts
# fired within 11 s of each other here (each waits for a reference reading taken since it went pending).
# The receivers' group_interval stays as shipped (5 m, 10 m): nothing more reaches them during a scenario.
GROUP_WAIT = 30.0
HEALTHY_CLIENTS = 3  # per line: the fewest whose traffic a baseline is learned from (serve --baseline-min-clients)


@dataclass(frozen=True)
class Flood:
    """What one client sends to ``code_assistant``, over and over."""

    name: str
    note: str
    prompts: tuple[str, ...]
    task: str = "code"


def _sql_template(count: int) -> tuple[str, ...]:
    return tuple(
        "\n".join(
            f"SELECT id, total FROM orders WHERE customer_id = {41000 + 7 * i + j} AND total > "
            f"{(i * 13 + j) % 97}.5 ORDER BY id LIMIT {5 + j};"
            for j in range(4)
        )
        for i in range(count)
    )


FLOODS: tuple[Flood, ...] = (
    Flood(
        "one word",
        "4 prompts, one word repeated 100 times each",
        tuple(" ".join([word] * 100) for word in ("select", "return", "value", "error")),
    ),
    Flood(
        "few words, many lengths",
        "2 words x 12 lengths (8 to 96 times): 24 distinct texts of one pattern",
        tuple(" ".join([word] * (8 * (n + 1))) for word in ("index", "table") for n in range(12)),
    ),
    Flood(
        "SQL template",
        "one SQL statement template, 4 to a prompt, with varying constants",
        _sql_template(48),
        task="sql",
    ),
    Flood(
        "another line's traffic",
        "customer-service conversations sent to code_assistant",
        tuple(text[:600] for text in corpus.generate("customer_service", 48, seed=4242)),
        task="chat",
    ),
)


@dataclass
class Outcome:
    name: str
    alerts: list[dict[str, Any]] = field(default_factory=list)  # every alert instance /v1/alerts showed
    oncall: list[dict[str, Any]] = field(default_factory=list)  # alerts on-call's webhook received
    owners: list[dict[str, Any]] = field(default_factory=list)  # alerts the line owners' webhook received
    owner_notifications: list[dict[str, Any]] = field(default_factory=list)  # the bodies the line owners received
    oncall_notifications: list[dict[str, Any]] = field(default_factory=list)  # the bodies on-call received
    jobs: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # router versions on disk
    entropy_before: dict[str, float] = field(default_factory=dict)  # code_assistant, per MoE router
    entropy_after: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    seconds: float = 0.0
    reference: dict[str, Any] = field(default_factory=dict)  # GET /v1/reference at the end
    history_lines: set[str] = field(default_factory=set)  # the lines of the status page's live hour

    def causes(self) -> set[str]:
        return {alert["labels"].get("cause", "") for alert in self.alerts if alert["state"] == "firing"}


def rules_without_waiting(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = (SHIPPED_RULES / "routing.yaml").read_text()
    text = re.sub(r"^(\s+)(for|keep_firing_for): \S+$", r"\1\2: 0s", text, flags=re.M)
    text = re.sub(r"^(\s+)group_wait: \S+$", rf"\1group_wait: {GROUP_WAIT:g}s", text, flags=re.M)
    (directory / "routing.yaml").write_text(text)
    return directory


def _post(url: str, line: str, task: str, prompt: str, client: str) -> None:
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": MAX_TOKENS},
        headers={"X-Business-Line": line, "X-Task": task, "X-Client-Id": client},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text[:300]


def _healthy(seed: int) -> Iterator[tuple[str, str, str, str]]:
    """(policy line, task, prompt, client) of the four lines' healthy traffic, round robin, endlessly."""
    round_ = 0
    while True:
        for name, (domain, task) in LINES.items():
            text = corpus.generate(domain, round_ + 1, seed=seed)[round_]
            line = "code_assistant" if name == "sql" else name
            yield line, task, text[:700], f"app-{name}-{round_ % HEALTHY_CLIENTS}"
        round_ += 1


def _code_entropy(url: str) -> dict[str, float]:
    routing = httpx.get(f"{url}/v1/routing", params={"business_line": "code_assistant"}, timeout=30).json()
    return {
        record["name"]: round(record["entropy_bits"], 3) for record in routing["routers"] if record["kind"] == "expert"
    }


def _learned(url: str) -> bool:
    series = httpx.get(f"{url}/v1/baseline", timeout=30).json()["series"]
    lines = {entry["business_line"] for entry in series}
    return {"customer_service", "code_assistant", "doc_summary"} <= lines


@contextmanager
def _sidecar(work: Path) -> Iterator[tuple[str, Any, Any]]:
    with running_receiver() as receiver:
        saved = {name: os.environ.get(name) for name in ("MLA_WATCH_ONCALL_URL", "MLA_WATCH_LINE_OWNERS_URL")}
        os.environ["MLA_WATCH_ONCALL_URL"] = receiver.url + "/oncall"
        os.environ["MLA_WATCH_LINE_OWNERS_URL"] = receiver.url + "/owners"
        try:
            with running_sidecar(
                state_dir=work / "state", rules=rules_without_waiting(work / "rules"), capture=True, alert_interval=0.5
            ) as (url, sidecar):
                yield url, sidecar, receiver
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _warm_up(url: str, outcome: Outcome, limit: int = 400) -> Iterator[tuple[str, str, str, str]]:
    healthy = _healthy(seed=20261203)
    for _ in range(limit):
        line, task, prompt, client = next(healthy)
        _post(url, line, task, prompt, client)
        outcome.requests += 1
        if outcome.requests % 8 == 0 and _learned(url):
            break
    assert _learned(url), "the healthy warm-up learned no baseline for every line"
    return healthy


def _collect(url: str, sidecar: Any, receiver: Any, outcome: Outcome, started: float) -> Outcome:
    outcome.alerts = httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
    sidecar.alerts.dispatcher.run_once()
    _received(receiver, outcome)
    outcome.jobs = httpx.get(f"{url}/v1/retune/jobs", timeout=30).json()["jobs"]
    outcome.versions = sorted(
        int(entry.name[1:])
        for entry in (sidecar.config.state_dir / "routers").iterdir()
        if re.fullmatch(r"v\d{4,}", entry.name)
    )
    outcome.entropy_after = _code_entropy(url)
    outcome.reference = httpx.get(f"{url}/v1/reference", timeout=30).json()
    outcome.history_lines = {
        series["business_line"] for series in httpx.get(f"{url}/v1/status", timeout=30).json()["history"]["series"]
    }
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def _received(receiver: Any, outcome: Outcome) -> None:
    for request in list(receiver.requests):
        body = request.json()
        (outcome.oncall_notifications if request.path == "/oncall" else outcome.owner_notifications).append(body)
        for alert in body.get("alerts", []):
            (outcome.oncall if request.path == "/oncall" else outcome.owners).append(alert)


def _delivered(url: str) -> None:
    """Waits until the outbox holds no notification: every one written so far has reached its receiver (or failed
    for good), so what the receiver holds is complete."""
    wait_until(
        lambda: httpx.get(f"{url}/v1/alerts", timeout=30).json()["notifications_pending"] == 0, timeout=30, interval=0.1
    )


def _owners_told(receiver: Any, line: str) -> bool:
    return any(
        request.path == "/owners" and request.json()["groupLabels"].get("business_line") == line
        for request in list(receiver.requests)
    )


def _code_alerts(url: str) -> list[dict[str, Any]]:
    return [
        alert
        for alert in httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
        if alert["labels"].get("business_line") == "code_assistant" and alert["state"] == "firing"
    ]


def flood_scenario(flood: Flood, *, requests: int = 60, settle: float = 20.0) -> Outcome:
    """A healthy warm-up, then ``requests`` of ``flood`` from one client (one healthy request of another line in
    four beside it), then ``settle`` seconds for the alerts and their causes."""
    started = time.monotonic()
    outcome = Outcome(flood.name)
    with tempfile.TemporaryDirectory() as work, _sidecar(Path(work)) as (url, sidecar, receiver):
        healthy = _warm_up(url, outcome)
        outcome.entropy_before = _code_entropy(url)
        for index in range(requests):
            _post(url, "code_assistant", flood.task, flood.prompts[index % len(flood.prompts)], FLOOD_CLIENT)
            if index % 4 == 3:
                _post(url, *next(healthy))
            outcome.requests += 1
        wait_until(
            lambda: bool(_code_alerts(url)) and all("cause" in alert["labels"] for alert in _code_alerts(url)),
            timeout=settle,
            interval=0.5,
        )
        # the line owners' group of the incident waits GROUP_WAIT from its first alert, then is told
        wait_until(lambda: _owners_told(receiver, "code_assistant"), timeout=GROUP_WAIT + 10.0, interval=0.5)
        _delivered(url)  # anything else due reaches the receiver
        return _collect(url, sidecar, receiver, outcome, started)


def damage_scenario(router: str, experts: tuple[int, ...], bias: float, *, requests: int = 800) -> Outcome:
    """A healthy warm-up, then ``bias`` added in place to ``experts`` of ``router``'s correction bias while healthy
    traffic goes on, until a re-tune job has ended and no alert on that router fires (or ``requests`` more)."""
    started = time.monotonic()
    outcome = Outcome(f"damage {router}")
    with tempfile.TemporaryDirectory() as work, _sidecar(Path(work)) as (url, sidecar, receiver):
        healthy = _warm_up(url, outcome)
        outcome.entropy_before = _code_entropy(url)
        model = sidecar.model_worker.model
        with sidecar.model_worker.model_lock, torch.no_grad():
            dict(model.named_modules())[router].e_score_correction_bias[list(experts)] += bias
        for index in range(requests):
            _post(url, *next(healthy))
            outcome.requests += 1
            if index % 4:
                continue
            jobs = httpx.get(f"{url}/v1/retune/jobs", timeout=30).json()["jobs"]
            firing = [
                alert
                for alert in httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
                if alert["labels"].get("router") == router and alert["state"] == "firing"
            ]
            if any(job["status"] in ("promoted", "rejected", "failed") for job in jobs) and not firing:
                break
        _delivered(url)
        return _collect(url, sidecar, receiver, outcome, started)


# --------------------------------------------------------------------------- beside a real vLLM
ENGINE_MAX_TOKENS = 8


def _engine_post(url: str, line: str, task: str, prompt: str, client: str) -> None:
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": ENGINE_MAX_TOKENS},
        headers={"X-Business-Line": line, "X-Task": task, "X-Client-Id": client},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text[:300]


def _engine_healthy(index: int) -> tuple[str, str, str, str]:
    name = ("customer_service", "code_assistant", "sql", "doc_summary")[index % 4]
    domain, task = LINES[name]
    text = corpus.generate(domain, index // 4 + 1, seed=20261204)[index // 4][:900]
    return ("code_assistant" if name == "sql" else name), task, text, f"app-{name}-{index // 4 % HEALTHY_CLIENTS}"


def trimmed_references(directory: Path, prompts: int = 8, *, default: bool = False) -> Path:
    """The shipped reference sets cut to their first ``prompts`` prompts each: a CPU engine reads one in about
    15 s, not the whole set's minute. The mixed default set only with ``default`` (the floods send lines that
    have sets of their own: each set read costs every reading); no long set (no flood sends long prompts)."""
    import yaml

    from mla_watch.shipped import SHIPPED_REFERENCES

    directory.mkdir(parents=True, exist_ok=True)
    for file in SHIPPED_REFERENCES.glob("*.yaml"):
        if file.stem == "default" and not default:
            continue
        document = yaml.safe_load(file.read_text())
        if document.get("long"):
            continue
        document["prompts"] = document["prompts"][:prompts]
        (directory / file.name).write_text(yaml.safe_dump(document, sort_keys=False))
    return directory


def engine_flood_scenario(engine: str, checkpoint: Path, work: Path, flood: Flood, *, requests: int = 48) -> Outcome:
    """:func:`flood_scenario` beside a real vLLM at ``engine`` serving ``checkpoint``: a fresh ``mla-watch serve
    --engine vllm --capture --engine-retune apply`` process, its reference prompts (the shipped sets, 8 prompts
    each) read through the engine."""
    started = time.monotonic()
    outcome = Outcome(flood.name)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        running_receiver() as receiver,
        sidecar_process(
            port,
            work / "state",
            "--upstream",
            engine,
            "--engine",
            "vllm",
            "--model-config",
            str(checkpoint),
            "--capture",
            "--engine-retune",
            "apply",
            "--rules",
            str(rules_without_waiting(work / "rules")),
            "--alert-interval",
            "0.5",
            "--reference-interval",
            "0",
            "--reference-prompts",
            str(trimmed_references(work / "references")),
            env={
                "MLA_WATCH_ONCALL_URL": receiver.url + "/oncall",
                "MLA_WATCH_LINE_OWNERS_URL": receiver.url + "/owners",
            },
            log=work / "sidecar.log",
        ),
    ):
        index = 0
        while not _learned(url):
            assert index < 160, "no baseline learned for every line"
            _engine_post(url, *_engine_healthy(index))
            index += 1
        outcome.requests = index
        assert wait_until(
            lambda: all(entry["baseline"] for entry in httpx.get(f"{url}/v1/reference", timeout=30).json()["sets"]),
            timeout=600,
            interval=1,
        ), httpx.get(f"{url}/v1/reference", timeout=30).json()
        outcome.entropy_before = _code_entropy(url)
        for step in range(requests):
            _engine_post(url, "code_assistant", flood.task, flood.prompts[step % len(flood.prompts)], FLOOD_CLIENT)
            if step % 4 == 3:
                _engine_post(url, *_engine_healthy(index))
                index += 1
            outcome.requests += 1
        wait_until(
            lambda: bool(_code_alerts(url)) and all("cause" in a["labels"] for a in _code_alerts(url)),
            timeout=60,
            interval=0.5,
        )
        _delivered(url)
        outcome.alerts = httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
        if _code_alerts(url):  # some floods move this tiny engine's routing past no threshold
            wait_until(lambda: _owners_told(receiver, "code_assistant"), timeout=GROUP_WAIT + 10.0, interval=0.5)
            _delivered(url)
        _received(receiver, outcome)
        outcome.jobs = httpx.get(f"{url}/v1/retune/jobs", timeout=30).json()["jobs"]
        outcome.versions = [
            entry["version"] for entry in httpx.get(f"{url}/v1/retune/versions", timeout=30).json()["versions"]
        ]
        outcome.entropy_after = _code_entropy(url)
        outcome.reference = httpx.get(f"{url}/v1/reference", timeout=30).json()
        outcome.seconds = round(time.monotonic() - started, 1)
        return outcome
