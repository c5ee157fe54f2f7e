"""A stop inside a pod's grace: SIGTERM to a sidecar beside a slow engine, while a reference prompt is in flight
(and, before it, a streamed request counted within seconds of its end while the reference round runs).

The process ends (exit 0) within the documented ``STOP_SECONDS``; the reading in flight is discarded, so no
baseline is learned after the signal; the alert state and the outbox (a page its receiver has not taken yet)
are on disk, whole.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from harness.support import free_port, metric_value, serve_app, sidecar_process, wait_until
from mla_watch.common.stop_budget import STOP_SECONDS
from mla_watch.engines.geometry import parse_geometry
from mla_watch.references.readings import BASELINE_FILE
from tests.slow_engine import ReferenceTwin

CONFIG = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}

# Fires on the first answer of the line `customer_service`: its pages wait in the outbox (the receiver refuses).
RULE = """
receivers:
  - name: oncall
    type: alertmanager_webhook
    url: http://127.0.0.1:{port}/hook
    timeout: 1s
    max_attempts: 12
    group_wait: 0s
rules:
  - alert: StopFlood
    metric: entropy_bits
    select: {{kind: expert, business_line: customer_service}}
    above: 0.0
    resolve_below: 0.0
    for: 0s
    min_tokens: 1
    severity: critical
    actions: [notify]
    annotations:
      summary: "{{router}}: {{value:.2f}} bits"
"""

PROMPTS = [
    "where is my order, it was due on monday",
    "please summarise the attached quarterly report",
    "write a function that reverses a linked list",
    "what is the refund policy for damaged goods",
]


def refused_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


@pytest.mark.slow
def test_sigterm_during_a_reference_reading_ends_the_sidecar_in_its_grace_with_its_state_saved(tmp_path: Path) -> None:
    config, rules, references, state = (
        tmp_path / "config.json",
        tmp_path / "rules",
        tmp_path / "references",
        tmp_path / "state",
    )
    config.write_text(json.dumps(CONFIG))
    rules.mkdir()
    references.mkdir()
    (rules / "flood.yaml").write_text(RULE.format(port=refused_port()))
    (references / "default.yaml").write_text(
        "business_line: default\nversion: 1\nprompts:\n" + "".join(f"  - {prompt!r}\n" for prompt in PROMPTS)
    )
    twin = ReferenceTwin(parse_geometry(CONFIG), score_seconds=4.0)  # each reference prompt: 4 s in the engine
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with (
        serve_app(twin.app) as twin.url,
        sidecar_process(
            port,
            state,
            "--upstream",
            twin.url,
            "--engine",
            "vllm",
            "--model-config",
            str(config),
            "--rules",
            str(rules),
            "--reference-prompts",
            str(references),
            "--reference-wait",
            "0",
            "--reference-interval",
            "0",
            "--reference-long-interval",
            "0",
            "--alert-interval",
            "0.5",
            "--decode-workers",
            "0",
            log=log,
        ) as process,
    ):
        answer = httpx.post(
            url + "/v1/completions",
            json={"prompt": "flood " * 20, "max_tokens": 4},
            headers={"X-Business-Line": "customer_service"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text

        def paged() -> bool:
            with sqlite3.connect(state / "outbox.sqlite") as outbox:
                return outbox.execute("SELECT count(*) FROM outbox").fetchone()[0] > 0

        assert wait_until(paged, timeout=30, interval=0.2), log.read_text()[-3000:]
        assert wait_until(lambda: twin.scoring > 0, timeout=30, interval=0.05), log.read_text()[-3000:]
        # During the round, a streamed request is counted within seconds of its end: the reader starves no count.
        streamed = httpx.post(
            url + "/v1/completions",
            json={"prompt": "stream me " * 10, "max_tokens": 4, "stream": True},
            headers={"X-Business-Line": "customer_service"},
            timeout=30,
        )
        assert streamed.status_code == 200 and "[DONE]" in streamed.text, streamed.text[-500:]

        def counted() -> float:
            return metric_value(
                httpx.get(url + "/metrics", timeout=10).text,
                "mla_watch_engine_responses_total",
                engine="vllm",
                outcome="counted",
            )

        assert wait_until(lambda: counted() == 2, timeout=5, interval=0.1), (counted(), log.read_text()[-3000:])
        assert twin.scored < len(PROMPTS)  # the round was still under way
        assert wait_until(lambda: twin.scoring > 0, timeout=30, interval=0.05), log.read_text()[-3000:]
        baselines_at_signal = read_bytes(state / BASELINE_FILE)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_SECONDS:g} s after SIGTERM:\n{log.read_text()[-3000:]}")
        print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
        assert code == 0, log.read_text()[-3000:]
        # The reading in flight ended in the engine (4 s) after the signal, and was not learned.
        assert wait_until(lambda: twin.scoring == 0, timeout=10)
    text = log.read_text()
    assert read_bytes(state / BASELINE_FILE) == baselines_at_signal, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    with sqlite3.connect(state / "outbox.sqlite") as outbox:
        assert outbox.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        pages = outbox.execute("SELECT receiver, body FROM outbox").fetchall()
    assert pages and all(receiver == "oncall" and b"StopFlood" in body for receiver, body in pages), pages
    alerts = json.loads((state / "alerts.json").read_text())
    assert "StopFlood" in json.dumps(alerts)


def test_the_pod_examples_give_a_grace_that_covers_the_stop() -> None:
    import yaml

    for name in ("vllm-pod.yaml", "sglang-pod.yaml"):
        pod = yaml.safe_load((Path(__file__).parent.parent / "deploy" / name).read_text())
        assert pod["spec"]["terminationGracePeriodSeconds"] >= 2 * STOP_SECONDS, name
