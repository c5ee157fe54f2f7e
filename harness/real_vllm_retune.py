"""A sidecar that re-tunes the routers of a real vLLM beside it (``--engine vllm --capture --engine-retune``), the
traffic and the readings around it: shared by tests/test_real_vllm_retune.py and bench/retune.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from harness.floods import trimmed_references
from harness.support import free_port, sidecar_process
from mla_watch.alerting.examples import entropy_low_rules

__all__ = [
    "BELOW",
    "GATE",
    "LAYER",
    "LINE",
    "RESOLVE",
    "ROUTER",
    "TOKEN",
    "alert_state",
    "bits",
    "jobs",
    "layer_pages",
    "pages",
    "retuning_sidecar",
    "rules",
    "send",
    "until_resolved",
]

TOKEN = "real-engine-retune-token"
LAYER = 2
ROUTER = f"model.layers.{LAYER}.mlp.gate"
LINE = "customer_service"
# 16 experts, top-4: 2 to 4 bits. On these short prompts the healthy gates read ~2.6 to 2.7, the zeroed one 2.0.
BELOW, RESOLVE = 2.3, 2.45
GATE = (
    "--retune-min-samples",
    "12",
    "--min-held-out-tokens",
    "60",
    "--min-held-out-samples",
    "4",
    "--retune-retry",
    "2",
)


def rules(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "routing.yaml").write_text(
        entropy_low_rules(
            below=BELOW,
            resolve_above=RESOLVE,
            min_tokens=64,
            actions=("notify", "retune"),
            strategies=("restore",),
            group_by=False,
        )
    )
    return directory


@contextmanager
def retuning_sidecar(
    upstream: str,
    checkpoints: tuple[Path, Path],
    state: Path,
    mode: str,
    receiver_url: str,
    reference: Path | None = None,
) -> Iterator[str]:
    port = free_port()
    collapsed, healthy = checkpoints
    with sidecar_process(
        port,
        state,
        "--upstream",
        upstream,
        "--engine",
        "vllm",
        "--model-config",
        str(collapsed),
        "--capture",
        "--engine-retune",
        mode,
        "--reference-model",
        str(reference or healthy),
        "--rules",
        str(rules(state.parent / f"{state.name}-rules")),
        "--alert-interval",
        "0.5",
        "--reference-prompts",
        str(trimmed_references(state.parent / f"{state.name}-references", default=True)),
        *GATE,
        env={"MLA_WATCH_ADMIN_TOKEN": TOKEN, "MLA_WATCH_ONCALL_URL": receiver_url},
        log=state.parent / f"{state.name}.log",
    ):
        yield f"http://127.0.0.1:{port}"


def send(url: str, start: int, count: int) -> None:
    for index in range(start, start + count):
        body = {
            "model": "tiny",
            "max_tokens": 6,
            "seed": index,
            "messages": [{"role": "user", "content": f"Where is my parcel, order {4400 + index * 7}?"}],
        }
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Business-Line": LINE}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert "token_ids" not in json.dumps(answer.json()["choices"])  # asked for by the proxy, kept from the client


def alert_state(url: str) -> str | None:
    for alert in httpx.get(url + "/v1/alerts", timeout=30).json()["alerts"]:
        if alert["labels"].get("router") == ROUTER and alert["labels"].get("business_line") == LINE:
            return alert["state"]
    return None


def bits(url: str) -> float:
    routing = httpx.get(url + "/v1/routing", params={"business_line": LINE}, timeout=30).json()
    return next(r["entropy_bits"] for r in routing["routers"] if r["name"] == ROUTER)


def jobs(url: str) -> list[dict]:
    return httpx.get(url + "/v1/retune/jobs", timeout=30).json()["jobs"]


def pages(receiver) -> list[dict]:
    return [alert for request in list(receiver.requests) for alert in request.json().get("alerts", [])]


def layer_pages(receiver) -> list[tuple[str, str]]:
    return [
        (alert["labels"]["alertname"], alert["status"])
        for alert in pages(receiver)
        if alert["labels"].get("router") == ROUTER and alert["labels"].get("business_line") == LINE
    ]


def until_resolved(url: str, start: int, limit: int = 80) -> int:
    """Traffic until the layer's alert has resolved (or ``limit`` requests); the next request index."""
    index = start
    while index < start + limit and alert_state(url) != "resolved":
        send(url, index, 2)
        index += 2
    return index
