"""A model deployed broken, served with capture on: does the re-tune loop close by itself?

The scenario of issue 15, shared by ``tests/test_retune_broken_deploy.py`` and ``bench/retune.py``:
a checkpoint of the bundled model whose MoE layer 1 router is collapsed (correction bias +10 on
six experts) is what the sidecar starts with (so router version 0 *is* the damage), with traffic
capture on, the shipped rules (``for`` / ``keep_firing_for`` cut to 0 s so that it runs in
minutes) and a loopback webhook receiver as on-call. Short prompts of the four business lines,
repeated, 16 tokens each, go on until every layer-1 alert has resolved or the time is up.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

import mla_watch
from harness.receivers import running_receiver
from harness.support import serve_app
from mla_watch.models import corpus
from mla_watch.retune.jobs import FINAL_STATUSES, RetuneSettings
from mla_watch.server.app import ServerConfig, Sidecar

LAYER1 = "model.layers.1.mlp.gate"
BUNDLED = Path(mla_watch.__file__).parent / "models" / "bundled"
SHIPPED_RULES = Path(mla_watch.__file__).parent / "shipped" / "rules" / "routing.yaml"
# (business line, task) of the shipped policies -> the corpus domain its prompts come from
TRAFFIC = {
    ("customer_service", "chat"): "customer_service",
    ("code_assistant", "code"): "code",
    ("code_assistant", "sql"): "sql",
    ("doc_summary", "summarize"): "doc_summary",
}


def sidecar_paging(config: ServerConfig, oncall_url: str) -> Sidecar:
    """A sidecar whose shipped rules page ``oncall_url`` (the rules read MLA_WATCH_ONCALL_URL when it is made)."""
    previous = os.environ.get("MLA_WATCH_ONCALL_URL")
    os.environ["MLA_WATCH_ONCALL_URL"] = oncall_url
    try:
        return Sidecar(config)
    finally:
        if previous is None:
            del os.environ["MLA_WATCH_ONCALL_URL"]
        else:
            os.environ["MLA_WATCH_ONCALL_URL"] = previous


def collapsed_checkpoint(directory: Path) -> Path:
    """The bundled model with layer 1's router pushed towards six experts (DESIGN: reads 2.585 bits), saved as a
    checkpoint in ``directory``."""
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += 10.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    shutil.copy(BUNDLED / "chat_template.jinja", directory / "chat_template.jinja")
    return directory


# Chat traffic as a deployment sees it at first: four short prompts in turn, each repeated again and again.
CHAT_PROMPTS = [
    ("customer_service", "chat", "Where is my parcel?"),
    ("code_assistant", "code", "def add(a, b):"),
    ("code_assistant", "sql", "SELECT * FROM t WHERE"),
    ("doc_summary", "summarize", "Summarize: sales rose."),
]


def prompts(per_kind: int = 6) -> list[tuple[str, str, str]]:
    """``(business line, task, prompt)``: the first line or so of a few corpus samples of each, short as chat's."""
    out = []
    for (line, task), domain in TRAFFIC.items():
        for text in corpus.generate(domain, per_kind, seed=15):
            out.append((line, task, text[:60]))
    return out


def scenario_rules(directory: Path) -> Path:
    """The shipped rules with their hold times and their receivers' waits cut to 0 s (a test cannot wait 7 minutes
    per incident)."""
    directory.mkdir(parents=True, exist_ok=True)
    text = SHIPPED_RULES.read_text()
    text = re.sub(r"(?m)^(\s+)for: 2m$", r"\1for: 0s", text)
    text = re.sub(r"(?m)^(\s+)keep_firing_for: 5m$", r"\1keep_firing_for: 0s", text)
    text = re.sub(r"(?m)^(\s+)(group_wait|group_interval): \S+$", r"\1\2: 0s", text)
    (directory / "routing.yaml").write_text(text)
    return directory


@dataclass
class Outcome:
    fired_after_s: float | None = None  # from the first request
    resolved_after_s: float | None = None  # every layer-1 alert resolved
    requests: int = 0
    jobs: list[dict[str, Any]] = field(default_factory=list)
    pages: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (alertname, line) -> statuses received
    bits_before: float | None = None
    bits_after: float | None = None


def _layer1_alerts(url: str) -> list[dict[str, Any]]:
    return [
        alert
        for alert in httpx.get(url + "/v1/alerts", timeout=30).json()["alerts"]
        if alert["labels"]["router"] == LAYER1 and alert["labels"].get("business_line") != "all"
    ]


def _layer1_bits(url: str) -> float | None:
    records = httpx.get(url + "/v1/routing", timeout=30).json()["routers"]
    return next((r["entropy_bits"] for r in records if r["name"] == LAYER1), None)


def run_scenario(
    work: Path,
    *,
    reference: bool,
    settings: RetuneSettings,
    timeout: float = 900.0,
    max_tokens: int = 16,
    chat: bool = False,
    seed: int = 0,
) -> Outcome:
    """Serve the collapsed checkpoint (``reference``: with ``--reference-model`` the bundled one) until
    every layer-1 alert has fired and resolved, or ``timeout`` seconds; what happened.

    ``chat``: the four :data:`CHAT_PROMPTS` in turn as chat completions, else :func:`prompts` as completions;
    ``seed`` offsets the requests' sampling seeds (one run of several)."""
    checkpoint = collapsed_checkpoint(work / "deployed")
    rules = scenario_rules(work / "rules")
    outcome = Outcome()
    with running_receiver() as receiver:
        config = ServerConfig(
            model=str(checkpoint),
            device="cpu",
            rules=rules,
            state_dir=work / "state",
            alert_interval=0.5,
            window_tokens=512,
            capture=True,
            retune=settings,
            reference_model=BUNDLED if reference else None,
            policy_poll_seconds=None,
            admin_token=None,
        )
        sidecar = sidecar_paging(config, receiver.url + "/hook")
        with serve_app(sidecar.app) as url:
            assert sidecar.wait_ready(180), sidecar.load_error
            start = time.monotonic()
            fired: set[str] = set()
            with httpx.Client(base_url=url, timeout=120) as client:
                for line, task, prompt in itertools.cycle(CHAT_PROMPTS if chat else prompts()):
                    if time.monotonic() - start > timeout:
                        break
                    headers = {"X-Business-Line": line, "X-Task": task}
                    body: dict[str, Any] = {"max_tokens": max_tokens, "seed": seed * 100_000 + outcome.requests}
                    if chat:
                        body["messages"] = [{"role": "user", "content": prompt}]
                    else:
                        body["prompt"] = prompt
                    client.post(
                        "/v1/chat/completions" if chat else "/v1/completions", headers=headers, json=body
                    ).raise_for_status()
                    outcome.requests += 1
                    if outcome.requests % 8:
                        continue
                    alerts = _layer1_alerts(url)
                    firing = {a["labels"]["business_line"] for a in alerts if a["state"] == "firing"}
                    if firing and outcome.fired_after_s is None:
                        outcome.fired_after_s = time.monotonic() - start
                        outcome.bits_before = _layer1_bits(url)
                    fired |= firing
                    if fired and not firing and all(a["state"] == "resolved" for a in alerts):
                        outcome.resolved_after_s = time.monotonic() - start
                        break
            outcome.bits_after = _layer1_bits(url)
            outcome.jobs = sidecar.retune.store.list(limit=50) if sidecar.retune else []
            deadline = time.monotonic() + 30  # the last resolution's delivery
            while time.monotonic() < deadline and sidecar.alerts is not None and sidecar.alerts.outbox.pending():
                time.sleep(0.1)
        for request in receiver.requests:
            for alert in request.json().get("alerts", []):
                if alert["labels"].get("router") == LAYER1:
                    key = (alert["labels"]["alertname"], alert["labels"].get("business_line", ""))
                    outcome.pages.setdefault(key, []).append(alert["status"])
    shutil.rmtree(checkpoint, ignore_errors=True)
    return outcome


def final_jobs(outcome: Outcome) -> list[dict[str, Any]]:
    return [job for job in outcome.jobs if job["status"] in FINAL_STATUSES]
