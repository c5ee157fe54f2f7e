"""A fleet of embedded sidecars deployed broken, sharing one PostgreSQL store: what the fleet tests and
``bench/fleet_repair.py`` drive.

Each replica serves the bundled model with MoE layer 1 collapsed (:func:`harness.broken_deploy.collapsed_checkpoint`),
with capture on, ``--reference-model`` the bundled checkpoint (``restore`` puts its router back), the shipped rules
with their holds cut to 0 s, and ``--fleet`` the store. The four short chat prompts of a deployment's first hour go
to every replica in turn until a condition holds.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.broken_deploy import BUNDLED, CHAT_PROMPTS, LAYER1, collapsed_checkpoint, scenario_rules, sidecar_paging
from harness.real_vllm_retune import LAYER, LINE, RESOLVE, ROUTER
from harness.real_vllm_retune import rules as engine_rules
from harness.support import serve_app
from mla_watch.fleet.settings import FleetSettings
from mla_watch.retune.jobs import RetuneSettings
from mla_watch.routing.series import ROUTER_VERSION_INFO
from mla_watch.server.app import ServerConfig, Sidecar

__all__ = ["LAYER1", "Replica", "drive", "fleet_replica", "layer1_alerts", "serving"]

# Short rounds and lease: a test cannot wait minutes for a holder's lease to expire.
POLL_SECONDS = 0.5
LEASE_SECONDS = 4.0


@dataclass
class Replica:
    name: str
    url: str
    sidecar: Sidecar
    requests: int = 0
    errors: list[str] = field(default_factory=list)


def layer1_alerts(url: str) -> list[dict[str, Any]]:
    return [
        alert
        for alert in httpx.get(url + "/v1/alerts", timeout=30).json()["alerts"]
        if alert["labels"].get("router") == LAYER1 and alert["labels"].get("business_line") != "all"
    ]


def serving(url: str) -> tuple[str, str] | None:
    """``(version, digest)`` of the replica's ``router_version_info``."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(ROUTER_VERSION_INFO + "{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            return labels["version"].strip('"'), labels["digest"].strip('"')
    return None


@contextlib.contextmanager
def fleet_replica(
    name: str,
    work: Path,
    fleet_url: str,
    *,
    checkpoint: Path,
    rules: Path,
    oncall_url: str,
    retune: RetuneSettings | None = None,
    reference_interval: float = 30.0,
    poll_seconds: float = POLL_SECONDS,
    lease_seconds: float = LEASE_SECONDS,
    **overrides: Any,
) -> Iterator[Replica]:
    """One ready replica of the fleet at ``fleet_url`` (its own state directory under ``work``)."""
    config = ServerConfig(
        model=str(checkpoint),
        device="cpu",
        rules=rules,
        state_dir=work / name,
        alert_interval=0.5,
        window_tokens=512,
        capture=True,
        retune=retune or RetuneSettings(retry_seconds=5.0),
        reference_model=BUNDLED,
        policy_poll_seconds=None,
        admin_token="fleet-admin-token-0123456789",
        fleet=FleetSettings(url=fleet_url, name=name, poll_seconds=poll_seconds, lease_seconds=lease_seconds),
        **{"reference": _reference_settings(reference_interval), **overrides},
    )
    sidecar = sidecar_paging(config, oncall_url)
    with serve_app(sidecar.app) as url:
        assert sidecar.wait_ready(180), sidecar.load_error
        yield Replica(name, url, sidecar)


def _reference_settings(interval: float) -> Any:
    from mla_watch.references.prober import ReferenceSettings

    return ReferenceSettings(interval_seconds=interval, wait_seconds=30.0, retry_seconds=2.0)


def broken_fleet_parts(work: Path) -> tuple[Path, Path]:
    """The collapsed checkpoint and the scenario's rules (shipped, holds cut to 0 s)."""
    return collapsed_checkpoint(work / "deployed"), scenario_rules(work / "rules")


def drive(
    replicas: Sequence[Replica],
    until: Callable[[], bool],
    *,
    timeout: float,
    check_every: int = 4,
    max_tokens: int = 16,
    prompts: Sequence[tuple[str, str, str]] = CHAT_PROMPTS,
) -> bool:
    """Chat traffic (``(business line, task, prompt)`` in turn) to every replica until ``until()`` (checked every
    ``check_every`` rounds) or ``timeout`` seconds; whether it held."""
    deadline = time.monotonic() + timeout
    clients = {replica.name: httpx.Client(base_url=replica.url, timeout=120) for replica in replicas}
    try:
        for round_number, (line, task, prompt) in enumerate(itertools.cycle(prompts)):
            if time.monotonic() > deadline:
                return until()
            for replica in replicas:
                body = {
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "seed": replica.requests,
                }
                try:
                    answer = clients[replica.name].post(
                        "/v1/chat/completions", json=body, headers={"X-Business-Line": line, "X-Task": task}
                    )
                    if answer.status_code != 200:
                        replica.errors.append(f"{answer.status_code} {answer.text[:200]}")
                except httpx.HTTPError as error:
                    replica.errors.append(f"{type(error).__name__}: {error}")
                replica.requests += 1
            if round_number % check_every == check_every - 1 and until():
                return True
    finally:
        for client in clients.values():
            client.close()
    return False


# --------------------------------------------------------------------------------------------- beside real vLLM
@dataclass
class EngineFleetOutcome:
    """Two real vLLM replicas deployed with a collapsed router, each with its sidecar, one fleet."""

    first_page_s: float | None = None  # from the first request to the first alert firing
    one_version_s: float | None = None  # to the rollout's end: every replica on the new version, checked in band
    resolved_s: float | None = None  # to the last alert of the router resolved
    requests: int = 0
    fleet: dict[str, Any] = field(default_factory=dict)  # GET /v1/fleet at the end
    healthy_losses: list[float] = field(default_factory=list)  # a healthy engine's loss of each fixed prompt
    repaired_losses: dict[str, list[float]] = field(default_factory=dict)  # each repaired engine's
    store_load: dict[str, int] = field(default_factory=dict)
    transactions_per_minute: float | None = None


# The collapsed router, its line and its rules are the single engine's (harness/real_vllm_retune.py).
FIXED_PROMPTS = [[1, *range(40 + i, 60 + i)] for i in range(4)]
ENGINE_TOKEN = "real-engine-fleet-token"


def _engine_alerts(url: str) -> list[dict[str, Any]]:
    return [
        alert
        for alert in httpx.get(url + "/v1/alerts", timeout=30).json()["alerts"]
        if alert["labels"].get("router") == ROUTER and alert["labels"].get("business_line") == LINE
    ]


def _engine_bits(url: str) -> float | None:
    routing = httpx.get(url + "/v1/routing", params={"business_line": LINE}, timeout=30).json()
    return next((r["entropy_bits"] for r in routing["routers"] if r["name"] == ROUTER), None)


def engine_fleet_scenario(
    work: Path,
    fleet_url: str,
    *,
    timeout: float = 900.0,
    measure_store: Callable[[], tuple[dict[str, int], float]] | None = None,
) -> EngineFleetOutcome:
    """Two vLLM engines serving a Qwen3-MoE with layer 2's gate zeroed (dev mode, routing returned), each with a
    sidecar (``--engine vllm --capture --engine-retune apply --reference-model`` the healthy checkpoint,
    ``--fleet``): customer-service traffic to both until both serve the fleet's new version, in band, and the
    alerts resolved. A healthy engine scores the fixed prompts first; each repaired engine scores them at the end.
    ``measure_store``: the store's rows and bytes, and its transactions a minute, read at the end."""
    from harness.floods import trimmed_references
    from harness.real_vllm import build_checkpoint, cache_root, running_vllm
    from harness.receivers import running_receiver
    from harness.support import free_port, sidecar_process
    from mla_watch.engines.vllm_weights import VllmWeights

    root = cache_root() / "checkpoints"
    collapsed = build_checkpoint(root, "qwen3_moe", collapsed_layer=LAYER)
    healthy = build_checkpoint(root, "qwen3_moe")
    outcome = EngineFleetOutcome()
    with running_vllm(healthy, routing=True, log_path=work / "vllm-healthy.log") as engine:
        scorer = VllmWeights(engine)
        outcome.healthy_losses = [score.loss for score in scorer.score(FIXED_PROMPTS)]
        scorer.close()
    rules = engine_rules(work / "rules")
    references = trimmed_references(work / "references", default=True)
    names = ("vllm-a", "vllm-b")
    with contextlib.ExitStack() as stack, running_receiver() as receiver:
        engines = {
            name: stack.enter_context(
                running_vllm(collapsed, routing=True, dev_mode=True, log_path=work / f"{name}-engine.log")
            )
            for name in names
        }
        ports = {name: free_port() for name in names}
        for name in names:
            stack.enter_context(
                sidecar_process(
                    ports[name],
                    work / name,
                    "--upstream",
                    engines[name],
                    "--engine",
                    "vllm",
                    "--model-config",
                    str(collapsed),
                    "--capture",
                    "--engine-retune",
                    "apply",
                    "--reference-model",
                    str(healthy),
                    "--rules",
                    str(rules),
                    "--alert-interval",
                    "0.5",
                    "--reference-prompts",
                    str(references),
                    "--retune-min-samples",
                    "12",
                    "--min-held-out-tokens",
                    "60",
                    "--min-held-out-samples",
                    "4",
                    "--retune-retry",
                    "2",
                    "--fleet",
                    fleet_url,
                    "--fleet-name",
                    name,
                    "--fleet-poll",
                    str(POLL_SECONDS),
                    "--fleet-lease",
                    str(max(LEASE_SECONDS, 20.0)),
                    env={"MLA_WATCH_ADMIN_TOKEN": ENGINE_TOKEN, "MLA_WATCH_ONCALL_URL": receiver.url + "/hook"},
                    log=work / f"{name}.log",
                )
            )
        urls = [f"http://127.0.0.1:{ports[name]}" for name in names]
        started, deadline = time.time(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            for url in urls:
                question = f"Where is my parcel, order {4400 + outcome.requests * 7}?"
                body = {
                    "model": "tiny",
                    "max_tokens": 6,
                    "seed": outcome.requests,
                    "messages": [{"role": "user", "content": question}],
                }
                answer = httpx.post(
                    url + "/v1/chat/completions", json=body, headers={"X-Business-Line": LINE}, timeout=120
                )
                answer.raise_for_status()
                outcome.requests += 1
            alerts = [alert for url in urls for alert in _engine_alerts(url)]
            versions = {serving(url) for url in urls}
            if (
                len(versions) == 1
                and None not in versions
                and next(iter(versions))[0] not in ("0", "unknown")
                and all((bits := _engine_bits(url)) is not None and bits >= RESOLVE for url in urls)
                and alerts
                and all(alert["state"] == "resolved" for alert in alerts)
            ):
                break
        outcome.fleet = httpx.get(urls[0] + "/v1/fleet", timeout=30).json()
        _times_from_records(outcome, [alert for url in urls for alert in _engine_alerts(url)], started)
        for name in names:
            scorer = VllmWeights(engines[name])
            outcome.repaired_losses[name] = [score.loss for score in scorer.score(FIXED_PROMPTS)]
            scorer.close()
        if measure_store is not None:
            outcome.store_load, outcome.transactions_per_minute = measure_store()
    return outcome


# --------------------------------------------------------------------------------------------- embedded, timed
@dataclass
class EmbeddedFleetOutcome:
    replicas: int
    first_page_s: float | None = None  # from the first request to the first alert firing
    one_version_s: float | None = None  # to the rollout's end: every replica on the new version, checked in band
    resolved_s: float | None = None  # to the last layer-1 alert resolved
    requests: int = 0
    fleet: dict[str, Any] = field(default_factory=dict)


def embedded_fleet_scenario(
    work: Path, fleet_url: str, *, replicas: int = 3, timeout: float = 600.0, oncall_url: str
) -> EmbeddedFleetOutcome:
    """``replicas`` embedded sidecars deployed with layer 1 collapsed, one fleet, chat traffic until every replica
    serves the fleet's new version in band and every layer-1 alert has resolved."""
    checkpoint, rules = broken_fleet_parts(work)
    outcome = EmbeddedFleetOutcome(replicas)
    with contextlib.ExitStack() as stack:
        fleet = [
            stack.enter_context(
                fleet_replica(
                    f"replica-{index}", work, fleet_url, checkpoint=checkpoint, rules=rules, oncall_url=oncall_url
                )
            )
            for index in range(replicas)
        ]
        urls = [replica.url for replica in fleet]
        started = time.time()

        def done() -> bool:
            versions = {serving(url) for url in urls}
            alerts = [alert for url in urls for alert in layer1_alerts(url)]
            return (
                len(versions) == 1
                and None not in versions
                and next(iter(versions))[0] not in ("0", "unknown")
                and all(_layer1_bits(url) >= 5.2 for url in urls)
                and bool(alerts)
                and all(alert["state"] == "resolved" for alert in alerts)
            )

        drive(fleet, done, timeout=timeout)
        outcome.requests = sum(replica.requests for replica in fleet)
        outcome.fleet = httpx.get(urls[0] + "/v1/fleet", timeout=30).json()
        _times_from_records(outcome, [alert for url in urls for alert in layer1_alerts(url)], started)
    return outcome


def _times_from_records(outcome: Any, alerts: list[dict[str, Any]], started: float) -> None:
    """The outcome's times from the sidecars' and the store's own records (wall clock), not from when a poll saw
    them: the first alert firing, the rollout's end (every replica passed its check: the routers in band on its
    reference prompts), the last alert resolved."""
    fired = [alert["firing_since"] for alert in alerts if alert.get("firing_since")]
    resolved = [alert["resolved_at"] for alert in alerts if alert.get("resolved_at")]
    rollout = outcome.fleet.get("rollout") or {}
    outcome.first_page_s = min(fired) - started if fired else None
    outcome.one_version_s = (
        rollout["ended_at"] - started if rollout.get("state") == "done" and rollout.get("ended_at") else None
    )
    outcome.resolved_s = max(resolved) - started if resolved and all(a["state"] == "resolved" for a in alerts) else None


def _layer1_bits(url: str) -> float:
    records = httpx.get(url + "/v1/routing", timeout=30).json()["routers"]
    return float(next(r["entropy_bits"] for r in records if r["name"] == LAYER1))
