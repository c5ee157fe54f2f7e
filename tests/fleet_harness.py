"""A fleet of embedded sidecars deployed broken, sharing one PostgreSQL store: what the fleet tests and
``bench/fleet_repair.py`` drive.

Each replica serves the bundled model with MoE layer 1 collapsed (:func:`tests.broken_deploy.collapsed_checkpoint`),
with capture on, ``--reference-model`` the bundled checkpoint (``restore`` puts its router back), the shipped rules
with their holds cut to 0 s, and ``--fleet`` the store. The four short chat prompts of a deployment's first hour go
to every replica in turn until a condition holds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mla_watch.fleet.settings import FleetSettings
from mla_watch.retune.jobs import RetuneSettings
from mla_watch.routing.series import ROUTER_VERSION_INFO
from mla_watch.server.app import ServerConfig, Sidecar
from tests.broken_deploy import BUNDLED, CHAT_PROMPTS, LAYER1, collapsed_checkpoint, scenario_rules
from tests.support import serve_app

__all__ = ["LAYER1", "Replica", "drive", "fleet_replica", "layer1_alerts", "serving", "wait_for"]

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
    return [alert for alert in httpx.get(url + "/v1/alerts", timeout=30).json()["alerts"]
            if alert["labels"].get("router") == LAYER1 and alert["labels"].get("business_line") != "all"]


def serving(url: str) -> tuple[str, str] | None:
    """``(version, digest)`` of the replica's ``router_version_info``."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(ROUTER_VERSION_INFO + "{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            return labels["version"].strip('"'), labels["digest"].strip('"')
    return None


@contextlib.contextmanager
def fleet_replica(name: str, work: Path, fleet_url: str, *, checkpoint: Path, rules: Path, oncall_url: str,
                  retune: RetuneSettings | None = None, reference_interval: float = 30.0,
                  **overrides: Any) -> Iterator[Replica]:
    """One ready replica of the fleet at ``fleet_url`` (its own state directory under ``work``)."""
    config = ServerConfig(model=str(checkpoint), device="cpu", rules=rules, state_dir=work / name, alert_interval=0.5,
                          window_tokens=512, capture=True, retune=retune or RetuneSettings(retry_seconds=5.0),
                          reference_model=BUNDLED, policy_poll_seconds=None, admin_token="fleet-admin-token-0123456789",
                          fleet=FleetSettings(url=fleet_url, name=name, poll_seconds=POLL_SECONDS,
                                              lease_seconds=LEASE_SECONDS),
                          **{"reference": _reference_settings(reference_interval), **overrides})
    previous = os.environ.get("MLA_WATCH_ONCALL_URL")
    os.environ["MLA_WATCH_ONCALL_URL"] = oncall_url  # the rules are read when the sidecar is made
    try:
        sidecar = Sidecar(config)
    finally:
        if previous is None:
            del os.environ["MLA_WATCH_ONCALL_URL"]
        else:
            os.environ["MLA_WATCH_ONCALL_URL"] = previous
    with serve_app(sidecar.app) as url:
        assert sidecar.wait_ready(180), sidecar.load_error
        yield Replica(name, url, sidecar)


def _reference_settings(interval: float) -> Any:
    from mla_watch.cause.prober import ReferenceSettings

    return ReferenceSettings(interval_seconds=interval, wait_seconds=30.0, retry_seconds=2.0)


def broken_fleet_parts(work: Path) -> tuple[Path, Path]:
    """The collapsed checkpoint and the scenario's rules (shipped, holds cut to 0 s)."""
    return collapsed_checkpoint(work / "deployed"), scenario_rules(work / "rules")


def drive(replicas: Sequence[Replica], until: Callable[[], bool], *, timeout: float, check_every: int = 4,
          max_tokens: int = 16) -> bool:
    """Chat traffic to every replica in turn until ``until()`` (checked every ``check_every`` rounds) or
    ``timeout`` seconds; whether it held."""
    deadline = time.monotonic() + timeout
    clients = {replica.name: httpx.Client(base_url=replica.url, timeout=120) for replica in replicas}
    try:
        for round_number, (line, task, prompt) in enumerate(itertools.cycle(CHAT_PROMPTS)):
            if time.monotonic() > deadline:
                return until()
            for replica in replicas:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                        "seed": replica.requests}
                try:
                    answer = clients[replica.name].post("/v1/chat/completions", json=body,
                                                        headers={"X-Business-Line": line, "X-Task": task})
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


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
