"""Re-tuning in the running sidecar on the bundled model: a collapsed router pages on-call, the
``bias`` job runs by itself on captured traffic, passes its gates, is promoted between forward
passes and the alert resolves; a damaged router is fine-tuned (or the job is rejected and on-call
told why), restored from the CLI and rolled back exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

import mla_watch
from harness import processes
from harness.helpers import write_rules
from harness.receivers import running_receiver
from harness.support import get_metrics, metric_value, running_sidecar, wait_until
from mla_watch.models import corpus
from mla_watch.models.train import perplexity
from mla_watch.retune.jobs import RetuneSettings
from mla_watch.retune.router_tensors import router_state

pytestmark = pytest.mark.slow

LAYER1 = "model.layers.1.mlp.gate"
TOKEN = "retune-test-token"
RETUNE = ("notify", "retune")  # the rule's actions


PROMPTS = corpus.prompts("code", 64, seed=31)  # 64 distinct function signatures, ~18 tokens: what the gate scores


def traffic(url: str, requests: int, start: int = 0, tokens: int = 24) -> None:
    for index in range(start, start + requests):
        response = httpx.post(
            url + "/v1/completions",
            timeout=120,
            headers={"X-Business-Line": "code_assistant"},
            json={"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": tokens, "seed": index},
        )
        assert response.status_code == 200, response.text


def alerts_for(receiver, alertname: str, status: str, router: str = LAYER1) -> list[dict]:
    return [
        alert
        for request in list(receiver.requests)
        for alert in request.json()["alerts"]
        if alert["status"] == status
        and alert["labels"]["alertname"] == alertname
        and alert["labels"]["router"] == router
    ]


def last_job(url: str) -> dict:
    jobs = httpx.get(url + "/v1/retune/jobs").json()["jobs"]
    return jobs[0] if jobs else {"status": "none"}


def decided(job: dict) -> bool:
    """Ended, or rejected while its router still reads outside its band (then it waits for new traffic)."""
    return job["status"] not in ("pending", "running", "waiting") or bool(
        (job.get("result") or {}).get("rejected_while_outside_band")
    )


def finished_job(url: str, start: int, timeout: float = 400) -> tuple[dict, int]:
    """The newest job once it decided, traffic going on meanwhile (a job short of data waits for more); the
    index of the next request."""
    deadline = time.monotonic() + timeout
    while not decided(last_job(url)) and time.monotonic() < deadline:
        traffic(url, 1, start=start)
        start += 1
    assert decided(last_job(url)), last_job(url)
    return last_job(url), start


def until_paged(url: str, receiver, start: int, limit: int = 30) -> int:
    """Traffic until RoutingEntropyLow pages for layer 1 (the window fills with the fault's routing); the
    index of the next request."""
    for index in range(start, start + limit):
        if alerts_for(receiver, "RoutingEntropyLow", "firing"):
            return index
        traffic(url, 1, start=index)
        wait_until(lambda: alerts_for(receiver, "RoutingEntropyLow", "firing"), timeout=0.5)
    assert alerts_for(receiver, "RoutingEntropyLow", "firing"), f"no page after {limit} requests"
    return start + limit


def held_out_texts() -> list[list[int]]:
    _, tokenizer = mla_watch.load_model("bundled", device="cpu")
    return [
        [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        for text in corpus.generate("code", 24, seed=777)
    ]


def cli(*args: str) -> subprocess.CompletedProcess:
    return processes.run(
        [sys.executable, "-m", "mla_watch.cli", "retune", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "MLA_WATCH_ADMIN_TOKEN": TOKEN},
        timeout=300,
        check=False,
    )


def test_collapse_pages_then_the_bias_job_promotes_itself_and_the_alert_resolves(tmp_path, monkeypatch) -> None:
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        rules = write_rules(tmp_path / "rules", actions=RETUNE, strategies=("bias",))
        settings = RetuneSettings(min_samples=12, retry_seconds=2.0, min_held_out_tokens=200)
        with running_sidecar(
            rules=rules,
            alert_interval=0.2,
            window_tokens=256,
            capture=True,
            retune=settings,
            state_dir=tmp_path / "state",
        ) as (url, sidecar):
            traffic(url, 14)  # captured: the job's data
            model = sidecar.model_worker.model
            with torch.no_grad():
                model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += 10.0  # six experts win everything
            job, sent = finished_job(url, start=until_paged(url, receiver, 14))
            assert job["status"] == "promoted", job["result"]
            assert job["spec"]["trigger"]["source"] == "alert"
            assert job["spec"]["trigger"]["alertname"] == "RoutingEntropyLow"
            assert job["spec"]["routers"] == [LAYER1] and job["spec"]["business_line"] == "code_assistant"
            (attempt,) = job["result"]["attempts"]
            gates = attempt["gates"]
            assert gates["band"] == {"metric": "entropy_bits", "low": 5.2, "high": None}
            assert gates["before"]["entropy_bits"][LAYER1] < 3.0 and gates["after"]["entropy_bits"][LAYER1] >= 5.2
            paired = gates["perplexity"]
            assert paired["decision"] == "pass" and paired["high"] <= paired["limit"]
            assert paired["tokens"] >= settings.min_held_out_tokens
            assert job["result"]["timings"]["trigger_to_promoted_seconds"] > 0
            versions = httpx.get(url + "/v1/retune/versions").json()
            assert versions["live"] == job["result"]["version"] == 1
            manifest = versions["versions"][1]
            assert manifest["strategy"] == "bias" and manifest["tensors"] == [f"{LAYER1}.e_score_correction_bias"]
            assert manifest["data"]["source"] == "capture" and manifest["data"]["business_line"] == "code_assistant"

            # Within +0.3 of the healthy model, on held-out code the job never saw.
            sequences = held_out_texts()
            healthy, _ = mla_watch.load_model("bundled", device="cpu")
            with torch.no_grad(), sidecar.model_worker.model_lock:
                promoted = perplexity(model, sequences)
            with torch.no_grad():
                assert promoted <= perplexity(healthy, sequences) + 0.3

            traffic(url, 6, start=sent)
            assert wait_until(lambda: alerts_for(receiver, "RoutingEntropyLow", "resolved"), timeout=30)
            text = get_metrics(url)
            assert metric_value(text, "mla_watch_retune_jobs_total", strategy="bias", outcome="promoted") == 1
            assert metric_value(text, "mla_watch_router_promotions_total", kind="promote") == 1
            assert metric_value(text, "mla_watch_router_version") == 1
            assert (
                metric_value(text, "mla_watch_retune_captured_samples_total", business_line="code_assistant")
                == sent + 6
            )
            assert PROMPTS[0].split("(")[0] not in text  # captured prompts never reach metrics


def test_damage_finetune_or_rejection_then_restore_and_exact_rollback_from_the_cli(tmp_path, monkeypatch) -> None:
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        rules = write_rules(
            tmp_path / "rules", below=5.4, resolve_above=5.5, actions=RETUNE, strategies=("router_finetune",)
        )
        settings = RetuneSettings(min_samples=12, retry_seconds=2.0, min_held_out_tokens=200)
        with running_sidecar(
            rules=rules,
            alert_interval=0.2,
            window_tokens=256,
            capture=True,
            retune=settings,
            admin_token=TOKEN,
            state_dir=tmp_path / "state",
        ) as (url, sidecar):
            traffic(url, 14)
            model = sidecar.model_worker.model
            healthy = router_state(model)
            weight = model.model.layers[1].mlp.gate.weight
            with torch.no_grad():  # a bad deploy: noise on one router's weights
                weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)))
            damaged = router_state(model)
            job, sent = finished_job(url, start=until_paged(url, receiver, 14))
            rejected = job["status"] == "waiting"  # rejected while the router is still broken: it keeps trying
            assert job["status"] == "promoted" or rejected, job["result"]
            (attempt,) = job["result"]["attempts"]
            assert attempt["strategy"] == "router_finetune"
            details = httpx.get(url + "/v1/retune/versions").json()["versions"][attempt["version"]]["details"]
            assert details["lr"] == 1e-4 and details["epochs"] == 2 and details["routers"] == [LAYER1]
            if rejected:  # on-call hears why, with the figures; nothing changed
                assert wait_until(lambda: alerts_for(receiver, "RouterRetuneRejected", "firing"), timeout=30)
                (notice,) = alerts_for(receiver, "RouterRetuneRejected", "firing")
                assert notice["labels"]["job"] == job["id"]
                assert "router_finetune: rejected (perplexity" in notice["annotations"]["description"]
                assert "outside the band" in notice["annotations"]["description"]
                assert "held-out tokens" in notice["annotations"]["description"]  # the gate's interval and tokens
                assert all(torch.equal(router_state(model)[name], damaged[name]) for name in damaged)
            else:
                gates = attempt["gates"]
                assert gates["passed"] and gates["after"]["entropy_bits"][LAYER1] >= 5.5
            before_restore = router_state(model)
            traffic(url, 24, start=sent)  # the restore job below runs on what was captured: enough for the gate

            if not rejected:  # a promoted job holds the router's cooldown; one still trying does not
                refused = cli(
                    "run",
                    "--url",
                    url,
                    "--router",
                    LAYER1,
                    "--strategy",
                    "restore",
                    "--business-line",
                    "code_assistant",
                    "--wait",
                    "120",
                )
                assert refused.returncode != 0 and "cooldown is 3600 s" in refused.stderr
            restored = cli(
                "run",
                "--url",
                url,
                "--router",
                LAYER1,
                "--strategy",
                "restore",
                "--business-line",
                "code_assistant",
                "--wait",
                "120",
                "--force",
            )
            assert restored.returncode == 0, restored.stdout + restored.stderr
            assert "promoted" in restored.stdout
            live = router_state(model)
            assert all(torch.equal(live[name], healthy[name]) for name in healthy)  # version 0, bit for bit

            listing = cli("list", "--url", url, "--json")
            # the restore promoted; a job still trying for the same router is superseded by it
            assert [job["status"] for job in json.loads(listing.stdout)][:2] == [
                "promoted",
                "superseded" if rejected else job["status"],
            ]
            version = httpx.get(url + "/v1/retune/versions").json()["live"]
            shown = json.loads(cli("show", "--url", url, "--version", str(version)).stdout)
            assert shown["strategy"] == "restore" and shown["live"] is True and shown["details"]["restored_from"] == 0

            rolled = cli("rollback", "--url", url)
            assert rolled.returncode == 0, rolled.stderr
            live = router_state(model)
            assert all(torch.equal(live[name], before_restore[name]) for name in before_restore)  # exact
            assert metric_value(get_metrics(url), "mla_watch_router_promotions_total", kind="rollback") == 1
            nothing = cli("rollback", "--url", url) if rejected else None
            if nothing is not None:
                assert nothing.returncode != 0 and "nothing to roll back" in nothing.stderr
